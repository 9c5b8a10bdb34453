"""Periodic evaluation on a rollout worker: the held-out prompts, k samples
each, scored like training samples and counted per prompt (correct, voted),
nothing put to the buffer; and the counts' way over gRPC."""

import asyncio

from reflow.core.config import parse_job_spec
from reflow.rollout.engine import TokenDelta
from reflow.rollout.client import GrpcRolloutClient
from reflow.rollout.eval_metrics import PromptOutcome, summarize
from reflow.rollout.evaluation import EvalPlan, EvalResult
from reflow.rollout.multiturn import EpisodeRunner
from reflow.rollout.server import RolloutServicer
from reflow.rollout.worker import RolloutWorker
from reflow.tasks import TaskContext, build_task
from reflow.tasks.chat import ChatRenderer
from reflow.tasks.repeat import RepeatTask
from tests.unit.fake_engines import PausableEngine
from tests.unit.test_worker_multiturn import TOKENIZER, BadGuesser


class ThreeWords(PausableEngine):
    def __init__(self):
        super().__init__()
        self.temperatures = []

    async def generate(self, request_id, prompt_ids, sampling):
        self.temperatures.append(sampling.temperature)
        await asyncio.sleep(0)
        yield TokenDelta([7, 7, 7], [-0.1] * 3, finished=True, finish_reason="stop")


class NoPuts:
    def put(self, job_id, trajectories):
        raise AssertionError("an evaluation put samples to the buffer")


def _worker(spec, engine, task, **kwargs):
    worker = RolloutWorker("j", spec, lambda: engine, task, NoPuts(), **kwargs)
    worker.start()
    worker.wait_ready(10)
    return worker


def test_an_evaluation_scores_the_held_out_prompts_greedily():
    spec = parse_job_spec({"model": {"path": "/m"}, "rollout": {"temperature": 0.7}})
    task = RepeatTask(8, 3, context=TaskContext(seed=3))
    engine = ThreeWords()
    worker = _worker(spec, engine, task, encode=lambda p: [1, 2], decode=lambda ids: "a a a")
    try:
        result = worker.evaluate(EvalPlan(16, greedy=True))
        sampled = worker.evaluate(EvalPlan(4, greedy=False))
    finally:
        worker.stop()
    expected = [task.reward(p, "a a a") for p in task.eval_prompts(16)]
    assert result.num_samples == 16 and result.num_errors == 0
    assert abs(result.reward_mean - sum(expected) / 16) < 1e-9
    assert 0 < result.reward_mean < 1  # the split mixes prompts for "a" and others
    assert engine.temperatures == [0.0] * 16 + [0.7] * 4
    assert sampled.num_samples == 4 and result.policy_version == 0
    assert worker.counters.finished_samples_total == 0  # not training samples


def _guess_number_worker():
    """A worker playing guess_number episodes (3 turns) against a guesser that never
    wins, and its episode runner."""
    spec = parse_job_spec({"model": {"path": "/m"},
                           "task": {"name": "guess_number", "args": {"max_turns": 3}},
                           "rollout": {"group_size": 2}, "trainer": {"batch_size": 4}})
    task = build_task(spec)
    runner = EpisodeRunner(task, ChatRenderer(TOKENIZER))
    return _worker(spec, BadGuesser(), task, encode=None, decode=TOKENIZER.decode,
                   episodes=runner), runner


def test_a_multi_turn_task_is_evaluated_one_episode_per_prompt():
    worker, runner = _guess_number_worker()
    try:
        result = worker.evaluate(EvalPlan(5, greedy=True))
    finally:
        worker.stop()
    assert result.num_samples == 5 and runner.counters.episodes_total == 5
    assert runner.counters.turns_total == 15


K = 4


class SeededEngine(PausableEngine):
    """Answers with the prompt's index and the sample's seed, for `_decode` to read."""

    def __init__(self):
        super().__init__()
        self.seeds, self.temperatures = [], []

    async def generate(self, request_id, prompt_ids, sampling):
        self.seeds.append(sampling.seed)
        self.temperatures.append(sampling.temperature)
        await asyncio.sleep(0)
        yield TokenDelta([prompt_ids[0], sampling.seed], [-0.1] * 2, finished=True,
                         finish_reason="stop")


# Each prompt's K answers by its index mod 3: C the correct response, q and r wrong.
ANSWERS = [["q", "C", "C", "r"],   # C wins the vote 2 to 1
           ["q", "C", "q", "C"],   # a tie: q, given first, wins
           ["q", "r", "q", "r"]]   # nothing correct


def test_k_samples_per_prompt_are_counted_and_voted_on():
    spec = parse_job_spec({"model": {"path": "/m"}, "rollout": {"temperature": 0.7}})
    task = RepeatTask(8, 3, context=TaskContext(seed=3))
    prompts = task.eval_prompts(6)

    def decode(ids):
        index, seed = ids
        answer = ANSWERS[index % 3][seed - index * K]
        symbol, count = prompts[index].answer.split(":")
        return " ".join([symbol] * int(count)) if answer == "C" else answer

    engine = SeededEngine()
    worker = _worker(spec, engine, task, encode=lambda p: [int(p.prompt_id[1:])], decode=decode)
    try:
        result = worker.evaluate(EvalPlan(6, greedy=False, k=K, temperature=0.5))
    finally:
        worker.stop()
    assert sorted(engine.seeds) == list(range(6 * K))  # a distinct seed per sample
    assert engine.temperatures == [0.5] * 6 * K
    assert result.k == K and result.voted and result.num_samples == 6 * K
    assert [o.num_correct for o in result.prompts] == [2, 2, 0] * 2
    assert [o.majority_correct for o in result.prompts] == [True, False, False] * 2
    assert all(o.num_scored == K and o.num_errors == 0 for o in result.prompts)
    assert abs(result.reward_mean - 8 / 24) < 1e-9  # C scores 1, q and r 0
    metrics = summarize(result.prompts, [1, 2, K], result.voted)
    assert abs(metrics["pass_at_1"] - 1 / 3) < 1e-9 and abs(metrics["pass_at_4"] - 4 / 6) < 1e-9
    assert abs(metrics["pass_at_2"] - 5 / 9) < 1e-9  # 1 - C(2,2)/C(4,2) on 4 of 6 prompts
    assert abs(metrics["maj"] - 2 / 6) < 1e-9 and abs(metrics["avg"] - 1 / 3) < 1e-9


def test_a_multi_turn_task_plays_k_episodes_per_prompt_and_casts_no_vote():
    worker, runner = _guess_number_worker()
    try:
        result = worker.evaluate(EvalPlan(3, greedy=False, k=2))
    finally:
        worker.stop()
    assert runner.counters.episodes_total == 6 and len(result.prompts) == 3
    assert all(o.num_samples == 2 for o in result.prompts) and not result.voted


class LoopbackStub:
    """The rollout stub, its messages through their wire form, on a servicer in this process."""

    def __init__(self, servicer):
        self.servicer = servicer

    def Evaluate(self, request, timeout):
        class Context:
            def time_remaining(self):
                return timeout

        request = type(request).FromString(request.SerializeToString())
        reply = self.servicer.Evaluate(request, Context())
        return type(reply).FromString(reply.SerializeToString())


def test_an_evaluation_crosses_grpc_whole():
    sent = EvalResult(0.5, 7, 1, 3, 1.5, k=2, voted=True, prompts=(
        PromptOutcome(2, 1, 1.0, 0, True), PromptOutcome(1, 0, 0.25, 1, False)))

    class Service:
        def evaluate(self, job_id, plan, timeout_s):
            self.plan = plan
            return sent

    service = Service()
    client = GrpcRolloutClient.__new__(GrpcRolloutClient)
    client._stub = LoopbackStub(RolloutServicer(service))
    plan = EvalPlan(4, greedy=False, k=2, temperature=0.3, correct_threshold=0.75)
    assert client.evaluate("j", plan, deadline_s=60) == sent
    assert service.plan == plan
