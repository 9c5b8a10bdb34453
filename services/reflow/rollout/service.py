"""The rollout service's core: one rollout worker per job on this process.

Builds the job's engine, task, tokenizer and reward pool, and hands weight-sync
and stats requests to the worker. Transport lives in `server.py`.
"""

from __future__ import annotations

import logging
import threading

from reflow.core.config import JobSpec, check_job_id
from reflow.core.errors import FailedPrecondition
from reflow.core.paths import PathRoots
from reflow.replay.client import GrpcReplayClient, ReplayClient
from reflow.rollout.engine import WeightSyncSpec
from reflow.rollout.memory import ModelShape, plan_hybrid_gpu
from reflow.rollout.multiturn import EpisodeRunner
from reflow.rollout.records import RolloutCounters, SampleEvent, WeightUpdate
from reflow.rollout.worker import RolloutWorker
from reflow.tasks import ChatTask, Prompt, build_task, is_multi_turn, task_context
from reflow.tasks.chat import ChatRenderer
from reflow.tasks.rewards import RewardPool

logger = logging.getLogger(__name__)


def worker_seed(spec: JobSpec, weight_sync_rank: int) -> int:
    """The seed of rollout worker `rank` (1, 2, ...): its own prompt stream and
    sampling seed, so two workers never generate the same groups. Worker 1 uses
    the job's seed itself."""
    return (spec.seed + 1_000_003 * (weight_sync_rank - 1)) % (2**31 - 1)


def engine_memory(spec: JobSpec) -> tuple[float | None, bool]:
    """vLLM's share of this GPU and whether the engine sleeps on standby: on an
    elastic pool's worker, sized with its warm trainer half (rollout/memory.py);
    on CPU neither applies (None, False)."""
    import torch

    if not torch.cuda.is_available():
        return None, False
    if spec.cluster.workers is None:
        return spec.rollout.gpu_memory_utilization, False
    plan = plan_hybrid_gpu(torch.cuda.mem_get_info()[1], ModelShape.read(spec.model.path), spec)
    logger.info("GPU memory of this AsyncHybrid worker (GiB): %s", plan.as_record())
    return plan.engine_utilization, plan.sleep_mode


def _vllm_factory(spec: JobSpec, seed: int | None = None):
    def build():
        from reflow.rollout.vllm_engine import VllmEngine

        utilization, sleep_mode = engine_memory(spec)
        return VllmEngine(
            spec.model.path,
            dtype=spec.model.dtype,
            kv_cache_gb=spec.rollout.kv_cache_gb,
            seed=spec.seed if seed is None else seed,
            tensor_parallel_size=spec.rollout.tensor_parallel_size,
            gpu_memory_utilization=utilization,
            sleep_mode=sleep_mode,
            lora=spec.lora,
            max_num_seqs=spec.rollout.max_num_seqs,
        )

    return build


def prompt_encoder(task, tokenizer) -> tuple:
    """(encode, renderer): how a prompt becomes token ids, and the chat renderer
    of a task that talks to an instruct model. A task that gives chat messages,
    and every multi-turn task, goes through the model's chat template (the
    renderer's minimal one where the tokenizer has none); any other task's text
    is encoded as it is."""
    if not (isinstance(task, ChatTask) or is_multi_turn(task)):
        return (lambda prompt: tokenizer.encode(prompt.text, add_special_tokens=False)), None
    renderer = ChatRenderer(tokenizer)
    if isinstance(task, ChatTask):
        return (lambda prompt: renderer.prompt_ids(task.prompt_messages(prompt))), renderer
    return None, renderer


# Largest weight-sync group a job may have (trainer + rollout workers).
MAX_GROUP_SIZE = 4096
# Bounds on what a SubmitGroup may carry, and on a WaitSamples wait.
MAX_PROMPT_CHARS, MAX_ANSWER_CHARS = 1 << 20, 1 << 16
MAX_EVENT_WAIT_S = 30.0
# The longest probe sequence the weight-sync check may send (trainer/sync_check.py).
MAX_PROBE_TOKENS = 4096


class RolloutService:
    def __init__(self, replay_client_factory=GrpcReplayClient, engine_factory=None,
                 roots: PathRoots | None = None) -> None:
        """`engine_factory(spec, seed)` returns a builder of the job's engine (vLLM by
        default); `roots` bound every path a StartJob names (from the environment)."""
        self._replay_client_factory = replay_client_factory
        self._engine_factory = engine_factory or _vllm_factory
        self.roots = roots or PathRoots.from_env()
        self._lock = threading.Lock()
        self.worker: RolloutWorker | None = None
        self._replay: ReplayClient | None = None
        self._rewards: RewardPool | None = None

    def start_job(self, job_id: str, spec: JobSpec, replay_address: str, weight_sync_rank: int,
                  weight_sync_world_size: int, trainer_host: str) -> None:
        """Start generating for a job. The weight-sync place (this worker's rank, the
        group's size, the trainer's host) is fixed here, by the scheduler: weight-sync
        calls that do not match it are refused."""
        from transformers import AutoTokenizer

        from reflow.models.tiny import ensure_model

        check_job_id(job_id)
        if not 1 <= weight_sync_rank < weight_sync_world_size <= MAX_GROUP_SIZE:
            raise ValueError(f"weight_sync_rank/world_size: {weight_sync_rank}/"
                             f"{weight_sync_world_size}; need 1 <= rank < world_size <= "
                             f"{MAX_GROUP_SIZE} (the trainer is rank 0)")
        if not trainer_host or len(trainer_host) > 253:
            raise ValueError("trainer_host: the trainer's host is required")
        model_path = self.roots.model_dir(spec.model.path)
        with self._lock:
            if self.worker is not None and self.worker.state in ("starting", "running"):
                if self.worker.job_id == job_id:
                    return  # a retried start is a no-op
                raise FailedPrecondition(
                    f"this rollout worker already runs job {self.worker.job_id}")
            # A no-op when the scheduler built it already; a worker pod with its own
            # volume builds the preset itself (atomically, so racing pods are safe).
            ensure_model(str(model_path), spec.model.build_if_missing, seed=spec.seed)
            spec = spec.model_copy(update={"model": spec.model.model_copy(
                update={"path": str(model_path)})})
            # model_path is confined under the models root; never reach the Hub.
            tokenizer = AutoTokenizer.from_pretrained(  # nosec B615 # local dir only
                str(model_path), local_files_only=True)
            self._replay = self._replay_client_factory(replay_address)
            seed = worker_seed(spec, weight_sync_rank)
            task = build_task(spec, self.roots.datasets, job_id)
            encode, renderer = prompt_encoder(task, tokenizer)
            self._close_rewards()
            episodes = None
            if is_multi_turn(task):
                # Episodes against the task's environment, rendered with the model's
                # chat template; their rewards come from the environment.
                episodes = EpisodeRunner(task, renderer)
            else:
                # Rewards in processes of their own, off the worker's event loop.
                self._rewards = RewardPool(spec.task.name, spec.task.args,
                                           task_context(spec, self.roots.datasets),
                                           spec.task.reward_workers, spec.task.reward_timeout_s,
                                           limits=spec.task.reward_limits)
            self.worker = RolloutWorker(
                job_id,
                spec,
                self._engine_factory(spec, seed),
                task,
                self._replay,
                encode=encode,
                decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                weight_sync=(weight_sync_rank, weight_sync_world_size, trainer_host),
                score=self._rewards.score if self._rewards is not None else None,
                episodes=episodes,
            )
            self.worker.start()
            logger.info("job %s: rollout starting", job_id)

    def _worker_for(self, job_id: str) -> RolloutWorker:
        if self.worker is None or self.worker.job_id != job_id:
            raise KeyError(f"job {job_id[:80]!r} does not run on this rollout worker")
        return self.worker

    def _running_worker_for(self, job_id: str) -> RolloutWorker:
        """The worker of a job that is running here, for calls that would change it."""
        worker = self.worker
        if worker is None or worker.job_id != job_id or worker.state not in ("starting",
                                                                              "running"):
            raise FailedPrecondition(f"job {job_id[:80]!r} is not running on this rollout worker")
        return worker

    def stop_job(self, job_id: str) -> None:
        worker = self._worker_for(job_id)
        worker.stop()
        if self._replay is not None:
            self._replay.close()
        self._close_rewards()

    def _close_rewards(self) -> None:
        if self._rewards is not None:
            self._rewards.close()
            self._rewards = None

    def init_weight_sync(self, job_id: str, spec: WeightSyncSpec, timeout_s: float) -> None:
        self._running_worker_for(job_id).init_weight_sync(spec, timeout_s)

    def set_sync_place(self, job_id: str, rank: int, world_size: int,
                       trainer_host: str = "") -> None:
        self._running_worker_for(job_id).set_sync_place(rank, world_size, trainer_host)

    def update_weights(self, job_id: str, policy_version: int,
                       timeout_s: float, resync: bool = False) -> WeightUpdate:
        return self._running_worker_for(job_id).update_weights(policy_version, timeout_s,
                                                                resync)

    def submit_group(self, job_id: str, group_id: str, prompt: Prompt,
                     concurrency_cap: int = 0, bounds: tuple[int, int] | None = None) -> bool:
        """Generate one group for the job's dispatcher; False if `group_id` was
        submitted before (a retry). The prompt is data: it is tokenised, never run."""
        if not prompt.text or len(prompt.text) > MAX_PROMPT_CHARS:
            raise ValueError(f"prompt_text: 1-{MAX_PROMPT_CHARS} characters required")
        if len(prompt.answer) > MAX_ANSWER_CHARS or len(prompt.prompt_id) > 256:
            raise ValueError(f"prompt_answer/prompt_id: at most {MAX_ANSWER_CHARS}/256 "
                             "characters")
        if not 0 <= concurrency_cap <= 1_048_576:
            raise ValueError("concurrency_cap: 0 (unchanged) to 1048576")
        return self._running_worker_for(job_id).submit_group(group_id, prompt, concurrency_cap,
                                                              bounds)

    def evaluate(self, job_id: str, plan, timeout_s: float):
        """Periodic evaluation of the job on this worker as `plan` (an EvalPlan)
        says (rollout/evaluation.py)."""
        worker = self._running_worker_for(job_id)
        if worker.standby:
            raise FailedPrecondition("rollout worker stands by: its worker has the trainer role")
        return worker.evaluate(plan, timeout_s)

    def score_tokens(self, job_id: str, token_ids: list[int], timeout_s: float
                     ) -> tuple[int, list[float]]:
        """The weight-sync check's probe on this worker's engine (RolloutWorker.
        score_tokens). `token_ids`: 2 to MAX_PROBE_TOKENS ids, each >= 0."""
        if not 2 <= len(token_ids) <= MAX_PROBE_TOKENS:
            raise ValueError(f"token_ids: {len(token_ids)} tokens; a probe has 2 to "
                             f"{MAX_PROBE_TOKENS}")
        if min(token_ids) < 0:
            raise ValueError("token_ids: token ids are >= 0")
        return self._running_worker_for(job_id).score_tokens(token_ids, timeout_s)

    def wait_events(self, job_id: str, since_seq: int, wait_s: float) -> list[SampleEvent]:
        if not 0 <= wait_s <= MAX_EVENT_WAIT_S or since_seq < 0:
            raise ValueError(f"wait_s: 0-{MAX_EVENT_WAIT_S:.0f} seconds and since_seq >= 0 "
                             "required")
        return self._worker_for(job_id).wait_events(since_seq, wait_s)

    def stats(self, job_id: str) -> tuple[RolloutCounters, float, str, str]:
        """A job's stats; with an empty job_id, this worker's latest job, or `idle`
        (what the scheduler checks before offering the worker to a job)."""
        if not job_id and self.worker is None:
            return RolloutCounters(), 0.0, "idle", ""
        worker = self.worker if not job_id else self._worker_for(job_id)
        state = "standby" if worker.state == "running" and worker.standby else worker.state
        return worker.counters, worker.idle_seconds(), state, worker.error

    def set_standby(self, job_id: str, standby: bool, drain_timeout_s: float = 0.0,
                    hand_back: bool = False) -> int:
        """The engine of a worker moving to the trainer role admits nothing; its
        groups in flight are handed back to the dispatcher (`hand_back`) or finish
        first (up to `drain_timeout_s`). Back in the rollout role it admits again.
        Returns samples still generating."""
        return self._running_worker_for(job_id).set_standby(standby, drain_timeout_s,
                                                            hand_back)

    def shutdown(self) -> None:
        """The process is going away: its replay client first, so a Put retrying
        against a buffer that is gone too (the whole job is being taken down) ends
        now instead of holding the exit for its retry bound."""
        if self._replay is not None:
            self._replay.close()
        if self.worker is not None:
            self.worker.stop()
        self._close_rewards()
