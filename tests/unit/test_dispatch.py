"""The job's global dispatcher over real RolloutWorkers with scripted engines:
a sample's concurrency slot is freed when that sample ends (sample-level
streaming), each prompt goes to exactly one worker, routing follows load, and
token-budget admission keeps a small KV cache from being over-committed."""

import asyncio
import time

from reflow.core.config import parse_job_spec
from reflow.rollout.client import RolloutStats
from reflow.rollout.engine import TokenDelta
from reflow.tasks import TaskContext
from reflow.tasks.repeat import RepeatTask
from reflow.rollout.worker import RolloutWorker
from reflow.scheduler.generation.dispatch import Dispatcher


class StaggeredEngine:
    """Sample i of a group ends after (i + 1) * `unit_s`, with `tokens` tokens;
    records when each starts and ends."""

    def __init__(self, unit_s: float = 0.05, tokens: int = 1, kv_cache_tokens: int = 0) -> None:
        self.unit_s, self.tokens, self.kv_cache_tokens = unit_s, tokens, kv_cache_tokens
        self.started: list[tuple[str, float]] = []
        self.ended: dict[str, float] = {}

    async def generate(self, request_id, prompt_ids, sampling):
        self.started.append((request_id, time.monotonic()))
        index = int(request_id.rsplit("-", 1)[1])
        await asyncio.sleep(self.unit_s * (index + 1))
        self.ended[request_id] = time.monotonic()
        yield TokenDelta(token_ids=[3] * self.tokens, logprobs=[-0.1] * self.tokens,
                         finished=True, finish_reason="stop")

    def shutdown(self):
        pass


class Budget:
    """The replay buffer's side of dispatch: a budget that grants everything asked
    (slots and routing are under test here; tests/integration/test_dispatch_budget.py
    covers the real grant), and a record of what was put."""

    def __init__(self, limit: int = 10**9) -> None:
        self.limit, self.granted, self.groups = limit, 0, []

    def acquire_dispatch(self, job_id, want, group_size, outstanding_limit, version_limit):
        got = min(want, self.limit - self.granted) // group_size * group_size
        self.granted += got
        return got

    def stats(self, job_id):
        return type("Stats", (), {"policy_version": 0})()

    def put(self, job_id, trajectories):
        self.groups.append(trajectories)
        return len(trajectories)


class OneWorker:
    """A RolloutWorker behind the client interface the dispatcher uses."""

    def __init__(self, worker: RolloutWorker) -> None:
        self.worker = worker
        self.prompts: list[str] = []

    def submit_group(self, job_id, group_id, prompt, concurrency_cap=0, bounds=None):
        self.prompts.append(prompt.prompt_id)
        return self.worker.submit_group(group_id, prompt, concurrency_cap, bounds)

    def wait_events(self, job_id, since_seq, wait_s):
        return self.worker.wait_events(since_seq, wait_s)

    def set_sync_place(self, job_id, rank, world_size):
        self.worker.set_sync_place(rank, world_size)

    def stats(self, job_id):
        c = self.worker.counters
        return RolloutStats(c.generated_tokens_total, c.finished_samples_total, 0.0,
                            c.inflight_samples, c.policy_version, self.worker.state, "",
                            kv_cache_tokens=c.kv_cache_tokens,
                            kv_usage_seconds_total=c.kv_usage_seconds_total,
                            preempted_requests_total=c.preempted_requests_total)


def _spec(**sections):
    base = {"model": {"path": "/m"}, "mode": "reflow", "trainer": {"batch_size": 8},
            "replay": {"max_staleness": 1}}
    base.update(sections)
    return parse_job_spec(base)


def _run(spec, engines, budget, until, timeout_s=30.0):
    clients = {}
    for i, engine in enumerate(engines):
        worker = RolloutWorker("j", spec, lambda e=engine: e, RepeatTask(8, 3, context=TaskContext(seed=i)),
                               budget, encode=lambda text: [1, 2], decode=lambda ids: "a")
        worker.start()
        clients[f"w{i}"] = OneWorker(worker)
    dispatcher = Dispatcher("j", spec, budget, clients, RepeatTask(8, 3, context=TaskContext(seed=1)))
    dispatcher.start()
    try:
        deadline = time.monotonic() + timeout_s
        while not until(dispatcher, clients) and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        dispatcher.stop()
        for client in clients.values():
            client.worker.stop()
    assert not dispatcher.error
    return dispatcher, clients


def test_a_finished_sample_frees_its_slot_before_its_group_ends():
    spec = _spec(rollout={"group_size": 4, "max_inflight_samples": 6},
                 scheduler={"adaptive": False})
    engine, budget = StaggeredEngine(), Budget()
    _run(spec, [engine], budget, lambda d, c: len(budget.groups) >= 2)
    assert len(budget.groups) >= 2
    groups = {}
    for request_id, at in engine.started:
        groups.setdefault(request_id.rsplit("-", 1)[0], []).append((request_id, at))
    first, second = sorted(groups.values(), key=lambda g: min(t for _, t in g))[:2]
    last_of_first = max(engine.ended[r] for r, _ in first)
    # The second group needed 4 free slots of 6: it started once two samples of the
    # first had ended, while the first group's slowest sample was still generating.
    assert min(t for _, t in second) < last_of_first


def test_two_workers_never_get_the_same_prompt_and_share_the_load():
    spec = _spec(rollout={"group_size": 2, "max_inflight_samples": 4})
    engines, budget = [StaggeredEngine(0.01), StaggeredEngine(0.01)], Budget(limit=80)
    dispatcher, clients = _run(spec, engines, budget, lambda d, c: len(budget.groups) >= 40)
    sent = [p for c in clients.values() for p in c.prompts]
    assert len(sent) == 40 and len(set(sent)) == 40  # each prompt dispatched once
    assert set(sent) == {f"p{i}" for i in range(40)}  # the job's one stream, in order
    counts = [len(c.prompts) for c in clients.values()]
    assert min(counts) >= 10, counts  # least-loaded routing used both
    assert dispatcher.dispatched_groups == {"w0": counts[0], "w1": counts[1]}


def test_token_admission_holds_a_small_kv_cache_to_its_budget():
    # Worker w0 has room for ~one group's predicted tokens, w1 for many: with
    # admission on, w0 never holds two groups at once; w1 takes the rest.
    spec = _spec(rollout={"group_size": 2, "max_inflight_samples": 8, "max_tokens": 16},
                 scheduler={"concurrency_control": False, "admission_ratio": 1.0})
    # A group's two samples end 0.1 s apart, so the first one's free slot is seen on
    # its own (the event reader batches events that end close together) while w1's
    # cap cannot take a group and w0 holds one.
    small, large = StaggeredEngine(0.1, 16, 50), StaggeredEngine(0.1, 16, 10_000)
    budget = Budget(limit=40)
    dispatcher, clients = _run(spec, [small, large], budget, lambda d, c: len(budget.groups) >= 20)
    assert len(budget.groups) == 20
    # Started-at times on w0: never more than one group (2 samples) overlapping.
    spans = sorted((t, small.ended[r]) for r, t in small.started)
    overlap = max(sum(1 for s, e in spans if s <= t < e) for t, _ in spans)
    assert overlap <= 2, spans
    assert len(clients["w1"].prompts) > len(clients["w0"].prompts)
    # Groups waited while w1's cap was full and w0 had slots but no KV room.
    assert dispatcher.rejections["tokens"] > 0


def test_without_adaptive_scheduling_the_cap_is_the_spec_s():
    spec = _spec(rollout={"group_size": 2, "max_inflight_samples": 4},
                 scheduler={"adaptive": False, "control_interval_s": 0.1})
    budget = Budget(limit=40)
    dispatcher, _ = _run(spec, [StaggeredEngine(0.01)], budget,
                         lambda d, c: len(budget.groups) >= 20)
    snap = dispatcher.snapshot()
    assert snap["workers"]["w0"]["cap"] == 4 and snap["cap_changes"] == {}
    assert snap["admission_rejections"].get("cap", 0) > 0  # the cap held work back


def test_a_cap_that_holds_back_work_on_an_idle_cache_rises():
    spec = _spec(rollout={"group_size": 2, "max_inflight_samples": 2},
                 scheduler={"control_interval_s": 0.1, "max_concurrency": 8})
    budget = Budget()
    dispatcher, _ = _run(spec, [StaggeredEngine(0.02)], budget,
                         lambda d, c: d.snapshot()["workers"]["w0"]["cap"] == 8)
    snap = dispatcher.snapshot()
    assert snap["workers"]["w0"]["cap"] == 8  # 2 -> 4 -> 6 -> 8, then bounded
    assert snap["cap_changes"]["raise_under_utilised"] == 3


class LengthRecorder(StaggeredEngine):
    """Records each request's length bounds."""

    def __init__(self) -> None:
        super().__init__(0.005)
        self.bounds: list[tuple[int, int]] = []

    async def generate(self, request_id, prompt_ids, sampling):
        self.bounds.append((sampling.min_tokens, sampling.max_tokens))
        async for delta in super().generate(request_id, prompt_ids, sampling):
            yield delta


class VersionedBudget(Budget):
    """A budget whose published version the test moves."""

    version = 0

    def stats(self, job_id):
        return type("Stats", (), {"policy_version": self.version})()


def test_a_length_curriculum_bounds_responses_by_the_published_version():
    spec = _spec(rollout={"group_size": 2, "max_inflight_samples": 4, "max_tokens": 16,
                          "length_schedule": [{"from_version": 2, "max_tokens": 64,
                                               "min_tokens": 48},
                                              {"from_version": 4, "max_tokens": 8}]},
                 scheduler={"adaptive": False})
    assert [spec.rollout.response_bounds(v) for v in (0, 1, 2, 3, 4, 9)] == [
        (0, 16), (0, 16), (48, 64), (48, 64), (0, 8), (0, 8)]
    engine, budget = LengthRecorder(), VersionedBudget(limit=10**9)

    def advance(d, c):
        seen = set(engine.bounds)
        budget.version = {(0, 16): 2, (48, 64): 4}.get(engine.bounds[-1], 4) \
            if engine.bounds else 0
        return {(0, 16), (48, 64), (0, 8)} <= seen

    _run(spec, [engine], budget, advance)
    stages = [b for i, b in enumerate(engine.bounds) if i == 0 or engine.bounds[i - 1] != b]
    assert stages == [(0, 16), (48, 64), (0, 8)]  # in order, never back


def test_a_length_curriculum_is_validated():
    import pytest

    with pytest.raises(ValueError, match="increasing version order"):
        _spec(rollout={"length_schedule": [{"from_version": 3, "max_tokens": 8},
                                           {"from_version": 3, "max_tokens": 9}]})
    with pytest.raises(ValueError, match=r"length_schedule\[0\].min_tokens"):
        _spec(rollout={"length_schedule": [{"from_version": 1, "max_tokens": 8,
                                            "min_tokens": 9}]})
    from reflow.core.limits import OperatorLimits

    with pytest.raises(ValueError, match="rollout.max_tokens"):
        OperatorLimits(max_response_tokens=32).check(
            _spec(rollout={"max_tokens": 16,
                           "length_schedule": [{"from_version": 1, "max_tokens": 64}]}))
