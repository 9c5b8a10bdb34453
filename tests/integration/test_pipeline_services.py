"""Replay buffer, two rollout workers (real vLLM), the job's dispatcher and the
trainer, each service a real gRPC server on loopback, running a short job;
Redis is real."""

import json
import time

import pytest
import torch

from reflow.core.config import parse_job_spec
from reflow.replay.client import GrpcReplayClient
from reflow.replay.server import serve as serve_replay
from reflow.replay.store import ReplayStore
from reflow.rollout.client import GrpcRolloutClient
from reflow.rollout.server import serve as serve_rollout
from reflow.rollout.service import RolloutService
from reflow.tasks import TaskContext
from reflow.tasks.repeat import RepeatTask
from reflow.scheduler.generation.dispatch import Dispatcher
from reflow.trainer.client import GrpcTrainerClient
from reflow.trainer.server import serve as serve_trainer
from reflow.trainer.service import TrainerService

pytestmark = pytest.mark.slow


def _wait(predicate, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


class RecordingRolloutService(RolloutService):
    """A real rollout service that remembers which prompts it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.prompt_ids: list[str] = []

    def submit_group(self, job_id, group_id, prompt, concurrency_cap=0, bounds=None):
        accepted = super().submit_group(job_id, group_id, prompt, concurrency_cap, bounds)
        if accepted:
            self.prompt_ids.append(prompt.prompt_id)
        return accepted


def test_short_job_trains_and_syncs_weights_exactly(redis_server, redis_client, tiny_model, tmp_path):
    spec = parse_job_spec({
        "name": "it", "model": {"path": tiny_model},
        "rollout": {"group_size": 4, "max_tokens": 16, "max_inflight_samples": 8},
        "trainer": {"batch_size": 8, "num_steps": 3, "batch_timeout_s": 120},
        # Versions by oldest segment: every trained sample's true lag stays within δ.
        "replay": {"max_staleness": 1, "staleness_version": "oldest"},
    })
    replay_server, replay_port = serve_replay(ReplayStore.from_url(redis_server.url), "127.0.0.1:0")
    services = [RecordingRolloutService(), RecordingRolloutService()]
    rollout_servers = [serve_rollout(service, "127.0.0.1:0") for service in services]
    trainer_server, trainer_port = serve_trainer(TrainerService(), "127.0.0.1:0")
    replay_addr = f"127.0.0.1:{replay_port}"
    rollout_addrs = [f"127.0.0.1:{port}" for _, port in rollout_servers]
    rollouts = [GrpcRolloutClient(addr) for addr in rollout_addrs]

    trainer = GrpcTrainerClient(f"127.0.0.1:{trainer_port}")
    replay = GrpcReplayClient(replay_addr)
    dispatcher = Dispatcher("it", spec, GrpcReplayClient(replay_addr),
                            dict(zip(rollout_addrs, rollouts)),
                            RepeatTask(**spec.task.args, context=TaskContext(seed=1)))
    try:
        for rank, client in enumerate(rollouts, start=1):
            client.start_job("it", spec.model_dump_json(), replay_addr, rank, 3, "127.0.0.1")
        trainer.start_job("it", spec.model_dump_json(), replay_addr, rollout_addrs, str(tmp_path))
        dispatcher.start()
        status = _wait(lambda: (s := trainer.status("it")).state in ("succeeded", "failed") and s,
                       300, "the trainer to finish")
        assert status.state == "succeeded", status.error
        assert status.step == 3 and status.policy_version == 3
        assert not dispatcher.error
        # One dispatcher for the job: both workers generated, never the same prompt.
        given = [s.prompt_ids for s in services]
        assert given[0] and given[1], given
        assert len(set(given[0] + given[1])) == len(given[0]) + len(given[1])

        records = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == [1, 2, 3]
        for r in records:
            assert r["trained_tokens"] > 0 and 0 <= r["trainer_idle_ratio"] <= 1
            assert r["fresh_samples"] + r["stale_samples"] + r["replay_samples"] == 8
            assert r["max_staleness"] <= spec.replay.max_staleness

        for client in rollouts:
            assert _wait(lambda c=client: c.stats("it").policy_version == 3, 30,
                         "version 3 on every rollout worker")
        # Samples generated entirely under version 3 must carry the logprobs of the
        # trainer's final weights: the broadcast reached vLLM intact.
        # The buffer serves oldest first; drain until a group from version 3 comes up.
        fresh = []
        deadline = time.monotonic() + 120
        while not fresh and time.monotonic() < deadline:
            batch = replay.sample("it", 4, 30, timeout_s=5)
            if batch is not None:
                fresh = [t for t in batch.trajectories if t.oldest_version == 3]
                replay.release("it", batch.lease_id)
        assert fresh, "no sample generated under the final policy"
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint")
        for t in fresh:
            ids = torch.tensor([t.prompt_ids + t.response_ids])
            with torch.no_grad():
                logp = torch.log_softmax(model(ids).logits[0].float(), -1)
            p = len(t.prompt_ids)
            expected = [logp[p - 1 + k, tok].item() for k, tok in enumerate(t.response_ids)]
            assert max(abs(a - b) for a, b in zip(expected, t.logprobs)) < 1e-3
    finally:
        dispatcher.stop()
        for service in services:
            service.shutdown()
        for s in (trainer_server, *(srv for srv, _ in rollout_servers), replay_server):
            s.stop(0)
