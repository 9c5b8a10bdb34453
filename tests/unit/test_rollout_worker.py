"""The rollout worker's admission, with a scripted engine: a sample's concurrency
slot is freed when that sample ends (sample-level streaming), and each worker of a
job draws its own prompts and seed."""

import asyncio
import time

from reflow.core.config import parse_job_spec
from reflow.rollout.engine import TokenDelta
from reflow.rollout.service import worker_seed
from reflow.rollout.tasks import build_task
from reflow.rollout.worker import RolloutWorker


class StaggeredEngine:
    """Sample i of a group ends after (i + 1) * 50 ms; records when each starts."""

    def __init__(self) -> None:
        self.started: list[tuple[str, float]] = []
        self.ended: dict[str, float] = {}

    async def generate(self, request_id, prompt_ids, sampling):
        self.started.append((request_id, time.monotonic()))
        index = int(request_id.rsplit("-", 1)[1])
        await asyncio.sleep(0.05 * (index + 1))
        self.ended[request_id] = time.monotonic()
        yield TokenDelta(token_ids=[3], logprobs=[-0.1], finished=True, finish_reason="stop")

    def shutdown(self):
        pass


class Puts:
    def __init__(self):
        self.groups = []

    def put(self, job_id, trajectories):
        self.groups.append(trajectories)
        return len(trajectories)

    def acquire_dispatch(self, job_id, want, group_size, outstanding_limit, version_limit):
        return want  # slots, not the budget, are under test here


def test_a_finished_sample_frees_its_slot_before_its_group_ends():
    spec = parse_job_spec({"model": {"path": "/m"}, "mode": "fully_async",
                           "rollout": {"group_size": 4, "max_inflight_samples": 6},
                           "trainer": {"batch_size": 8}, "replay": {"max_staleness": 1}})
    engine, puts = StaggeredEngine(), Puts()
    worker = RolloutWorker("j", spec, lambda: engine, build_task("repeat", 8, 3, seed=0), puts,
                           encode=lambda text: [1, 2], decode=lambda ids: "a")
    worker.start()
    try:
        deadline = time.monotonic() + 10
        while len(puts.groups) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        worker.stop()
    assert len(puts.groups) >= 2
    groups = {}
    for request_id, at in engine.started:
        groups.setdefault(request_id.rsplit("-", 1)[0], []).append((request_id, at))
    first, second = sorted(groups.values(), key=lambda g: min(t for _, t in g))[:2]
    last_of_first = max(engine.ended[r] for r, _ in first)
    # The second group needed 4 free slots of 6: it started once two samples of the
    # first had ended, while the first group's slowest sample was still generating.
    assert min(t for _, t in second) < last_of_first
    assert worker.counters.inflight_samples >= 0


def test_each_rollout_worker_of_a_job_has_its_own_prompts_and_seed():
    spec = parse_job_spec({"model": {"path": "/m"}, "seed": 7})
    seeds = [worker_seed(spec, rank) for rank in (1, 2, 3)]
    assert seeds[0] == 7 and len(set(seeds)) == 3
    streams = []
    for seed in seeds:
        prompts = build_task("repeat", 48, 6, seed=seed + 1).prompts()
        streams.append([next(prompts).text for _ in range(20)])
    assert streams[0] != streams[1] != streams[2] != streams[0]


def test_ports_handed_out_together_are_distinct():
    from reflow.procs import free_ports

    for _ in range(50):
        ports = free_ports(6)
        assert len(set(ports)) == 6
