"""How the trainer and scheduler reach a rollout worker (gRPC)."""

from __future__ import annotations

from dataclasses import dataclass

from reflow.rollout.engine import WeightSyncSpec
from reflow.tasks import Prompt
from reflow.rollout.records import SampleEvent, WeightUpdate


@dataclass
class RolloutStats:
    generated_tokens_total: int
    finished_samples_total: int
    idle_seconds_total: float
    inflight_samples: int
    policy_version: int
    state: str
    error: str
    occupancy_seconds_total: float = 0.0
    engine_startup_s: float = 0.0
    kv_usage_seconds_total: float = 0.0
    preempted_requests_total: int = 0
    kv_cache_tokens: int = 0
    concurrency_cap: int = 0
    engine_busy_seconds_total: float = 0.0
    engine_decode_steps_total: int = 0
    # Groups dynamic sampling dropped (algorithm.dynamic_sampling).
    filtered_groups_total: int = 0


class GrpcRolloutClient:
    def __init__(self, address: str, deadline_s: float = 30.0) -> None:
        from reflow import rpc
        from reflow.v1 import rollout_pb2_grpc

        self.address = address
        self.deadline_s = deadline_s
        self._channel = rpc.channel(address, "rollout")
        self._stub = rollout_pb2_grpc.RolloutStub(self._channel)

    def start_job(self, job_id: str, spec_json: str, replay_address: str, weight_sync_rank: int,
                  weight_sync_world_size: int, trainer_host: str) -> None:
        """`weight_sync_rank` is this worker's rank in the job's weight-sync group
        (the trainer is 0), of `weight_sync_world_size`; `trainer_host` the only
        master address the worker will accept."""
        from reflow.v1 import common_pb2

        req = common_pb2.StartJobRequest(
            job_id=job_id, spec_json=spec_json, replay_address=replay_address,
            weight_sync_rank=weight_sync_rank, weight_sync_world_size=weight_sync_world_size,
            trainer_host=trainer_host,
        )
        self._stub.StartJob(req, timeout=self.deadline_s)

    def stop_job(self, job_id: str, deadline_s: float = 60.0) -> None:
        from reflow.v1 import common_pb2

        self._stub.StopJob(common_pb2.JobRef(job_id=job_id), timeout=deadline_s)

    def init_weight_sync(self, job_id: str, spec: WeightSyncSpec, deadline_s: float = 600.0) -> None:
        from reflow.v1 import rollout_pb2

        req = rollout_pb2.InitWeightSyncRequest(
            job_id=job_id,
            master_address=spec.master_address,
            master_port=spec.master_port,
            rank=spec.rank,
            world_size=spec.world_size,
            backend=spec.backend,
            tensors=[rollout_pb2.TensorMeta(name=n, shape=s, dtype=d) for n, s, d in spec.tensors],
            bucket_bytes=spec.bucket_bytes,
            tensor_parallel_size=spec.tensor_parallel_size,
            trainer_device_uuid=spec.trainer_device_uuid,
            rendezvous_key=spec.rendezvous_key,
        )
        # Covers the engine start (tens of seconds) that the call waits for.
        self._stub.InitWeightSync(req, timeout=deadline_s)

    def set_sync_place(self, job_id: str, rank: int, world_size: int,
                       trainer_host: str = "") -> None:
        """Scheduler: this worker's place in a weight-sync group that lost an engine,
        and (`trainer_host`) the trainer's new host once it came back elsewhere."""
        from reflow.v1 import rollout_pb2

        self._stub.SetSyncPlace(rollout_pb2.SetSyncPlaceRequest(
            job_id=job_id, rank=rank, world_size=world_size, trainer_host=trainer_host),
            timeout=self.deadline_s)

    def update_weights(self, job_id: str, policy_version: int,
                       deadline_s: float = 300.0, resync: bool = False) -> WeightUpdate:
        from reflow.v1 import rollout_pb2

        req = rollout_pb2.UpdateWeightsRequest(job_id=job_id, policy_version=policy_version,
                                               resync=resync)
        reply = self._stub.UpdateWeights(req, timeout=deadline_s)
        return WeightUpdate(reply.pause_s, reply.receive_s)

    def stats(self, job_id: str) -> RolloutStats:
        """Polled every step and every second: a transient failure (after the
        channel's retries) raises `core.errors.Unavailable`, which pollers tolerate."""
        from reflow import rpc
        from reflow.v1 import common_pb2

        import grpc

        # NOT_FOUND too: a worker process that was just replaced does not run the
        # job until the scheduler starts it there again (seconds).
        with rpc.transient_as_unavailable(f"rollout worker {self.address}: GetStats",
                                          also=(grpc.StatusCode.NOT_FOUND,)):
            m = self._stub.GetStats(common_pb2.JobRef(job_id=job_id), timeout=self.deadline_s)
        return RolloutStats(
            m.generated_tokens_total, m.finished_samples_total, m.idle_seconds_total,
            m.inflight_samples, m.policy_version, m.state, m.error, m.occupancy_seconds_total,
            m.engine_startup_s, m.kv_usage_seconds_total, m.preempted_requests_total,
            m.kv_cache_tokens, m.concurrency_cap, m.engine_busy_seconds_total,
            m.engine_decode_steps_total, m.filtered_groups_total,
        )

    def submit_group(self, job_id: str, group_id: str, prompt: Prompt,
                     concurrency_cap: int = 0, bounds: tuple[int, int] | None = None) -> bool:
        """Have the worker generate one group; False if it had this group_id already.
        `bounds`: (min_tokens, max_tokens) of its responses (None: the spec's)."""
        from reflow.v1 import rollout_pb2

        min_tokens, max_tokens = bounds or (0, 0)
        req = rollout_pb2.SubmitGroupRequest(
            job_id=job_id, group_id=group_id, prompt_id=prompt.prompt_id,
            prompt_text=prompt.text, prompt_answer=prompt.answer,
            concurrency_cap=concurrency_cap, max_tokens=max_tokens, min_tokens=min_tokens)
        return self._stub.SubmitGroup(req, timeout=self.deadline_s).accepted

    def wait_events(self, job_id: str, since_seq: int, wait_s: float) -> list[SampleEvent]:
        """Sample and group events after `since_seq`, waiting up to `wait_s`."""
        from reflow.v1 import rollout_pb2

        req = rollout_pb2.WaitSamplesRequest(job_id=job_id, since_seq=since_seq, wait_s=wait_s)
        reply = self._stub.WaitSamples(req, timeout=wait_s + self.deadline_s)
        return [SampleEvent(e.seq, e.group_id, e.sample_index, e.response_tokens,
                            e.prompt_tokens, e.policy_version, e.error) for e in reply.events]

    def evaluate(self, job_id: str, plan, deadline_s: float = 600.0):
        """Score the task's held-out split on this worker as `plan` (an EvalPlan)
        says (periodic evaluation)."""
        from reflow.rollout.eval_metrics import PromptOutcome
        from reflow.rollout.evaluation import EvalResult
        from reflow.v1 import rollout_pb2

        req = rollout_pb2.EvaluateRequest(
            job_id=job_id, num_prompts=plan.num_prompts, greedy=plan.greedy, k=plan.k,
            temperature=plan.temperature, correct_threshold=plan.correct_threshold)
        m = self._stub.Evaluate(req, timeout=deadline_s)
        return EvalResult(
            m.reward_mean, m.num_samples, m.num_errors, m.policy_version, m.seconds,
            k=m.k or 1, voted=m.voted,
            prompts=tuple(PromptOutcome(o.num_scored, o.num_correct, o.reward_sum,
                                        o.num_errors, o.majority_correct)
                          for o in m.prompts))

    def score_tokens(self, job_id: str, token_ids: list[int], deadline_s: float = 60.0
                     ) -> tuple[int, list[float]]:
        """(loaded policy version, log-probabilities of the probe's tokens after
        the first) on this worker's engine (trainer/sync_check.py)."""
        from reflow.v1 import rollout_pb2

        m = self._stub.ScoreTokens(rollout_pb2.ScoreTokensRequest(
            job_id=job_id, token_ids=token_ids), timeout=deadline_s)
        return int(m.policy_version), list(m.logprobs)

    def close(self) -> None:
        self._channel.close()


class InprocRolloutClient:
    """The same calls on a RolloutService in this process (tests, single-process runs)."""

    def __init__(self, service) -> None:
        self.service = service
        self.address = f"inproc-{id(service):x}"

    def submit_group(self, job_id: str, group_id: str, prompt: Prompt,
                     concurrency_cap: int = 0, bounds: tuple[int, int] | None = None) -> bool:
        return self.service.submit_group(job_id, group_id, prompt, concurrency_cap, bounds)

    def wait_events(self, job_id: str, since_seq: int, wait_s: float) -> list[SampleEvent]:
        return self.service.wait_events(job_id, since_seq, wait_s)

    def stats(self, job_id: str) -> RolloutStats:
        c, idle_s, state, error = self.service.stats(job_id)
        return RolloutStats(c.generated_tokens_total, c.finished_samples_total, idle_s,
                            c.inflight_samples, c.policy_version, state, error,
                            c.occupancy_seconds_total, c.engine_startup_s,
                            c.kv_usage_seconds_total, c.preempted_requests_total,
                            c.kv_cache_tokens, c.concurrency_cap,
                            c.engine_busy_seconds_total, c.engine_decode_steps_total,
                            c.filtered_groups_total)

    def evaluate(self, job_id: str, plan, deadline_s: float = 600.0):
        return self.service.evaluate(job_id, plan, deadline_s)

    def score_tokens(self, job_id: str, token_ids: list[int], deadline_s: float = 60.0
                     ) -> tuple[int, list[float]]:
        return self.service.score_tokens(job_id, list(token_ids), deadline_s)

    def close(self) -> None:
        pass
