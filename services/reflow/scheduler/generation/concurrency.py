"""Adaptive generation scheduling (paper §6.1), the decisions only: no RPC, no
threads. `reflow.scheduler.generation.dispatch` feeds them measurements and carries them out.

Three parts, each of which a job can turn off (`scheduler.*` in the spec):

- `LengthEstimator`, T̂(r): a request's expected response length. Per prompt
  (keyed by its text) where that prompt has been generated before, an EWMA of
  its observed lengths; otherwise the EWMA over every prompt of the job (the
  task's); before any observation, `rollout.max_tokens` (the safe side).
- `ConcurrencyController`, the slow loop: every `control_interval_s` it smooths
  each worker's KV-cache use u and preemption growth ΔP with EWMAs (û, ΔP̂,
  weight α) and sets the worker's concurrency cap. Preemptions or a nearly
  full cache cut the cap multiplicatively (preempted requests recompute their
  KV cache: pure waste); a cache with room while the cap held back work raises
  it additively. The cap does not move when nothing was held back: a worker
  that is not asked for more gives no evidence that more would fit.
- `route`, the fast path: a group of n samples may go to worker i only if its
  cap leaves n slots and, with token admission on,
  (T_pred_i + n·(prompt + T̂(r))) / Budget_i <= ρ, where T_pred_i is the KV
  tokens its in-flight samples are predicted to hold at their end and Budget_i
  its KV capacity in tokens. Of the admissible workers the least loaded
  (lowest T_pred_i / Budget_i, then fewest in flight) gets it. A worker with
  nothing in flight admits any one group, so a prompt longer than ρ·Budget
  still runs (alone) instead of waiting forever.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

from reflow.core.config import JobSpec

# Distinct prompts whose length history is kept (least recently seen dropped first).
MAX_TRACKED_PROMPTS = 100_000


class LengthEstimator:
    """T̂(r) of paper §6.1: expected response tokens of a request."""

    def __init__(self, max_tokens: int, alpha: float = 0.5,
                 max_prompts: int = MAX_TRACKED_PROMPTS) -> None:
        self.max_tokens = max_tokens
        self.alpha = alpha
        self.max_prompts = max_prompts
        self._per_prompt: OrderedDict[str, float] = OrderedDict()
        self._overall: float | None = None

    def predict(self, prompt_key: str) -> float:
        if prompt_key in self._per_prompt:
            return self._per_prompt[prompt_key]
        return self.max_tokens if self._overall is None else self._overall

    def observe(self, prompt_key: str, response_tokens: int) -> None:
        tokens = float(min(max(response_tokens, 0), self.max_tokens))
        self._overall = tokens if self._overall is None else (
            self.alpha * tokens + (1 - self.alpha) * self._overall)
        previous = self._per_prompt.pop(prompt_key, None)
        self._per_prompt[prompt_key] = tokens if previous is None else (
            self.alpha * tokens + (1 - self.alpha) * previous)
        while len(self._per_prompt) > self.max_prompts:
            self._per_prompt.popitem(last=False)


@dataclass
class WorkerLoad:
    """The dispatcher's view of one rollout worker."""

    name: str
    cap: int
    inflight: int = 0
    # T_pred_i: KV tokens (prompt + predicted response) its in-flight samples hold at their end.
    predicted_tokens: float = 0.0
    # Budget_i: its KV-cache capacity in tokens; 0 when the engine does not say.
    kv_budget_tokens: int = 0
    # Whether the cap turned work away since the controller last looked.
    cap_limited: bool = False
    utilisation_ewma: float | None = None
    preemption_ewma: float | None = None
    routable: bool = True

    @property
    def token_load(self) -> float:
        return self.predicted_tokens / self.kv_budget_tokens if self.kv_budget_tokens else 0.0


@dataclass(frozen=True)
class CapDecision:
    worker: str
    old_cap: int
    new_cap: int
    reason: str  # raise_under_utilised | cut_preemption | cut_kv_pressure | hold
    utilisation: float
    utilisation_ewma: float
    preemptions: float
    preemption_ewma: float
    cap_limited: bool

    def as_event(self) -> dict:
        return {"event": "concurrency_cap", **self.__dict__}


@dataclass
class ConcurrencyController:
    """The slow loop of paper §6.1; bounds and steps from `scheduler.*`."""

    alpha: float
    min_cap: int
    max_cap: int
    step: int
    backoff: float
    utilisation_low: float
    utilisation_high: float
    preemption_tolerance: float
    group_size: int = 1

    @classmethod
    def from_spec(cls, spec: JobSpec) -> ConcurrencyController:
        s, group = spec.scheduler, spec.rollout.group_size
        return cls(alpha=s.ewma_alpha, min_cap=max(group, s.min_concurrency or group),
                   max_cap=s.max_concurrency, step=s.concurrency_step or group,
                   backoff=s.concurrency_backoff, utilisation_low=s.utilisation_low,
                   utilisation_high=s.utilisation_high,
                   preemption_tolerance=s.preemption_tolerance, group_size=group)

    def update(self, worker: WorkerLoad, utilisation: float, preemptions: float) -> CapDecision:
        """One tick for one worker: `utilisation` its mean KV-cache use (0-1) and
        `preemptions` the requests its engine preempted since the last tick."""
        u = min(max(utilisation, 0.0), 1.0)
        dp = max(preemptions, 0.0)
        worker.utilisation_ewma = u if worker.utilisation_ewma is None else (
            self.alpha * u + (1 - self.alpha) * worker.utilisation_ewma)
        worker.preemption_ewma = dp if worker.preemption_ewma is None else (
            self.alpha * dp + (1 - self.alpha) * worker.preemption_ewma)
        old, limited = worker.cap, worker.cap_limited
        if worker.preemption_ewma > self.preemption_tolerance:
            new, reason = math.floor(old * self.backoff), "cut_preemption"
        elif worker.utilisation_ewma > self.utilisation_high:
            new, reason = math.floor(old * self.backoff), "cut_kv_pressure"
        elif worker.utilisation_ewma < self.utilisation_low and limited:
            new, reason = old + self.step, "raise_under_utilised"
        else:
            new, reason = old, "hold"
        new = min(self.max_cap, max(self.min_cap, new))
        if new == old:
            reason = "hold"
        worker.cap, worker.cap_limited = new, False
        return CapDecision(worker.name, old, new, reason, u, worker.utilisation_ewma, dp,
                           worker.preemption_ewma, limited)


@dataclass
class RouteResult:
    worker: WorkerLoad | None
    # Why no worker took it: "" (one did), "cap" (every worker's cap is full) or
    # "tokens" (a cap had room but token-budget admission refused).
    refused_by: str = ""
    considered: list[str] = field(default_factory=list)


def route(workers: list[WorkerLoad], group_size: int, group_tokens: float,
          admission_ratio: float, token_admission: bool) -> RouteResult:
    """The least-loaded admissible worker for a group of `group_size` samples
    predicted to hold `group_tokens` KV tokens (paper §6.1). When no worker can
    take it, those whose cap turned it away are marked `cap_limited` (the
    controller's evidence that a higher cap would be used)."""
    admissible: list[WorkerLoad] = []
    capped: list[WorkerLoad] = []
    refused_by_tokens = False
    for w in workers:
        if not w.routable:
            continue
        if w.inflight + group_size > w.cap:
            capped.append(w)
            continue
        if (token_admission and w.kv_budget_tokens and w.inflight
                and (w.predicted_tokens + group_tokens) / w.kv_budget_tokens > admission_ratio):
            refused_by_tokens = True
            continue
        admissible.append(w)
    if not admissible:
        for w in capped:
            w.cap_limited = True
        return RouteResult(None, "tokens" if refused_by_tokens else "cap")
    best = min(admissible, key=lambda w: (w.token_load, w.inflight / max(w.cap, 1), w.name))
    return RouteResult(best, "", [w.name for w in admissible])
