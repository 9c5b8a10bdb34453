"""Which rollout workers the dispatcher routes to, as the job's membership
changes: an elastic pool's worker moving between roles (`set_standby`), a
worker lost and restarted (`worker_lost`), lost for good or given back
(`worker_retired`), replaced by another pod (`replace_worker`), or new
(`add_worker`: the job grew into a free worker). A mixin of generation/dispatch.py's
Dispatcher, whose state (`loads`, `clients`, `_groups`, `_cond`, ...) it
changes under the dispatcher's lock; kept apart only for size."""

from __future__ import annotations

import threading

from reflow.scheduler.generation.concurrency import WorkerLoad


class WorkerMembership:
    def _check_ready_soon(self) -> None:
        """Look at the unready workers' engines at the next round, not a poll later."""
        self._ready_checked = float("-inf")

    # --- the elastic pool's role flips (scheduler/placement/elastic.py) --------------------------

    def set_standby(self, name: str, standby: bool) -> None:
        """Take a worker out of routing (its worker moves to the trainer role) or put
        it back (routable again once its engine reports running)."""
        with self._cond:
            worker = self.loads[name]
            if standby:
                self._standby.add(name)
                self._unready.discard(name)
                worker.routable = False
            else:
                self._standby.discard(name)
                self._unready.add(name)
                self._check_ready_soon()
            self._cond.notify_all()
        self.record({"event": "worker_standby" if standby else "worker_admitting",
                     "worker": name})

    def worker_lost(self, name: str) -> int:
        """`name`'s process died (the job controller is replacing it): every group
        it held goes out again first, under its own id and on the budget it was
        granted, exactly once (the buffer's put is idempotent per group id, so one
        that did reach the buffer is not stored twice). The worker is routed to
        again once its new engine runs. Returns the groups re-routed."""
        with self._cond:
            lost = [(gid, g) for gid, g in self._groups.items() if g.worker.name == name]
            for gid, group in lost:
                del self._groups[gid]
                self._recovered.append((gid, group.prompt))
                self._granted += self.group_size
            worker = self.loads[name]
            worker.inflight, worker.predicted_tokens, worker.routable = 0, 0.0, False
            self._unready.add(name)
            self._check_ready_soon()
            # The new process numbers its events from the start.
            self._events_restart.add(name)
            self.recovered_groups += len(lost)
            self._cond.notify_all()
        self.record({"event": "worker_lost", "worker": name, "groups_rerouted": len(lost)})
        return len(lost)

    def worker_retired(self, name: str) -> int:
        """`name` died and the job goes on without it (an elastic job's pool shrank):
        its groups go out again as for a lost worker, and it is never routed to nor
        read from again. Returns the groups re-routed."""
        rerouted = self.worker_lost(name)
        with self._cond:
            self._unready.discard(name)
            self._standby.add(name)
            self._retired.add(name)
            self._cond.notify_all()
        return rerouted

    def replace_worker(self, name: str, new_name: str, client) -> None:
        """`new_name` takes the place of `name`, which left the job for good (an idle
        pod took a lost rollout pod's place): `name`'s groups go out again, and
        `new_name` is routed to once its engine runs."""
        rerouted = self.worker_retired(name)
        with self._cond:
            # New dicts, not grown ones: other threads iterate them unlocked.
            self.clients = {**self.clients, new_name: client}
            self.loads = {**self.loads,
                          new_name: WorkerLoad(new_name, self.loads[name].cap, routable=False)}
            self._unready.add(new_name)
            self._check_ready_soon()
            self._cond.notify_all()
        self._watch_events(new_name)
        self.record({"event": "worker_replaced", "worker": name, "by": new_name,
                     "groups_rerouted": rerouted})

    def add_worker(self, name: str, client) -> None:
        """`name` joins the job (it grew into a free worker): routed to once its engine
        runs the version the buffer has now, which the trainer sends it whole at its
        next publish; until then its samples would only be evicted as stale."""
        with self._cond:
            if name in self.loads and name not in self._retired:
                raise ValueError(f"{name}: already a rollout worker of job {self.job_id}")
            # One given back earlier comes back as a new worker, read from the start.
            self._retired.discard(name)
            self._standby.discard(name)
            self._events_epoch[name] = self._events_epoch.get(name, 0) + 1
            # A worker's cap as the concurrency control left it on a peer (same kind of
            # machine); the control moves it from there.
            cap = max(w.cap for w in self.loads.values())
            self.clients = {**self.clients, name: client}
            self.loads = {**self.loads, name: WorkerLoad(name, cap, routable=False)}
            self._min_version[name] = self.policy_version
            self._unready.add(name)
            self._check_ready_soon()
            self._cond.notify_all()
        self._watch_events(name)
        self.record({"event": "worker_joined", "worker": name, "concurrency_cap": cap,
                     "from_version": self.policy_version})

    def _watch_events(self, name: str) -> None:
        thread = threading.Thread(target=self._guard, args=(self._event_loop, (name,)),
                                  name=f"dispatch-{self.job_id[:20]}-events-{name}",
                                  daemon=True)
        thread.start()
        self._threads.append(thread)

    def inflight(self, name: str) -> int:
        """Samples the dispatcher holds out on `name` (routed, not yet ended)."""
        with self._cond:
            return self.loads[name].inflight

    def routable(self, name: str) -> bool:
        with self._cond:
            return self.loads[name].routable
