"""The Worker service's core: an AsyncHybrid worker's role in a job.

The process serves the Rollout and Trainer services beside this one (see
`reflow serve worker`); both halves are started for an elastic job before any
role is given, so a flip only moves work, never builds anything:
- rollout -> trainer: the engine stops admitting groups; its groups in flight
  either go back to the dispatcher, which routes them again with their budget
  (`cluster.flip_inflight: return`: the flip does not wait, the partial tokens
  are discarded), or finish into the buffer first (`finish`). It stays
  loaded and keeps receiving every published version, so the flip back needs
  no weight transfer. On CPU the engine's memory stays allocated (the
  equivalent of vLLM's sleep mode there is none: the KV cache is plain host
  memory that vLLM-CPU cannot release and re-allocate). The trainer replica
  is brought into the group by the trainer leader at the next sync boundary.
- trainer -> rollout: the leader has dropped the replica from its group at a
  sync boundary (its state stays here); the engine admits groups again, with
  the weights of the latest version already loaded.
Transport lives in `server.py`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from reflow.core.config import check_job_id

ROLES = ("rollout", "trainer")
MAX_DRAIN_S = 600.0


@dataclass
class RoleStatus:
    job_id: str
    role: str
    flips: int = 0
    last_flip: str = ""
    last_flip_s: float = 0.0
    engine_inflight: int = 0


class HybridWorker:
    def __init__(self, rollout, trainer) -> None:
        """`rollout`: this process's RolloutService; `trainer`: its TrainerService."""
        self.rollout = rollout
        self.trainer = trainer
        self._lock = threading.Lock()
        self._status = RoleStatus("", "")

    def set_role(self, job_id: str, role: str, drain_timeout_s: float = 60.0,
                 hand_back: bool = False) -> RoleStatus:
        """`hand_back`: to the trainer role, abort the groups in flight and return
        them to the dispatcher instead of letting them finish (`drain_timeout_s`)."""
        check_job_id(job_id)
        if role not in ROLES:
            raise ValueError(f"role: {role[:40]!r} is not one of {', '.join(ROLES)}")
        if not 0 <= drain_timeout_s <= MAX_DRAIN_S:
            raise ValueError(f"drain_timeout_s: 0 to {MAX_DRAIN_S:.0f} seconds")
        with self._lock:
            status = self._status
            if status.job_id == job_id and status.role == role:
                return self._snapshot()  # a retried request
            previous = status.role if status.job_id == job_id else ""
            started = time.monotonic()
            # The engine must belong to this job (started by the scheduler).
            inflight = self.rollout.set_standby(job_id, role == "trainer",
                                                drain_timeout_s if role == "trainer" else 0.0,
                                                hand_back and role == "trainer")
            if role == "trainer" and inflight:
                # Not drained: admit again and report, rather than strand samples.
                self.rollout.set_standby(job_id, False)
                raise TimeoutError(f"{inflight} samples still generating after "
                                   f"drain_timeout_s={drain_timeout_s:.0f}s; retry later")
            flips = status.flips + 1 if previous else status.flips
            self._status = RoleStatus(
                job_id, role, flips if status.job_id == job_id else 0,
                f"{previous}->{role}" if previous else "",
                time.monotonic() - started if previous else 0.0)
            return self._snapshot()

    def role(self, job_id: str) -> RoleStatus:
        if job_id and job_id != self._status.job_id:
            return RoleStatus(job_id, "")
        return self._snapshot()

    def _snapshot(self) -> RoleStatus:
        s = self._status
        inflight = 0
        if s.job_id:
            try:
                counters, _, _, _ = self.rollout.stats(s.job_id)
                inflight = counters.inflight_samples
            except KeyError:
                inflight = 0
        return RoleStatus(s.job_id, s.role, s.flips, s.last_flip, s.last_flip_s, inflight)
