"""The modes benchmark's summary: spread over runs, ratios within a round."""

from reflow.benchmarks import modes


def _records(tokens: int, wait: float, steps: int = 12) -> list[dict]:
    return [{"step": i + 1, "step_time_s": 1.0, "batch_wait_s": wait, "weight_sync_s": 0.1,
             "trained_tokens": tokens, "reward_mean": 0.1 * i, "wall_time_s": float(i + 1),
             "rollout_idle_ratio": 0.2, "rollout_utilisation": 0.5, "max_staleness": 1,
             "fresh_samples": 8, "stale_samples": 0, "replay_samples": 0,
             "replay_fraction": 0.0} for i in range(steps)]


def test_summary_and_spread_over_runs(capsys):
    runs = [modes.summarize_mode(_records(t, 0.5), warmup=2, target=0.3) for t in (100, 300, 200)]
    for r in runs:
        r["vs_sync"] = r["trainer_tokens_per_s"] / 100
    assert runs[0]["trainer_tokens_per_s"] == 100.0
    assert runs[0]["trained_samples"] == 12 * 8
    assert runs[0]["rollout_utilisation"] == 0.5
    s = modes.spread(runs)
    assert (s["median"]["trainer_tokens_per_s"], s["min"]["trainer_tokens_per_s"],
            s["max"]["trainer_tokens_per_s"]) == (200.0, 100.0, 300.0)
    assert s["median"]["vs_sync"] == 2.0
    result = {"generation_share_of_sync_step": {"median": 0.8, "min": 0.7, "max": 0.9},
              "entries": {"sync": {"runs": runs, **s}}}
    modes.print_table("rollout_bound", result)
    out = capsys.readouterr().out
    assert "generation is 80% of a sync step" in out
    assert "200 [100-300]" in out


def test_every_entry_is_a_mode_and_sync_is_among_them():
    assert set(modes.ENTRIES) >= set(modes.MODES)
    assert all(mode in modes.MODES for mode, _, _ in modes.ENTRIES.values())
    assert set(modes.WORKLOADS) == {"balanced", "rollout_bound"}
