"""The rollout section of the job spec (paper §4.1 step 2): how samples are
generated, and the response-length curriculum."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from reflow.core.sections import _Section


class LengthStage(_Section):
    """One stage of a response-length curriculum (as DeepScaleR grows its context
    8k -> 16k -> 24k): from a policy version on, responses are generated with
    these bounds."""

    from_version: int = Field(ge=1, le=100_000_000,
                              description="First policy version the bounds apply to.")
    max_tokens: int = Field(ge=1, le=131072, description="Response length limit.")
    min_tokens: int = Field(default=0, ge=0, le=131072,
                            description="Responses are at least this long (end-of-sequence "
                            "suppressed before).")


class RolloutConfig(_Section):
    """Generation settings (paper §4.1 step 2)."""

    group_size: int = Field(
        default=8, ge=1, le=256,
        description="Samples per prompt (a GRPO group, n). At least 2: the advantage is a "
        "reward minus its group's mean, so a group of one always has advantage 0 and trains "
        "nothing."
    )
    # The ceilings of this and the fields below are the operator's (core/limits.py),
    # checked where a job is submitted, so that a refusal names the one that applies.
    max_tokens: int = Field(default=64, ge=1, description="Response length limit.")
    temperature: float = Field(default=1.0, gt=0.0, le=4.0, description="Sampling temperature.")
    top_p: float = Field(
        default=1.0, gt=0.0, le=1.0,
        description="Nucleus sampling: sample from the smallest set of tokens whose "
        "probabilities reach top_p. 1: off, the only value training accepts for now (see "
        "the refusal's message).")
    top_k: int = Field(
        default=0, ge=0, le=1_000_000,
        description="Sample from the k most probable tokens only. 0: off, the only value "
        "training accepts for now (see the refusal's message).")
    max_inflight_samples: int | None = Field(
        default=64,
        ge=1,
        description="Concurrency cap: most samples generating at once on a rollout worker; "
        "with scheduler.concurrency_control, where the adaptive cap starts. None: as many as "
        "the dispatch budget lets out (B_max x (1 + look-ahead) x sync_interval), as verl's "
        "fully_async rollouter sets `max_concurrent_samples` and its synchronous and "
        "one-step-off trainers hand vLLM the whole batch.",
    )
    max_samples_per_step: int | None = Field(
        default=None,
        ge=1,
        description="B_max: most samples dispatched to rollout per training step (paper §4.1 "
        "step 1). None: trainer.batch_size.",
    )
    kv_cache_gb: float = Field(
        default=1.0, gt=0.0, description="KV cache size for the vLLM engine (CPU)."
    )
    max_num_seqs: int | None = Field(
        default=None, ge=1, le=4096,
        description="The most sequences the engine runs in one batch (vLLM's `max_num_seqs`): "
        "the engine's own capacity, below any concurrency cap, the same in every mode; "
        "requests beyond it wait in the engine's queue. None: vLLM's default.")
    gpu_memory_utilization: float | None = Field(
        default=None, gt=0.0, le=0.98,
        description="vLLM's share of each GPU (its weights and KV cache). None: vLLM's "
        "default (0.9) where the engine has its GPU alone; on an elastic pool's worker, all "
        "that the warm trainer half (weights, gradients, AdamW) and 5 % headroom leave "
        "(rollout/memory.py). Set, it is checked against the trainer half at start.")
    sleep_mode: Literal["auto", "off"] = Field(
        default="auto",
        description="`auto`: an elastic pool's GPU engine sleeps while its worker holds the "
        "trainer role (vLLM sleep level 1: KV cache dropped, weights to host memory, woken "
        "for each weight update), so the trainer's activations get the KV cache's memory. "
        "On CPU the standby engine drops its KV cache's pages instead. `off`: it keeps its "
        "memory.")
    engine: Literal["vllm"] = Field(default="vllm", description="Generation engine backend.")
    sync_check: bool = Field(
        default=True,
        description="At the start and after every weight sync, check that each engine samples "
        "from what the trainer published: both score a fixed 32-token probe sequence, and a "
        "mean log-probability difference above sync_check_tolerance fails the job "
        "(trainer/sync_check.py). One short forward on each side per sync.")
    sync_check_tolerance: float | None = Field(
        default=None, gt=0.0, le=10.0,
        description="Largest mean |Δ log-prob| (nats per probe token) between an engine and "
        "the trainer. None: 1e-3 for float32 weights, 5e-2 for bfloat16 (the two sides' "
        "kernels round differently; on vLLM-CPU in float32 they agree to under 1e-5).")
    length_schedule: list[LengthStage] = Field(
        default_factory=list, max_length=1000,
        description="A response-length curriculum: bounds by policy version (stages in "
        "version order; before the first, max_tokens and no minimum).")
    tensor_parallel_size: int = Field(
        default=1, ge=1, le=64,
        description="Tensor-parallel workers per rollout engine; each joins the weight-sync "
        "group with a rank of its own. On CPU set VLLM_CPU_OMP_THREADS_BIND to one core "
        "list per worker, separated by '|'.")
    partial_rollout: bool = Field(
        default=True,
        description="On a weight update, in-flight samples pause at a token boundary and go "
        "on under the new version (paper §4.1 step 4; verl fully_async "
        "`async_training.partial_rollout`). False: the update waits until every sample in "
        "flight has finished, so each sample is generated under one version (verl "
        "one_step_off).",
    )


    @model_validator(mode="after")
    def _check_truncation(self) -> RolloutConfig:
        # The engine returns each token's log-prob under the law it sampled from
        # (vLLM's processed_logprobs: after temperature and top-k/top-p), while the
        # trainer scores the token under the whole softmax(logits / temperature):
        # a truncated behaviour law would bias every importance ratio upwards.
        # Lift this where the trainer scores under the same truncation.
        for name, value, off in (("top_p", self.top_p, 1.0), ("top_k", self.top_k, 0)):
            if value != off:
                raise ValueError(
                    f"rollout.{name}: {value:g} truncates the sampling distribution, and the "
                    "engine's behaviour log-probs would be those of the truncated law while "
                    "the trainer scores tokens under the full softmax(logits / temperature): "
                    "a biased importance ratio. Leave rollout.top_p at 1 and rollout.top_k "
                    "at 0.")
        return self

    @model_validator(mode="after")
    def _check_length_schedule(self) -> RolloutConfig:
        if self.group_size == 1:
            raise ValueError("rollout.group_size: 1 trains nothing: a GRPO advantage is the "
                             "reward minus its group's mean, which for a group of one is always "
                             "0; use 2 or more samples per prompt")
        last = 0
        for i, stage in enumerate(self.length_schedule):
            if stage.from_version <= last:
                raise ValueError(f"rollout.length_schedule[{i}].from_version: stages must be in "
                                 "increasing version order")
            if stage.min_tokens > stage.max_tokens:
                raise ValueError(f"rollout.length_schedule[{i}].min_tokens must not exceed its "
                                 "max_tokens")
            last = stage.from_version
        return self

    def response_bounds(self, policy_version: int) -> tuple[int, int]:
        """(min_tokens, max_tokens) of responses generated under `policy_version`."""
        bounds = (0, self.max_tokens)
        for stage in self.length_schedule:
            if policy_version >= stage.from_version:
                bounds = (stage.min_tokens, stage.max_tokens)
        return bounds

    @property
    def longest_response(self) -> int:
        """The longest response any stage allows."""
        return max([self.max_tokens, *(s.max_tokens for s in self.length_schedule)])
