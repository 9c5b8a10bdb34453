"""kill -9 of a whole replica of an HSDP trainer group (trainer.parallelism:
hsdp, 2 replicas x 2 shards on the tiny model, gloo), in a running elastic job
(`reflow run` with cluster.workers: 5, four of them training). The other
replica holds every shard the lost one held, so the leader rebuilds the group
from the survivors, each keeping its shards where they are (nothing moves), and
trains the step the deaths broke again. The job SUCCEEDS with every step
recorded once, on four ranks before the loss and two after."""

from __future__ import annotations

import json
import subprocess
import sys

import psutil
import pytest

from tests.faults.test_elastic_kill import _kill_at, _succeeded
from tests.faults.test_kill_service import REPO, _assert_ledger_balances, _records

NUM_STEPS, KILL_AT = 10, 4
SPEC = """
name: hsdp-kill
mode: reflow
model: {{path: {model}}}
task: {{name: repeat, args: {{max_count: 16, num_symbols: 4}}}}
rollout: {{group_size: 4, max_tokens: 16, kv_cache_gb: 0.5}}
trainer: {{batch_size: 8, num_steps: {steps}, learning_rate: 0.001, batch_timeout_s: 240,
           parallelism: hsdp, shard_size: 2}}
replay: {{max_staleness: 1}}
scheduler: {{placement: false}}
cluster: {{workers: 5, trainer_workers: 4}}
"""


@pytest.mark.slow
def test_an_hsdp_job_that_loses_a_whole_replica_goes_on_with_the_other(tmp_path, tiny_model):
    spec = tmp_path / "hsdp.yaml"
    spec.write_text(SPEC.format(model=tiny_model, steps=NUM_STEPS))
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "reflow.cli", "run", str(spec), "--out",
                             str(out)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    cli = psutil.Process(proc.pid)
    try:
        # Ranks 2 and 3 (workers 2 and 3): replica 1, both of its shards.
        killed_at, doomed = _kill_at(proc, cli, out, "worker-2", KILL_AT)
        doomed += _kill_at(proc, cli, out, "worker-3", KILL_AT)[1]
    except BaseException:
        proc.kill()
        raise
    _succeeded(proc, tmp_path, doomed)

    records = _records(out / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, NUM_STEPS + 1))
    versions = [r["policy_version"] for r in records]
    assert versions == sorted(versions) and len(set(versions)) == len(versions)
    by_step = {r["step"]: r for r in records}
    assert {by_step[s]["trainer_workers"] for s in range(1, KILL_AT + 1)} == {4}
    assert {by_step[s]["trainer_workers"] for s in range(KILL_AT + 2, NUM_STEPS + 1)} == {2}
    assert all(r["trained_tokens"] > 0 for r in records)
    assert records[-1]["trainer_group_breaks"] >= 1
    left = [e for e in _records(out / "scheduler_events.jsonl")
            if e.get("event") == "worker_left_pool"]
    assert sorted(e["name"] for e in left) == ["worker-2", "worker-3"], left
    leader_log = (out / "logs" / "worker-0.log").read_text()
    # The survivors kept their shards: the rebuild moved no rows between processes.
    assert "shards 0 B to joiners, 0 B between members" in leader_log, leader_log[-3000:]
    _assert_ledger_balances(records, [])
    print(json.dumps({"hsdp_replica_loss_to_next_step_s": round(
        min(r["recorded_at"] for r in records if r["recorded_at"] > killed_at) - killed_at, 2)}))
