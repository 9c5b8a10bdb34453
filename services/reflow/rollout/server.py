"""gRPC transport for the rollout service.
Errors are raised; `rpc.ErrorStatus` maps them to status codes."""

from __future__ import annotations

import grpc

from reflow import rpc
from reflow.core.config import JobSpec
from reflow.rollout.engine import WeightSyncSpec
from reflow.rollout.evaluation import EvalPlan
from reflow.rollout.service import RolloutService
from reflow.tasks import Prompt
from reflow.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc


class RolloutServicer(rollout_pb2_grpc.RolloutServicer):
    def __init__(self, service: RolloutService) -> None:
        self.service = service

    def StartJob(self, request, context):
        spec = JobSpec.model_validate_json(request.spec_json)
        self.service.start_job(request.job_id, spec, request.replay_address,
                               request.weight_sync_rank, request.weight_sync_world_size,
                               request.trainer_host)
        return common_pb2.Ack(ok=True)

    def StopJob(self, request, context):
        self.service.stop_job(request.job_id)
        return common_pb2.Ack(ok=True)

    def InitWeightSync(self, request, context):
        spec = WeightSyncSpec(
            master_address=request.master_address,
            master_port=request.master_port,
            rank=request.rank,
            world_size=request.world_size,
            backend=request.backend,
            tensors=[(t.name, list(t.shape), t.dtype) for t in request.tensors],
            bucket_bytes=request.bucket_bytes,
            tensor_parallel_size=request.tensor_parallel_size or 1,
            trainer_device_uuid=request.trainer_device_uuid,
            rendezvous_key=request.rendezvous_key,
        )
        self.service.init_weight_sync(request.job_id, spec, rpc.wait_budget_s(context))
        return common_pb2.Ack(ok=True)

    def SetSyncPlace(self, request, context):
        self.service.set_sync_place(request.job_id, request.rank, request.world_size,
                                    request.trainer_host)
        return common_pb2.Ack(ok=True)

    def UpdateWeights(self, request, context):
        update = self.service.update_weights(
            request.job_id, request.policy_version, rpc.wait_budget_s(context),
            request.resync)
        return rollout_pb2.UpdateWeightsReply(
            policy_version=request.policy_version, pause_s=update.pause_s,
            receive_s=update.receive_s
        )

    def GetStats(self, request, context):
        counters, idle_s, state, error = self.service.stats(request.job_id)
        return rollout_pb2.RolloutStats(
            generated_tokens_total=counters.generated_tokens_total,
            finished_samples_total=counters.finished_samples_total,
            idle_seconds_total=idle_s,
            inflight_samples=counters.inflight_samples,
            policy_version=counters.policy_version,
            state=state,
            error=error,
            occupancy_seconds_total=counters.occupancy_seconds_total,
            engine_startup_s=counters.engine_startup_s,
            kv_usage_seconds_total=counters.kv_usage_seconds_total,
            preempted_requests_total=counters.preempted_requests_total,
            kv_cache_tokens=counters.kv_cache_tokens,
            concurrency_cap=counters.concurrency_cap,
            engine_busy_seconds_total=counters.engine_busy_seconds_total,
            engine_decode_steps_total=counters.engine_decode_steps_total,
            filtered_groups_total=counters.filtered_groups_total,
        )

    def SubmitGroup(self, request, context):
        accepted = self.service.submit_group(
            request.job_id, request.group_id,
            Prompt(request.prompt_id, request.prompt_text, request.prompt_answer),
            request.concurrency_cap,
            (request.min_tokens, request.max_tokens) if request.max_tokens else None)
        return rollout_pb2.SubmitGroupReply(accepted=accepted)

    def WaitSamples(self, request, context):
        events = self.service.wait_events(
            request.job_id, request.since_seq,
            min(request.wait_s, rpc.wait_budget_s(context)))
        return rollout_pb2.SampleEvents(events=[
            rollout_pb2.SampleEvent(
                seq=e.seq, group_id=e.group_id, sample_index=e.sample_index,
                response_tokens=e.response_tokens, prompt_tokens=e.prompt_tokens,
                policy_version=e.policy_version, error=e.error)
            for e in events])

    def Evaluate(self, request, context):
        plan = EvalPlan(num_prompts=request.num_prompts, greedy=request.greedy,
                        k=request.k or 1, temperature=request.temperature,
                        correct_threshold=request.correct_threshold)
        result = self.service.evaluate(request.job_id, plan, rpc.wait_budget_s(context))
        return rollout_pb2.EvaluateReply(
            reward_mean=result.reward_mean, num_samples=result.num_samples,
            num_errors=result.num_errors, policy_version=result.policy_version,
            seconds=result.seconds, k=result.k, voted=result.voted,
            prompts=[rollout_pb2.EvalPromptOutcome(
                num_scored=o.num_scored, num_correct=o.num_correct, reward_sum=o.reward_sum,
                num_errors=o.num_errors, majority_correct=o.majority_correct)
                for o in result.prompts])


    def ScoreTokens(self, request, context):
        version, logprobs = self.service.score_tokens(
            request.job_id, list(request.token_ids), rpc.wait_budget_s(context))
        return rollout_pb2.ScoreTokensReply(policy_version=version, logprobs=logprobs)


SERVICE_NAME = "reflow.v1.Rollout"
# Calls that wait (on the engine, or for events): bounded by rpc.LongCallGuard.
LONG_METHODS = tuple(f"/{SERVICE_NAME}/{m}" for m in
                     ("StartJob", "StopJob", "InitWeightSync", "UpdateWeights", "WaitSamples",
                      "Evaluate", "ScoreTokens"))


def register(service: RolloutService):
    """Adds the rollout servicer to a server (alone, or beside the trainer in a worker)."""
    servicer = RolloutServicer(service)
    return lambda server: rollout_pb2_grpc.add_RolloutServicer_to_server(servicer, server)


def serve(service: RolloutService, address: str) -> tuple[grpc.Server, int]:
    return rpc.make_server(SERVICE_NAME, register(service), address, long_methods=LONG_METHODS)
