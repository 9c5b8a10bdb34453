"""The modes benchmark's summary: spread over runs, ratios within a round."""

import json

import pytest

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
    assert set(modes.WORKLOADS) == {"balanced", "rollout_bound", "math"}
    assert set(modes.DEFAULT_WORKLOADS) == {"balanced", "rollout_bound"}


@pytest.mark.parametrize("entry", sorted(modes.ENTRIES))
@pytest.mark.parametrize("workload", sorted(modes.WORKLOADS))
def test_every_entry_is_a_valid_job_on_every_workload(entry, workload):
    """The bench runs `reflow run CONFIG mode=M WORKLOAD... ENTRY...`: each of those
    specs must load, with the entry's own settings in force."""
    from reflow.core.config import load_job_spec

    mode, overrides, _ = modes.ENTRIES[entry]
    config = modes.WORKLOAD_CONFIGS.get(workload, "examples/bench_modes.yaml")
    spec = load_job_spec(modes.REPO / config,
                         [f"mode={mode}", *modes.WORKLOADS[workload], *overrides])
    assert spec.mode == mode
    for override in overrides:
        path, value = override.split("=", 1)
        section, field = path.split(".")
        assert str(getattr(getattr(spec, section), field)).lower() == value.lower(), override


def test_the_wait_for_rollout_workers_to_pause_counts_as_idle():
    """one_step_off's trainer waits inside the weight sync for the batch in flight."""
    records = [dict(r, sync_wait_s=0.05) for r in _records(100, 0.25)]
    summary = modes.summarize_mode(records, warmup=2, target=0.3)
    assert summary["trainer_idle_ratio"] == pytest.approx(0.30)
    assert summary["breakdown_s"] == pytest.approx(
        {"wait_for_batch": 0.25, "wait_for_rollout_pause": 0.05, "train": 0.65,
         "weight_sync": 0.05})


def test_timed_optimisation_splits_the_train_share_from_the_bookkeeping():
    """Records with the trainer's own `train_s` separate the optimisation from the
    round trips around it; records without it keep the one `train` share."""
    records = [dict(r, sync_wait_s=0.05, train_s=0.5) for r in _records(100, 0.25)]
    summary = modes.summarize_mode(records, warmup=2, target=0.3)
    assert summary["breakdown_s"] == pytest.approx(
        {"wait_for_batch": 0.25, "wait_for_rollout_pause": 0.05, "train": 0.5,
         "step_bookkeeping": 0.15, "weight_sync": 0.05})
    mixed = records[:6] + _records(100, 0.25)[6:]
    assert "step_bookkeeping" not in modes.summarize_mode(mixed, 2, 0.3)["breakdown_s"]


def _write_run(root, entry: str, run: int, records: list[dict]) -> None:
    run_dir = root / "balanced" / f"{entry}-{run}"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_trl_entry_ratios_and_unreached_targets(tmp_path, capsys):
    # TRL's records carry no rollout utilisation (it has no separate engine).
    trl = [{k: v for k, v in r.items() if k != "rollout_utilisation"} for r in _records(200, 0.6)]
    for run in (1, 2, 3):
        _write_run(tmp_path, "sync", run, _records(100, 0.7))
        _write_run(tmp_path, "reflow", run, _records(300 + 10 * run, 0.1))
        _write_run(tmp_path, "trl", run, trl)
    # The reflow reward curve never reaches 0.3 in round 3 only.
    flat = _records(330, 0.1)
    for r in flat:
        r["reward_mean"] = 0.0
    (tmp_path / "balanced" / "reflow-3" / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in flat))
    assert modes.main(["--out", str(tmp_path), "--entries", "sync,reflow", "--workloads",
                       "balanced", "--with-trl", "--from-runs", "--warmup", "2"]) == 0
    result = json.loads((tmp_path / "results.json").read_text())["balanced"]["entries"]
    assert [r["vs_trl"] for r in result["reflow"]["runs"]] == [1.55, 1.6, 1.65]
    assert result["reflow"]["median"]["vs_trl"] == 1.6
    assert result["trl"]["median"]["vs_sync"] == 2.0
    assert result["trl"]["runs"][0]["rollout_utilisation"] is None
    # Unreached in one run: no median that would flatter it, and the table says so.
    assert "time_to_target_reward_s" not in result["reflow"]["median"]
    assert result["reflow"]["missing_runs"]["time_to_target_reward_s"] == 1
    assert result["trl"]["median"]["time_to_target_reward_s"] == 10.0
    out = capsys.readouterr().out
    assert "vs trl" in out and "none in 1 runs" in out


def test_with_trl_needs_its_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("REFLOW_TRL_PYTHON", str(tmp_path / "missing" / "python"))
    with pytest.raises(SystemExit, match="make bench-trl-env"):
        modes.main(["--out", str(tmp_path), "--entries", "sync", "--with-trl"])


def test_first_use_tokens_per_second_is_summarised_beside_trained_tokens(capsys):
    """Replay trains some samples again: the table shows both rates; runs recorded
    before first_use_tokens existed have none."""
    records = [dict(r, first_use_tokens=60) for r in _records(100, 0.5)]
    summary = modes.summarize_mode(records, warmup=2, target=0.3)
    assert (summary["trainer_tokens_per_s"], summary["first_use_tokens_per_s"]) == (100.0, 60.0)
    assert modes.summarize_mode(_records(100, 0.5), warmup=2, target=0.3)[
        "first_use_tokens_per_s"] is None
    summary["vs_sync"] = 1.0
    modes.print_table("balanced", {
        "generation_share_of_sync_step": {"median": 0.5, "min": 0.5, "max": 0.5},
        "entries": {"sync": {"runs": [summary], **modes.spread([summary])}}})
    out = capsys.readouterr().out
    assert "first-use tok/s" in out and "60 [60-60]" in out
