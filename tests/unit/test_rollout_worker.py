"""Each rollout worker of a job samples with its own seed (the prompts come from
the job's one dispatcher: tests/unit/test_dispatch.py)."""

from reflow.core.config import parse_job_spec
from reflow.rollout.service import worker_seed
from tests.unit.fake_engines import PausableEngine


def test_each_rollout_worker_of_a_job_has_its_own_sampling_seed():
    spec = parse_job_spec({"model": {"path": "/m"}, "seed": 7})
    seeds = [worker_seed(spec, rank) for rank in (1, 2, 3)]
    assert seeds[0] == 7 and len(set(seeds)) == 3


def test_ports_handed_out_together_are_distinct():
    from reflow.procs import free_ports

    for _ in range(50):
        ports = free_ports(6)
        assert len(set(ports)) == 6


def test_without_partial_rollout_an_update_waits_for_started_samples_only():
    """verl one_step_off: the update waits for the samples generating under the old
    weights; a group submitted meanwhile waits for the update instead of holding
    it up, then generates under the new version."""
    import asyncio
    import threading
    import time

    from reflow.rollout.engine import TokenDelta
    from reflow.rollout.tasks import build_task
    from reflow.rollout.worker import RolloutWorker

    class Engine(PausableEngine):
        async def generate(self, request_id, prompt_ids, sampling):
            assert not self.paused, "a request reached a paused engine"
            await asyncio.sleep(0.2)
            yield TokenDelta(token_ids=[3], logprobs=[-0.1], finished=True, finish_reason="stop")

    class Puts:
        def __init__(self):
            self.groups = {}

        def put(self, job_id, trajectories):
            self.groups[trajectories[0].group_id] = trajectories
            return len(trajectories)

    spec = parse_job_spec({"model": {"path": "/m"}, "mode": "one_step_off",
                           "rollout": {"group_size": 2}, "trainer": {"batch_size": 4}})
    puts = Puts()
    worker = RolloutWorker("j", spec, Engine, build_task("repeat", 8, 3, seed=0), puts,
                           encode=lambda text: [1, 2], decode=lambda ids: "a")
    worker.start()
    worker.wait_ready(10)
    prompts = build_task("repeat", 8, 3, seed=0).prompts()
    try:
        assert worker.submit_group("old", next(prompts))
        time.sleep(0.05)  # generating under v0
        timings = []
        update = threading.Thread(
            target=lambda: timings.append(worker.call(worker._update_weights(1), 10)))
        update.start()
        time.sleep(0.05)  # the update now waits for "old"
        assert worker.submit_group("new", next(prompts))
        update.join(5)
        assert not update.is_alive(), "the update waited on a group that waits for it"
        # Its pause covers "old" finishing (about 0.15 s of its 0.2 s were left): the
        # trainer counts that wait as idle, not as weight transfer.
        (pause_s, _), = timings
        assert pause_s >= 0.1
        deadline = time.monotonic() + 5
        while len(puts.groups) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        worker.stop()
    versions = {g: {s.policy_version for t in ts for s in t.segments}
                for g, ts in puts.groups.items()}
    assert versions == {"old": {0}, "new": {1}}
