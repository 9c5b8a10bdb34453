"""An FSDP trainer group changing membership by moving shards (trainer/reshard.py)
over real gloo groups of processes: 2 ranks train, a third joins (2 -> 3), the
second leaves (3 -> 2), two steps at each membership. After the six steps the
parameters and AdamW moments are the single unsharded trainer's on the same
batches, every parameter's step count is carried across both changes, and the
joiner receives its own third of the state, not the whole of it."""

import json
import subprocess
import sys

import pytest

from reflow.procs import free_port

pytestmark = pytest.mark.slow

TOLERANCE = 1e-5  # as test_fsdp_trainer.py: fp32, reduce-scatter order


def _ports(n):
    ports: list[int] = []
    while len(ports) < n:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ",".join(map(str, ports))


@pytest.fixture(scope="module")
def reports(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("reshard")
    ports = _ports(6)
    procs = [subprocess.Popen([sys.executable, "-m", "tests.integration.reshard_rank",
                               tiny_model, str(out / f"p{i}.json"), ports, str(i)])
             for i in range(3)]
    for p in procs:
        assert p.wait(timeout=300) == 0
    result = [json.loads((out / f"p{i}.json").read_text()) for i in range(3)]
    print(json.dumps(result))
    return result


def test_a_group_that_grows_and_shrinks_trains_the_single_trainers_weights(reports):
    leader = reports[0]
    assert leader["max_abs_diff"] < TOLERANCE, leader
    assert leader["max_exp_avg_diff"] < TOLERANCE, leader
    # Two steps at each of three memberships: the count moved with the moments.
    assert leader["steps"] == [6.0], leader


def test_a_joiner_receives_its_own_shard_and_a_leaver_hands_its_shard_on(reports):
    full = reports[0]["full_state_bytes"]
    joiner = reports[2]
    assert joiner["received"][0] is None  # not there for the first membership
    # Rank 2 of 3 holds a third of every tensor's rows (torch.chunk's cut rounds up).
    assert 0.25 * full < joiner["received"][1] <= full / 3 * 1.1, (joiner, full)
    # The first membership moves nothing: every rank shards the weights it loaded.
    assert all(r["received"][0] in (0, None) for r in reports)
    # Process 1 leaves at the third membership: its rows [1/3, 2/3) go to the two
    # that stay, which end up with half each.
    assert reports[0]["received"][2] > 0 and reports[2]["received"][2] > 0
    assert reports[1]["received"][2] == 0
    assert reports[0]["received"][2] + reports[2]["received"][2] <= full / 3 * 1.1


def test_hsdp_trains_the_single_trainers_weights_and_survives_a_lost_replica(tiny_model,
                                                                             tmp_path):
    """trainer.parallelism hsdp, 2 replicas x 2 shards over gloo: two steps, then
    replica 1 is gone and the other goes on alone for two more from the shards it
    holds (nothing moves). The weights and moments are the single trainer's."""
    ports = _ports(4)
    procs = [subprocess.Popen([sys.executable, "-m", "tests.integration.reshard_rank",
                               tiny_model, str(tmp_path / f"p{i}.json"), ports, str(i), "hsdp"])
             for i in range(4)]
    for p in procs:
        assert p.wait(timeout=300) == 0
    reports = [json.loads((tmp_path / f"p{i}.json").read_text()) for i in range(4)]
    leader = reports[0]
    assert leader["max_abs_diff"] < TOLERANCE, leader
    assert leader["max_exp_avg_diff"] < TOLERANCE, leader
    assert leader["steps"] == [4.0], leader
    # The survivors' rebuild moved no rows: each kept its shard.
    assert [r["received"] for r in reports[:2]] == [[0, 0], [0, 0]], reports


def test_an_hsdp_rank_waiting_on_a_rank_that_gave_the_step_up_is_freed(tiny_model, tmp_path):
    """The survivor of a lost replica can be left in a collective with a rank that
    gave the step up and lives on (the leader), whose sockets gloo keeps open while
    FSDP holds the group: the mesh's own timeout (trainer.collective_timeout_s, 5 s
    here against the group's 600 s) frees it with an error counted as a broken
    group, so it stands by for the rebuild instead of missing it."""
    port = _ports(1)
    out = tmp_path / "survivor.json"
    procs = [subprocess.Popen([sys.executable, "-m", "tests.integration.mesh_timeout_rank",
                               tiny_model, str(out), port, str(i)]) for i in range(2)]
    try:
        assert procs[1].wait(timeout=120) == 0
    finally:
        procs[0].kill()
        procs[0].wait()
    outcome = json.loads(out.read_text())
    print(json.dumps(outcome))
    assert outcome["ended"] == "failed", outcome
    assert outcome["collective_failed"], outcome
