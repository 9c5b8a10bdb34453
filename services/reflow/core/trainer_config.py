"""The trainer's section of the job spec (paper §4.1 step 3)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from reflow.core.sections import _Section


class TrainerConfig(_Section):
    """Optimisation settings (paper §4.1 step 3)."""

    batch_size: int = Field(
        default=64, ge=1, description="b: trajectories per training step (at most the "
        "operator's REFLOW_MAX_BATCH_SIZE, checked at submission)."
    )
    num_steps: int = Field(default=100, ge=1,
                           description="Training steps before the job ends (at most the "
                           "operator's REFLOW_MAX_NUM_STEPS).")
    learning_rate: float = Field(default=1e-3, gt=0.0, le=1.0,
                                 description="AdamW learning rate: the peak of `lr_schedule`.")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        default="constant",
        description="The learning rate over the steps after the warm-up: `constant`, or "
        "decayed over the rest of trainer.num_steps to `min_lr_ratio` x learning_rate, "
        "`linear`ly or along a half `cosine` (Hugging Face's schedulers of those names, "
        "trainer/schedule.py). Taken from the step number alone, so a resumed trainer and "
        "a replica joining the group by a role flip go on where the schedule stands.")
    warmup_steps: int = Field(
        default=0, ge=0, le=1_000_000,
        description="Steps of a linear warm-up from 0 to learning_rate before the schedule "
        "(as Hugging Face's get_linear_schedule_with_warmup: step k, counted from 0, trains "
        "at k / warmup_steps x learning_rate, so the first step of a warm-up trains at 0). "
        "At most trainer.num_steps.")
    min_lr_ratio: float = Field(
        default=0.0, ge=0.0, le=1.0,
        description="The floor a `linear` or `cosine` schedule decays to, as a share of "
        "learning_rate (Hugging Face's `min_lr_rate`); 0 decays to 0.")
    weight_decay: float = Field(default=0.0, ge=0.0, le=1.0, description="AdamW weight decay.")
    clip_eps: float = Field(
        default=0.2, gt=0.0, le=10.0,
        description="PPO clip range ε of the ratio: its lower side, 1 - ε, and its upper "
        "side too unless algorithm.clip_eps_high (or the loss's default) sets it.")
    num_minibatches: int = Field(
        default=1, ge=1, le=1024,
        description="Optimizer steps per batch: the batch is cut into this many equal "
        "contiguous minibatches, each one step (verl's ppo_mini_batch_size, as a count). "
        "Past the first, the trainer's policy has moved from the one that scored the batch, "
        "which algorithm.proximal corrects for. trainer.batch_size must divide by it.")
    max_grad_norm: float = Field(default=1.0, gt=0.0, le=1e6, description="Gradient clipping norm.")
    max_tokens_per_micro_batch: int | None = Field(
        default=2048, ge=1, le=16_777_216,
        description="Padded tokens per forward/backward pass: a step's batch is sorted by "
        "length and cut into micro-batches of at most this many (sequences x longest), whose "
        "gradients accumulate into one optimizer step, as verl's `use_dynamic_bsz` with "
        "`ppo_max_token_len_per_gpu`. Cuts padding on long-tailed lengths and bounds "
        "activation memory; the gradient is the whole batch's. A sequence longer than this "
        "gets a micro-batch of its own. None: the whole batch in one pass.",
    )
    logprob_chunk_tokens: int | None = Field(
        default=1024, ge=1, le=1_048_576,
        description="Positions whose full-vocabulary logits exist at once when the trainer "
        "scores tokens: log-probabilities come from the model's last hidden states, this many "
        "positions at a time, each chunk's logits recomputed in the backward pass instead of "
        "kept (as Liger's fused linear cross-entropy does, unfused). Bounds the logits' "
        "memory at chunk x vocabulary floats instead of micro-batch tokens x vocabulary. "
        "None: one full forward to logits, as a plain Hugging Face loss does.",
    )
    activation_checkpointing: bool = Field(
        default=False,
        description="Recompute each transformer block's activations in the backward pass "
        "instead of keeping them (Hugging Face gradient checkpointing, non-reentrant): less "
        "memory per micro-batch token for about one more forward pass of compute.",
    )
    kl_coef: float = Field(
        default=0.0, ge=0.0, le=10.0,
        description="β: weight of a KL penalty to the frozen initial model, added to the loss "
        "per policy token with the k3 estimator exp(ref - new) - (ref - new) - 1 (verl's "
        "`use_kl_loss` with `kl_loss_type=low_var_kl`; TRL's `beta`). 0 (DAPO's choice) "
        "keeps no reference model; above 0 the trainer holds a second copy of the weights.",
    )
    sync_interval: int = Field(
        default=1, ge=1, le=1_000_000,
        description="Publish a new policy version every this many steps."
    )
    checkpoint_interval: int = Field(
        default=20, ge=0, le=1_000_000,
        description="Save a checkpoint (model, optimizer, step, policy version, RNG and the "
        "replay buffer's ledger; torch.distributed.checkpoint, written in the background) "
        "every this many steps, and on a graceful stop, under <run_dir>/checkpoints. A "
        "restarted trainer resumes from the newest committed one, so a fault costs at most "
        "this many steps. 0: only on a graceful stop.",
    )
    checkpoint_keep_last: int = Field(
        default=2, ge=1, le=1000,
        description="Committed checkpoints kept; older ones are deleted once a newer one "
        "commits. Each holds the model and AdamW's two moments: about 3x the model's bytes.",
    )
    policy_snapshot_interval: int = Field(
        default=0, ge=0, le=1_000_000,
        description="Also write the policy itself (the final policy's format: Hugging Face, "
        "LoRA merged) every this many steps under <run_dir>/policies/step-<N>, to score later "
        "with `reflow eval` (runs compared at a wall time or a sample count, the evaluation "
        "off the run's engines). The step record carries `policy_snapshot_s`. 0: none. Not "
        "with fsdp or hsdp (their whole weights are gathered at the end only).")
    parallelism: Literal["auto", "replicate", "fsdp", "hsdp"] = Field(
        default="auto",
        description="How the trainer group holds the model. `replicate`: every rank holds "
        "all of the weights, gradients and AdamW state, gradients are all-reduced. `fsdp`: "
        "FSDP2 (`fully_shard` per transformer block and on the root), each rank holds 1/N "
        "of them, gradients are reduce-scattered, weight sync gathers a bucket at a time "
        "(trainer/fsdp.py), a role flip moves only the joiner's or leaver's shards "
        "(trainer/reshard.py), a lost replica fails the job, and checkpoints are saved "
        "sharded by every rank. `hsdp`: FSDP inside each replica of trainer.shard_size ranks, "
        "data parallel across replicas (a 2-D device mesh): a lost replica's shards are held "
        "by the others, so the group goes on without it. `auto`: fsdp for an elastic pool "
        "whose trainer group has 2 "
        "or more ranks at start or may change by role flips, on a model of at least 1e9 "
        "parameters (where replicated AdamW state passes 16 GB a rank in fp32), else "
        "replicate.")
    shard_size: int | None = Field(
        default=None, ge=1, le=4096,
        description="With hsdp: the ranks of one replica, over which each replica shards "
        "the model; the trainer group holds whole replicas (its size a multiple).")
    collective_timeout_s: float = Field(
        default=120.0, ge=5.0, le=86_400.0,
        description="With hsdp: the longest one rank waits in one collective inside a step "
        "or a weight-sync bucket (a replica's gathers and reduce-scatters, the all-reduce "
        "across replicas) before the group counts as broken. A survivor of a lost replica "
        "left waiting on a rank that gave the step up (alive, so its sockets stay open) is "
        "freed by it and rejoins: keep it above the slowest bucket's push to the engines.")
    fsdp_cpu_offload: bool = Field(
        default=False,
        description="With fsdp: keep the sharded parameters, gradients and optimizer step "
        "in host memory (FSDP2's CPUOffloadPolicy), moving each block to the GPU for its "
        "compute.")
    batch_timeout_s: float = Field(
        default=600.0, gt=0.0, le=86_400.0,
        description="Longest wait for a batch before the job fails."
    )

    @model_validator(mode="after")
    def _check_snapshots(self) -> TrainerConfig:
        if self.policy_snapshot_interval and self.parallelism in ("fsdp", "hsdp"):
            raise ValueError("trainer.policy_snapshot_interval: snapshots need a replicated "
                             "trainer (trainer.parallelism: replicate or auto); a sharded one "
                             "gathers its whole weights at the end only. Set it to 0.")
        return self

    @model_validator(mode="after")
    def _check_shards(self) -> TrainerConfig:
        if (self.parallelism == "hsdp") != (self.shard_size is not None):
            raise ValueError("trainer.shard_size: set it with trainer.parallelism: hsdp (the "
                             "ranks of one replica), and only then")
        return self

    @model_validator(mode="after")
    def _check_schedule(self) -> TrainerConfig:
        if self.warmup_steps > self.num_steps:
            raise ValueError(f"trainer.warmup_steps: {self.warmup_steps} is longer than the run "
                             f"(trainer.num_steps {self.num_steps}); the learning rate would "
                             "never reach trainer.learning_rate. Use at most num_steps.")
        if self.lr_schedule == "constant" and self.min_lr_ratio > 0.0:
            raise ValueError(f"trainer.min_lr_ratio: {self.min_lr_ratio:g} is the floor of a "
                             "decaying schedule, and trainer.lr_schedule is constant; set "
                             "lr_schedule to linear or cosine, or leave min_lr_ratio out.")
        return self
