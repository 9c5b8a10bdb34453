"""Operator ceilings on what one job spec may ask for.

The JobSpec's own bounds say what is *meaningful*; these say what *this
cluster* grants, so that one spec cannot exhaust it (a 10^6-sample batch, a
response of 10^5 tokens, a hundred queued jobs). The scheduler applies them to
every submission and refuses a spec over a ceiling with a message naming the
field and the ceiling; the API answers 422 (429 for the active-job ceiling).

Read from `REFLOW_MAX_*` environment variables (the chart's `scheduler.limits`).
"""

from __future__ import annotations

import os

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from reflow.core.config import JobSpec

ENV_PREFIX = "REFLOW_"

class OperatorLimits(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_batch_size: int = Field(default=4096, ge=1, description="trainer.batch_size ceiling.")
    max_response_tokens: int = Field(default=32768, ge=1, description="rollout.max_tokens ceiling.")
    max_inflight_samples: int = Field(default=4096, ge=1,
                                      description="rollout.max_inflight_samples ceiling.")
    max_samples_per_step: int = Field(
        default=65536, ge=1,
        description="B_max ceiling: rollout.max_samples_per_step (or trainer.batch_size when unset).")
    max_kv_cache_gb: float = Field(default=256.0, gt=0, description="rollout.kv_cache_gb ceiling.")
    max_num_steps: int = Field(default=1_000_000, ge=1, description="trainer.num_steps ceiling.")
    max_active_jobs: int = Field(default=32, ge=1,
                                 description="Jobs pending or running at once; more are refused.")

    @classmethod
    def from_env(cls) -> OperatorLimits:
        """REFLOW_MAX_BATCH_SIZE=..., one variable per field; a bad value names it."""
        values = {name: os.environ[ENV_PREFIX + name.upper()] for name in cls.model_fields
                  if os.environ.get(ENV_PREFIX + name.upper())}
        try:
            return cls.model_validate(values)
        except ValidationError as err:
            first = err.errors()[0]
            raise ValueError(f"{ENV_PREFIX}{str(first['loc'][0]).upper()}: {first['msg']}") from None

    def check(self, spec: JobSpec) -> None:
        """Refuse a spec that asks for more than a ceiling, naming field and ceiling."""
        asked = [
            ("trainer.batch_size", spec.trainer.batch_size, self.max_batch_size, "max_batch_size"),
            ("rollout.max_tokens", spec.rollout.longest_response, self.max_response_tokens,
             "max_response_tokens"),
            ("rollout.max_inflight_samples", spec.concurrency_cap,
             self.max_inflight_samples, "max_inflight_samples"),
            ("scheduler.max_concurrency", spec.scheduler.max_concurrency,
             self.max_inflight_samples, "max_inflight_samples"),
            ("rollout.max_samples_per_step", spec.samples_per_step, self.max_samples_per_step,
             "max_samples_per_step"),
            ("rollout.kv_cache_gb", spec.rollout.kv_cache_gb, self.max_kv_cache_gb,
             "max_kv_cache_gb"),
            ("trainer.num_steps", spec.trainer.num_steps, self.max_num_steps, "max_num_steps"),
        ]
        for field, value, ceiling, name in asked:
            if value > ceiling:
                raise ValueError(f"{field}: {value} exceeds this cluster's ceiling of {ceiling} "
                                 f"({ENV_PREFIX}{name.upper()}); ask for less or ask the operator")
