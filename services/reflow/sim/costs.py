"""What a simulated GPU job costs: every constant a field, with its source.

The defaults describe a Qwen3-8B-like dense model in bf16 on H100-class GPUs.
Published figures are cited; where a default is a derivation (bytes over a
bandwidth, FLOPs over a peak) the derivation is given; where it is an
assumption it says so, and bench/gpu_check.py measures it on a lent GPU.
"""

from __future__ import annotations

import math
import random

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DecodeCost(_Section):
    """One continuous-batching decode step of an engine: a memory-bandwidth
    floor (all weights read once) plus per-running-sequence and per-context-token
    terms; prefill per prompt token; the KV cache's capacity."""

    # 16.4 GB of bf16 weights over H100 SXM's 3.35 TB/s = 4.9 ms (H200, 4.8 TB/s: 3.4 ms).
    floor_ms: float = Field(4.8, gt=0)
    # Least squares through published H100 8B decode steps of 6.5 / 6.6 / 10.9 / 46.9 ms
    # at 1 / 4 / 16 / 64 concurrent requests, with the floor fixed: 0.64 ms a sequence
    # (fits 5.4 / 7.4 / 15.1 / 45.8 ms: the knee between 16 and 64 is not linear).
    per_sequence_ms: float = Field(0.64, ge=0)
    # KV read per context token per step: 36 layers x 8 KV heads x 128 x 2 (K, V) x 2 B
    # = 147 KiB over 3.35 TB/s = 0.044 us.
    per_context_token_us: float = Field(0.044, ge=0)
    # 2 x 8.2e9 FLOPs a prompt token over 990 TFLOPS bf16 at 50 % utilisation.
    prefill_per_token_us: float = Field(33.0, ge=0)
    # (80 GB x 0.9 - 16.4 GB of weights) / 147 KiB a token.
    kv_capacity_tokens: int = Field(380_000, gt=0)
    # vLLM's max_num_seqs default.
    max_running_sequences: int = Field(256, gt=0)

    def steps_time_s(self, running: int, context: int, steps: int) -> float:
        """Seconds for `steps` decode steps of `running` sequences whose contexts
        total `context` tokens at the first (each step adds one token a sequence)."""
        per_step = self.floor_ms / 1e3 + running * self.per_sequence_ms / 1e3
        ctx_s = self.per_context_token_us / 1e6
        return steps * (per_step + ctx_s * context) + ctx_s * running * steps * (steps - 1) / 2

    def steps_within(self, running: int, context: int, seconds: float) -> int:
        """How many whole decode steps fit in `seconds` (the inverse of steps_time_s)."""
        if seconds <= 0:
            return 0
        a = self.per_context_token_us / 1e6 * running / 2
        b = self.floor_ms / 1e3 + running * self.per_sequence_ms / 1e3 \
            + self.per_context_token_us / 1e6 * context - a
        n = seconds / b if a == 0 else (-b + math.sqrt(b * b + 4 * a * seconds)) / (2 * a)
        n = max(0, int(n))
        while n > 0 and self.steps_time_s(running, context, n) > seconds:
            n -= 1
        while self.steps_time_s(running, context, n + 1) <= seconds:
            n += 1
        return n


class LengthModel(_Section):
    """Response lengths: each prompt's group median drawn lognormal, each sample
    lognormal around it, capped at `max_tokens`; a curriculum stretches them by
    `growth_per_step` each step. The defaults are an assumption of a math-RL
    long tail (median 1,500 tokens, capped at 8,192). Against the published
    traces (Seer: rollout 63-84 % of an iteration, the last 10 % of requests up
    to half of rollout time), a simulated sync step at 32 GPUs has the tail
    (its last 10 % of samples hold the batch for 49 % of generation,
    `rollout_tail_share`) but a larger rollout share (90 %): bench/RESULTS.md."""

    prompt_tokens: int = Field(512, gt=0)
    median_tokens: float = Field(1500.0, gt=0)
    group_sigma: float = Field(0.7, ge=0)
    sample_sigma: float = Field(0.5, ge=0)
    max_tokens: int = Field(8192, gt=0)
    growth_per_step: float = Field(0.0, ge=0)
    # Instead of the lognormal: the length's quantile function through these
    # (probability, tokens) points, linear in log tokens between them and flat
    # beyond the first and the last, every sample drawn alone (a measured
    # distribution: sim/calibrate.py fits it to a real run's batch quantiles).
    quantiles: list[tuple[float, float]] | None = Field(None, min_length=2, max_length=64)

    @model_validator(mode="after")
    def _check_quantiles(self) -> LengthModel:
        q = self.quantiles
        if q is not None and not (
                all(0 < p <= 1 and t >= 1 for p, t in q)
                and all(a[0] < b[0] and a[1] <= b[1] for a, b in zip(q, q[1:]))):
            raise ValueError("lengths.quantiles: (probability, tokens) points with probabilities "
                             "rising in (0, 1] and tokens (at least 1) not falling")
        return self

    def group_median(self, rng: random.Random) -> float:
        if self.quantiles is not None:
            return self.median_tokens
        return self.median_tokens * math.exp(rng.gauss(0.0, self.group_sigma))

    def sample(self, rng: random.Random, group_median: float, step: int) -> int:
        if self.quantiles is not None:
            n = self._quantile(rng.random())
        else:
            n = group_median * math.exp(rng.gauss(0.0, self.sample_sigma))
        n *= (1.0 + self.growth_per_step) ** step
        return max(1, min(self.max_tokens, int(n)))

    def _quantile(self, u: float) -> float:
        q = self.quantiles
        if u <= q[0][0]:
            return q[0][1]
        for (p0, t0), (p1, t1) in zip(q, q[1:]):
            if u <= p1:
                return math.exp(math.log(t0) + (u - p0) / (p1 - p0) * (math.log(t1) - math.log(t0)))
        return q[-1][1]


class TrainCost(_Section):
    """The trainer: FLOPs per trained token over the group's sustained FLOPS."""

    parameters: float = Field(8.2e9, gt=0)
    # Forward and backward (6 N) plus the old-policy forward the loss needs (2 N).
    flops_per_token_per_parameter: float = Field(8.0, gt=0)
    # H100 SXM dense bf16.
    peak_flops_per_gpu: float = Field(989e12, gt=0)
    # Assumption: FSDP training of an 8B model at 40 % MFU.
    utilisation: float = Field(0.4, gt=0, le=1)
    # Assumption: optimizer step and bookkeeping a step.
    step_overhead_s: float = Field(0.5, ge=0)

    def step_s(self, tokens: int, gpus: int) -> float:
        flops = tokens * self.parameters * self.flops_per_token_per_parameter
        return self.step_overhead_s + flops / (gpus * self.peak_flops_per_gpu * self.utilisation)


class SyncCost(_Section):
    """Weight sync and the colocated (sync mode) switch between roles."""

    weight_bytes: float = Field(16.4e9, gt=0)
    # Assumption: NCCL broadcast from the trainer to the engines at 25 GB/s effective
    # (bench/gpu_check.py measures it on a lent GPU).
    bandwidth_bytes_per_s: float = Field(25e9, gt=0)
    # Assumption: the engines' pause, load and resume around the transfer.
    overhead_s: float = Field(1.0, ge=0)
    # vLLM sleep/wake: 0.1-6 s reported; a colocated step sleeps and wakes once each.
    colocate_switch_s: float = Field(3.0, ge=0)

    @property
    def sync_s(self) -> float:
        return self.overhead_s + self.weight_bytes / self.bandwidth_bytes_per_s


class FlipCost(_Section):
    """One AsyncHybrid worker's role flip, as the trainer's pause at the sync
    boundary it lands at (paper §5). The pauses are full fine-tuning's; with the
    job's `lora` the part that moves trainer state is priced by the adapter's
    state instead (sim/lora.py)."""

    # Paper Table 2 (32 GPUs): 24:8 -> 16:16, rollout to train, 9.20 s (the joiners
    # receive parameter and optimizer shards).
    to_trainer_s: float = Field(9.2, ge=0)
    # Paper Table 2 (32 GPUs): 16:16 -> 24:8, train to rollout, 5.72 s.
    to_rollout_s: float = Field(5.72, ge=0)
    # Assumption: the shard-local broadcasts of a flip run at the weight sync's
    # effective NCCL bandwidth. At the defaults a joiner's shard of an 8B model's
    # weights and AdamW moments (49 GB over 16 ranks) takes 0.12 s of the 9.2 s: the
    # rest is regrouping, which LoRA does not shorten.
    state_bandwidth_bytes_per_s: float = Field(25e9, gt=0)


class ToolCost(_Section):
    """Multi-turn episodes (an agent calling tools): a response is `turns` model
    turns of equal length; between two, the sequence leaves the batch for a tool
    call of lognormal latency and comes back with the tool's output prefilled
    (its earlier context from the prefix cache). Defaults: single-turn."""

    turns: int = Field(1, ge=1, le=64)
    # Assumption: a sandboxed code or search call, median 2 s with a long tail
    # (SkyRL-style environments report 1-10 s a call).
    latency_median_s: float = Field(2.0, ge=0)
    latency_sigma: float = Field(0.8, ge=0)
    # Assumption: a tool's result is a short observation.
    output_tokens: int = Field(128, ge=0)

    def latency_s(self, rng: random.Random) -> float:
        return self.latency_median_s * math.exp(rng.gauss(0.0, self.latency_sigma))


class ModelShape(_Section):
    """The decoder blocks' dimensions (a Hugging Face config.json's names), which
    size a LoRA adapter (sim/lora.py). Defaults: Qwen3-8B's config.json. Only a
    job with `lora` reads them; the model's parameters and bytes are
    `train.parameters` and `sync.weight_bytes`."""

    hidden_size: int = Field(4096, gt=0)
    intermediate_size: int = Field(12288, gt=0)
    num_layers: int = Field(36, gt=0, description="num_hidden_layers")
    num_heads: int = Field(32, gt=0, description="num_attention_heads")
    num_kv_heads: int = Field(8, gt=0, description="num_key_value_heads")
    head_dim: int = Field(128, gt=0)

    @model_validator(mode="after")
    def _check(self) -> ModelShape:
        if self.num_kv_heads > self.num_heads:
            raise ValueError(f"costs.model.num_kv_heads ({self.num_kv_heads}) must not exceed "
                             f"num_heads ({self.num_heads})")
        return self

    def widened(self, factor: float) -> ModelShape:
        """The shape `factor` times as wide at the same depth (head_dim kept, head
        counts scaled): a model of factor² the parameters, as `reflow sim plan`
        scales one (an assumption: real families also grow in depth)."""
        def scale(n: int) -> int:
            return max(1, round(n * factor))

        heads = scale(self.num_heads)
        return self.model_copy(update={
            "hidden_size": scale(self.hidden_size),
            "intermediate_size": scale(self.intermediate_size),
            "num_heads": heads, "num_kv_heads": min(heads, scale(self.num_kv_heads))})


class CostModel(_Section):
    decode: DecodeCost = DecodeCost()
    lengths: LengthModel = LengthModel()
    train: TrainCost = TrainCost()
    sync: SyncCost = SyncCost()
    flip: FlipCost = FlipCost()
    tools: ToolCost = ToolCost()
    model: ModelShape = ModelShape()
    # GPUs per rollout engine (tensor parallel): 1 for an 8B model.
    gpus_per_engine: int = Field(1, gt=0)


class SimConfig(_Section):
    """`reflow sim CONFIG`: the job (a JobSpec mapping; its mode is replaced by
    each `--modes` entry), the cluster split and the cost model."""

    job: dict = Field(description="A JobSpec, as in a job YAML (model.path is not read).")
    # Disaggregated modes: the share of GPUs that generate (sync mode colocates).
    rollout_fraction: float = Field(0.75, gt=0, lt=1)
    # Samples a step per GPU: trainer.batch_size = this x GPUs, rounded to whole groups.
    samples_per_gpu: int | None = Field(None, gt=0)
    steps: int = Field(200, gt=0)
    # Steps left out of the throughput (the pipeline filling).
    warmup_steps: int = Field(5, ge=0)
    seed: int = 0
    costs: CostModel = CostModel()

    @model_validator(mode="after")
    def _check(self) -> SimConfig:
        if self.warmup_steps >= self.steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must be below steps "
                             f"({self.steps})")
        return self
