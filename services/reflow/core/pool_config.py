"""The `cluster` section of a job spec: the elastic resource pool (paper §5).
Part of reflow.core.config's JobSpec; kept apart only for size."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from reflow.core.restart_budget import RestartBudget


class _Section(BaseModel):
    # NaN and infinity are refused as what they are ("finite number"), not by a bound
    # they fail to compare with.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class RoleFlip(_Section):
    """One scheduled role flip of an elastic job (for tests and benchmarks; the
    adaptive scheduler's placement decides flips in production)."""

    at_step: int = Field(ge=1, le=100_000_000,
                         description="Requested once the trainer has finished this step; "
                         "carried out at the next sync boundary.")
    worker: int = Field(ge=1, le=4095, description="Worker index (0 holds trainer rank 0 "
                        "and keeps it).")
    role: Literal["rollout", "trainer"] = Field(description="The role the worker moves to.")


class ClusterConfig(_Section):
    """The elastic resource pool (paper §5): AsyncHybrid workers, each holding a
    warm rollout engine and a warm trainer replica, whose roles move mid-job."""

    workers: int | None = Field(
        default=None, ge=2, le=4096,
        description="AsyncHybrid workers for the job. None: one rollout and one trainer "
        "process with fixed roles.")
    trainer_workers: int = Field(
        default=1, ge=1, le=4095,
        description="Workers in the trainer role at start (the data-parallel group's "
        "replicas); the rest start as rollout workers.")
    flips: list[RoleFlip] = Field(
        default_factory=list, max_length=10_000,
        description="Role flips requested at given steps, in order.")
    flip_inflight: Literal["return", "finish"] = Field(
        default="return",
        description="A worker leaving rollout: `return` aborts its groups in flight and the "
        "dispatcher routes them again, with their budget, to the other rollout workers (the "
        "flip does not wait; their partial tokens are discarded); `finish` lets them end "
        "into the buffer first (no tokens lost; the flip waits up to one generation).")

    state_handoff: Literal["auto", "broadcast"] = Field(
        default="auto",
        description="How a replica joining the trainer group receives the leader's "
        "parameters and optimizer state. `auto`: on CPU, replicas on the leader's host copy "
        "them from the leader's shared memory, the others (and every GPU replica) receive a "
        "broadcast over the group; `broadcast`: always the broadcast. With "
        "trainer.parallelism fsdp, shards move point to point over the group either way "
        "(a same-host copy of FSDP's own shard storage measured slower than loopback gloo).")
    min_workers: int = Field(
        default=2, ge=2, le=4096,
        description="An elastic job goes on without a lost worker (other than worker 0, "
        "which is restarted) while at least this many workers are left, one of them a rollout "
        "worker; below it the job fails. 2: down to the leader and one rollout worker.")
    max_restarts: int = Field(
        default=3, ge=0, le=1000,
        description="Restarts of one service of the job (a trainer resumes from its last "
        "checkpoint, trainer.checkpoint_interval) allowed within cluster.restart_window_s; "
        "one more death inside the window is a crash loop and fails the job. Deaths further "
        "apart never add up. Also bounds the trainer's weight-sync rebuilds and trainer-group "
        "breaks over the same window. 0: the first death fails the job.")
    restart_window_s: float = Field(
        default=600.0, gt=0, le=7 * 86400,
        description="The sliding window, in seconds, over which cluster.max_restarts counts "
        "a service's deaths (a crash-loop detector, not a lifetime budget).")
    restart_backoff_s: float = Field(
        default=2.0, ge=0, le=600,
        description="Wait before a restart when the service already restarted within the "
        "window: this, doubling with each recent restart, at most "
        "cluster.restart_backoff_max_s. A first restart is immediate.")
    restart_backoff_max_s: float = Field(default=60.0, ge=0, le=3600,
                                         description="The longest restart backoff, seconds.")
    min_rollout_workers: int = Field(
        default=1, ge=1, le=4095,
        description="A fixed-role job with cluster.max_rollout_workers: the rollout workers "
        "it needs to start, and keeps while other jobs wait for workers.")
    max_rollout_workers: int | None = Field(
        default=None, ge=1, le=4095,
        description="A fixed-role job's range of rollout workers, up to this many: it starts "
        "with what is free (at least cluster.min_rollout_workers), grows into workers freed "
        "while it runs (each new engine joins the weight-sync group at the next sync) and "
        "gives workers back, down to the minimum, while another job waits for them. None: "
        "the backend's fixed share (Kubernetes: every free pod up to the operator's "
        "REFLOW_MAX_ROLLOUT_WORKERS; locally one), never resized.")

    @property
    def rollout_range(self) -> tuple[int, int] | None:
        """(min, max) rollout workers of a resizable fixed-role job, else None."""
        if self.max_rollout_workers is None:
            return None
        return self.min_rollout_workers, self.max_rollout_workers

    def restart_budget(self) -> RestartBudget:
        """The crash-loop detector these fields describe (core/restart_budget.py)."""
        return RestartBudget(self.max_restarts, self.restart_window_s, self.restart_backoff_s,
                             self.restart_backoff_max_s)

    @model_validator(mode="after")
    def _check_pool(self) -> ClusterConfig:
        if self.workers is None:
            # Values, not fields set: a dumped spec carries every default.
            if self.flips or self.trainer_workers != 1 or self.min_workers != 2:
                raise ValueError("cluster.flips, cluster.trainer_workers and "
                                 "cluster.min_workers need cluster.workers (an elastic pool "
                                 "of at least 2 workers)")
            if self.max_rollout_workers is None and self.min_rollout_workers != 1:
                raise ValueError("cluster.min_rollout_workers needs "
                                 "cluster.max_rollout_workers (the top of the range)")
            if (self.max_rollout_workers is not None
                    and self.min_rollout_workers > self.max_rollout_workers):
                raise ValueError(f"cluster.min_rollout_workers ({self.min_rollout_workers}) "
                                 "must be at most cluster.max_rollout_workers "
                                 f"({self.max_rollout_workers})")
            return self
        if self.max_rollout_workers is not None or self.min_rollout_workers != 1:
            raise ValueError("cluster.min_rollout_workers and cluster.max_rollout_workers are "
                             "for fixed-role jobs; an elastic job (cluster.workers) moves "
                             "its workers between roles instead")
        if self.min_workers > self.workers:
            raise ValueError(f"cluster.min_workers ({self.min_workers}) must be at most "
                             f"cluster.workers ({self.workers})")
        if self.trainer_workers >= self.workers:
            raise ValueError(f"cluster.trainer_workers ({self.trainer_workers}) must be below "
                             f"cluster.workers ({self.workers}): a job needs a rollout worker")
        roles = ["trainer" if i < self.trainer_workers else "rollout"
                 for i in range(self.workers)]
        last_step = 0
        for i, flip in enumerate(self.flips):
            where = f"cluster.flips[{i}]"
            if flip.at_step < last_step:
                raise ValueError(f"{where}.at_step: flips must be in step order")
            last_step = flip.at_step
            if flip.worker >= self.workers:
                raise ValueError(f"{where}.worker: {flip.worker} is not a worker of this job "
                                 f"(1 to {self.workers - 1})")
            if roles[flip.worker] == flip.role:
                raise ValueError(f"{where}: worker {flip.worker} is already a {flip.role} "
                                 "worker at that point")
            roles[flip.worker] = flip.role
            if "rollout" not in roles:
                raise ValueError(f"{where}: would leave the job without a rollout worker")
        return self

    def initial_role(self, worker: int) -> str:
        return "trainer" if worker < self.trainer_workers else "rollout"
