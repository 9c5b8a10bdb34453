"""Replay buffer, rollout worker (real vLLM) and trainer, each a real gRPC
server on loopback, running a short job; Redis is real."""

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


def test_short_job_trains_and_syncs_weights_exactly(redis_server, redis_client, tiny_model, tmp_path):
    spec = parse_job_spec({
        "name": "it", "model": {"path": tiny_model},
        "rollout": {"group_size": 4, "max_tokens": 16, "max_inflight_samples": 16},
        "trainer": {"batch_size": 8, "num_steps": 3, "batch_timeout_s": 120},
        "replay": {"max_staleness": 1},
    })
    replay_server, replay_port = serve_replay(ReplayStore.from_url(redis_server.url), "127.0.0.1:0")
    rollout_service = RolloutService()
    rollout_server, rollout_port = serve_rollout(rollout_service, "127.0.0.1:0")
    trainer_server, trainer_port = serve_trainer(TrainerService(), "127.0.0.1:0")
    replay_addr, rollout_addr = f"127.0.0.1:{replay_port}", f"127.0.0.1:{rollout_port}"
    rollout = GrpcRolloutClient(rollout_addr)
    trainer = GrpcTrainerClient(f"127.0.0.1:{trainer_port}")
    replay = GrpcReplayClient(replay_addr)
    try:
        rollout.start_job("it", spec.model_dump_json(), replay_addr, 1, 2, "127.0.0.1")
        trainer.start_job("it", spec.model_dump_json(), replay_addr, [rollout_addr], str(tmp_path))
        status = _wait(lambda: (s := trainer.status("it")).state in ("succeeded", "failed") and s,
                       300, "the trainer to finish")
        assert status.state == "succeeded", status.error
        assert status.step == 3 and status.policy_version == 3

        records = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == [1, 2, 3]
        for r in records:
            assert r["trained_tokens"] > 0 and 0 <= r["trainer_idle_ratio"] <= 1
            assert r["fresh_samples"] + r["stale_samples"] + r["replay_samples"] == 8
            assert r["max_staleness"] <= spec.replay.max_staleness

        assert _wait(lambda: rollout.stats("it").policy_version == 3, 30, "version 3 on rollout")
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
        rollout_service.shutdown()
        for s in (trainer_server, rollout_server, replay_server):
            s.stop(0)
