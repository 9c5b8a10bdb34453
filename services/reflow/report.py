"""Run artefacts: `summary.json` and `report.png` from a run's metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def summarize(records: list[dict[str, Any]], window: int = 10) -> dict[str, Any]:
    """Headline numbers of a run. `reward_gain` compares the mean reward of the
    last `window` steps with that of the first `window`."""
    if not records:
        return {"steps": 0}
    rewards = [r["reward_mean"] for r in records]
    first, last = rewards[:window], rewards[-window:]
    return {
        "steps": records[-1]["step"],
        "policy_version": records[-1]["policy_version"],
        "wall_time_s": records[-1]["wall_time_s"],
        "trained_tokens": sum(r["trained_tokens"] for r in records),
        "reward_first_mean": _mean(first),
        "reward_last_mean": _mean(last),
        "reward_gain": _mean(last) - _mean(first),
        "trainer_tokens_per_s_mean": _mean([r["trainer_tokens_per_s"] for r in records]),
        # Replay trains some samples again: the tokens trained for the first time
        # (absent from records written before these were recorded).
        **_first_use(records),
        "step_time_s_mean": _mean([r["step_time_s"] for r in records]),
        "trainer_idle_ratio_mean": _mean([r["trainer_idle_ratio"] for r in records]),
        "rollout_idle_ratio_mean": _mean([r["rollout_idle_ratio"] for r in records]),
        "rollout_utilisation_mean": _mean([r.get("rollout_utilisation", 0.0) for r in records]),
        "max_staleness": max(r["max_staleness"] for r in records),
        # Held-out evaluations (eval.interval): the first and the last.
        **_eval_summary(records),
        # Start-up, outside every figure above (the step clock starts after it).
        "engine_startup_s": records[0].get("engine_startup_s"),
        "trainer_startup_s": records[0].get("trainer_startup_s"),
    }


def _first_use(records: list[dict[str, Any]]) -> dict[str, Any]:
    if not all("first_use_tokens" in r for r in records):
        return {}
    return {"first_use_tokens": sum(r["first_use_tokens"] for r in records),
            "first_use_tokens_per_s_mean": _mean([r["first_use_tokens_per_s"] for r in records])}


# The k-sample metrics of an evaluation (trainer/evaluation.py), where a record has them.
EVAL_METRICS = (("eval_pass_at_1", "pass@1"), ("eval_pass_at_k", "pass@k"),
                ("eval_avg_at_k", "avg@k"), ("eval_maj_at_k", "maj@k"))
EVAL_CURVES = (("eval_pass_at_1", "pass@1", "tab:red"), ("eval_pass_at_k", "pass@k", "tab:purple"),
               ("eval_maj_at_k", "maj@k", "tab:brown"))


def _eval_summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    evals = [r for r in records if "eval_reward" in r]
    if not evals:
        return {}
    first, last = evals[0], evals[-1]
    summary = {"eval_reward_first": first["eval_reward"],
               "eval_reward_first_version": first["eval_policy_version"],
               "eval_reward_last": last["eval_reward"],
               "eval_reward_last_version": last["eval_policy_version"]}
    # The last evaluation's pass@1, pass@k, avg@k and maj@k (and its k), where it has them.
    if "eval_k" in last:
        summary["eval_k"] = last["eval_k"]
    summary.update({f"{key}_last": last[key] for key, _ in EVAL_METRICS if key in last})
    return summary


def plot(records: list[dict[str, Any]], out: str | Path, title: str = "") -> None:
    """Reward and trainer throughput against wall-clock time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [r["wall_time_s"] for r in records]
    fig, (ax_r, ax_t) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    ax_r.plot(t, [r["reward_mean"] for r in records], color="tab:blue", label="batch mean")
    evals = [(r["wall_time_s"], r["eval_reward"]) for r in records if "eval_reward" in r]
    if evals:
        ax_r.plot(*zip(*evals), color="tab:orange", marker="o", label="held-out (eval)")
        # pass@1, pass@k and maj@k beside it (avg@k is eval_reward when no reward failed).
        for key, name, color in EVAL_CURVES:
            points = [(r["wall_time_s"], r[key], r["eval_k"]) for r in records if key in r]
            if points:
                t_eval, values, ks = zip(*points)
                ax_r.plot(t_eval, values, color=color, marker=".", linestyle="--",
                          label=f"held-out {name.replace('@k', f'@{ks[-1]}')}")
        ax_r.legend(loc="best")
    ax_r.set_ylabel("reward")
    ax_r.grid(alpha=0.3)
    ax_t.plot(t, [r["trainer_tokens_per_s"] for r in records], color="tab:green")
    ax_t.set_ylabel("trainer tokens/s")
    ax_t.set_xlabel("wall-clock time (s)")
    ax_t.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
