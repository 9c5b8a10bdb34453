"""An HSDP trainer group (trainer.parallelism: hsdp, replicas of 2 shards on the
tiny model, gloo) in a running elastic job (`reflow run`, cluster.workers: 5):
it starts as one replica (workers 0 and 1), a second replica joins by role
flips of workers 3 and 4 at one sync boundary (cluster.flips, a replica at a
time), copying its shards from the first, and then that replica's two workers
are SIGKILLed. The first replica holds every shard the lost one held, so the
leader rebuilds the group from it, each survivor keeping its shards (nothing
moves), and trains the step the deaths broke again. The job SUCCEEDS with every
step recorded once, on two ranks, then four, then two."""

from __future__ import annotations

import json
import subprocess
import sys

import psutil
import pytest

from tests.faults.test_elastic_kill import _kill_at, _succeeded
from tests.faults.test_kill_service import REPO, _assert_ledger_balances, _records

NUM_STEPS, JOIN_AT, KILL_AT = 8, 2, 4
SPEC = """
name: hsdp-kill
mode: reflow
model: {{path: {model}}}
task: {{name: repeat, args: {{max_count: 16, num_symbols: 4}}}}
rollout: {{group_size: 4, max_tokens: 16, kv_cache_gb: 0.5}}
trainer: {{batch_size: 8, num_steps: {steps}, learning_rate: 0.001, batch_timeout_s: 240,
           parallelism: hsdp, shard_size: 2, collective_timeout_s: 15}}
replay: {{max_staleness: 1}}
scheduler: {{placement: false}}
cluster:
  workers: 5
  trainer_workers: 2
  flips:
    - {{at_step: {join}, worker: 3, role: trainer}}
    - {{at_step: {join}, worker: 4, role: trainer}}
"""


@pytest.mark.slow
def test_an_hsdp_replica_joins_by_flips_and_its_loss_leaves_the_other_training(tmp_path,
                                                                               tiny_model):
    spec = tmp_path / "hsdp.yaml"
    spec.write_text(SPEC.format(model=tiny_model, steps=NUM_STEPS, join=JOIN_AT))
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "reflow.cli", "run", str(spec), "--out",
                             str(out)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    cli = psutil.Process(proc.pid)
    try:
        # Workers 3 and 4: ranks 2 and 3 of the group since the flips, replica 1.
        killed_at, doomed = _kill_at(proc, cli, out, "worker-3", KILL_AT)
        doomed += _kill_at(proc, cli, out, "worker-4", KILL_AT)[1]
    except BaseException:
        proc.kill()
        raise
    _succeeded(proc, tmp_path, doomed)

    records = _records(out / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, NUM_STEPS + 1))
    versions = [r["policy_version"] for r in records]
    assert versions == sorted(versions) and len(set(versions)) == len(versions)
    sizes = [r["trainer_workers"] for r in records]
    # 1 x 2, then 2 x 2 from the flips' step (its boundary waits for them), then
    # 1 x 2 after the loss.
    assert sizes[:JOIN_AT - 1] == [2] * (JOIN_AT - 1), sizes
    assert sizes[JOIN_AT - 1:KILL_AT] == [4] * (KILL_AT - JOIN_AT + 1), sizes
    assert set(sizes[KILL_AT + 1:]) == {2}, sizes
    assert all(r["trained_tokens"] > 0 for r in records)
    assert records[-1]["trainer_group_breaks"] >= 1
    events = _records(out / "scheduler_events.jsonl")
    flips = [e for e in events if e.get("event") == "role_flip"]
    # One membership change for the replica: both workers in it, shards copied in.
    assert [(e["worker"], e["to"], e["replica"]) for e in flips] == [
        (3, "trainer", [3, 4]), (4, "trainer", [3, 4])], flips
    assert len({e["membership_epoch"] for e in flips}) == 1
    # The new replica's two ranks receive a shard each from the ranks holding it:
    # one model's worth in all (torch.chunk rounds each cut up), nothing else moves.
    join = flips[0]
    assert 0.9 * join["state_bytes"] <= join["shard_bytes_to_joiners"] <= join["state_bytes"]
    assert join["shard_bytes_between_members"] == 0, join
    left = [e for e in events if e.get("event") == "worker_left_pool"]
    assert sorted(e["name"] for e in left) == ["worker-3", "worker-4"], left
    leader_log = (out / "logs" / "worker-0.log").read_text()
    # The survivors kept their shards: the rebuild moved no rows between processes.
    assert "shards 0 B to joiners, 0 B between members" in leader_log, leader_log[-3000:]
    _assert_ledger_balances(records, [])
    print(json.dumps({
        "hsdp_replica_join_s": flips[0]["total_s"],
        "hsdp_replica_loss_to_next_step_s": round(
            min(r["recorded_at"] for r in records if r["recorded_at"] > killed_at)
            - killed_at, 2)}))
