"""Rewards that raise, hang past their timeout or return NaN cannot hurt a
rollout worker: each marks its sample (`reward_error`, counted by reason), the
job goes on and finishes, and no NaN reaches the weights.

The misbehaving reward is the example plug-in package's `unreliable_reward`
task, installed as an operator would (tests/integration/test_plugin_package.py):
reward pool processes build tasks by registered name only, so a test task must
be a real entry point, not a class the test defines.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.integration.test_plugin_package import plugin_path, run_with_plugins  # noqa: F401

REPO = Path(__file__).resolve().parents[2]

POOL_SCRIPT = """
    import json, time
    from reflow.tasks import Prompt, TaskContext
    from reflow.tasks.rewards import RewardPool

    # Per process: call 2 is NaN, 3 raises, 4 NaN, 5 sleeps past the timeout (its
    # process is replaced, and the new one counts from 1 again).
    pool = RewardPool("unreliable_reward", {"nan_every": 2, "raise_every": 3,
                      "sleep_every": 5, "sleep_s": 60}, TaskContext(), num_workers=1,
                      timeout_s=1.5)
    prompt = Prompt("p0", "c x 3 =", "c:3")
    results = []
    for _ in range(7):
        started = time.monotonic()
        r = pool.score(prompt, "c c c")
        results.append([r.value, r.error, round(time.monotonic() - started, 1)])
    pool.close()
    print(json.dumps(results))
"""


def test_a_reward_pool_turns_raising_hanging_and_nan_rewards_into_marked_results(plugin_path):  # noqa: F811 - the fixture
    results = run_with_plugins(plugin_path, POOL_SCRIPT)
    assert [error for _, error, _ in results] == [
        "", "non_finite", "exception", "non_finite", "timeout", "", "non_finite"]
    assert results[0][0] == 1.0 and results[5][0] == 1.0
    assert all(value == 0.0 for value, error, _ in results if error)


def _reward_errors(run_dir: Path, client: httpx.Client) -> dict[str, float]:
    """The rollout worker's reflow_rollout_reward_errors_total by reason, scraped
    from its /metrics (prometheus-targets.json lists it)."""
    targets = json.loads((run_dir / "prometheus-targets.json").read_text())
    found: dict[str, float] = {}
    for target in targets:
        if target["labels"]["service"].startswith("rollout"):
            text = client.get(f"http://{target['targets'][0]}/metrics").text
            for line in text.splitlines():
                if line.startswith("reflow_rollout_reward_errors_total{"):
                    reason = line.split('reason="')[1].split('"')[0]
                    found[reason] = float(line.rsplit(" ", 1)[1])
    return found


@pytest.mark.slow
def test_a_job_with_failing_rewards_finishes_and_counts_them_by_reason(plugin_path, tmp_path,  # noqa: F811 - the fixture
                                                                        tiny_model):
    import torch
    from safetensors.torch import load_file

    out = tmp_path / "run"
    spec = tmp_path / "unreliable.yaml"
    spec.write_text(f"""
name: unreliable
model: {{path: {tiny_model}}}
task:
  name: unreliable_reward
  args: {{raise_every: 7, nan_every: 5, sleep_every: 11, sleep_s: 60}}
  reward_timeout_s: 2
  reward_workers: 2
  # The worst 16 samples in a row hold 4 NaNs (every 5th), 3 raises (every 7th), 2
  # sleepers (every 11th) and a call timed out behind a sleeper: 10 (seen once, which
  # failed the job at 0.6). The breaker must not trip on the plug-in's own rate.
  max_reward_error_rate: 0.8
  reward_error_window: 16
rollout: {{group_size: 4, max_tokens: 16, max_inflight_samples: 16, kv_cache_gb: 0.25}}
trainer: {{num_steps: 6, batch_size: 16}}
""")
    proc = subprocess.Popen(
        [sys.executable, "-m", "reflow.cli", "run", str(spec), "--out", str(out)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONPATH": plugin_path})
    errors: dict[str, float] = {}
    deadline = time.monotonic() + 600
    with httpx.Client(timeout=5) as client:
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                errors = _reward_errors(out, client) or errors
            except (OSError, httpx.HTTPError, KeyError, IndexError, ValueError):
                pass  # not up yet, or already gone
            time.sleep(1.0)
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, output[-4000:]
    assert json.loads((out / "summary.json").read_text())["phase"] == "SUCCEEDED"
    assert {"exception", "non_finite", "timeout"} <= set(errors), errors
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 6
    assert all(torch.isfinite(torch.tensor(r["reward_mean"])) for r in records)
    weights = load_file(next((out / "checkpoint").glob("*.safetensors")))
    assert all(torch.isfinite(t).all() for t in weights.values())
