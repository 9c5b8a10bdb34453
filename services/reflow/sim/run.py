"""One simulated job: the product's Dispatcher and ReplayStore on a virtual
clock, SimEngines generating, and a trainer that costs TrainCost per step.

The trainer follows TrainLoop's step (trainer/loop.py): lease a batch from the
buffer (its wait is the trainer's idle time), train, release, and every
`trainer.sync_interval` steps publish a version: without partial rollout the
engines first stop admitting and finish what runs (the update waits for them,
verl's one_step_off), then every engine pauses for the sync (SyncCost, priced by
the weights' bytes or, with the job's `lora`, the adapters': sim/lora.py) and the
buffer learns the version. In sync mode rollout and trainer share every GPU
(JobSpec.colocated) and each role switch costs SyncCost.colocate_switch_s.

In reflow mode with scheduler.placement on, the GPUs are an elastic pool
(sim/pool.py): unit 0 holds the trainer's leader, every other unit an engine;
each step's record goes to the product's PlacementFeed and Algorithm 1, and the
product's ElasticPool carries a rebalance out, driven at the simulation's
events; a membership it asks for takes effect at the trainer's next sync
boundary.

Writes OUT/metrics.jsonl (one record a step, under the field names of a real
run's, trainer/records.py, so reflow.report summarises both), OUT/summary.json
and OUT/report.png.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import statistics
import time
from pathlib import Path

from reflow.core.clock import VirtualClock
from reflow.core.config import MODE_PRESETS, JobSpec, parse_job_spec
from reflow.core.pool_config import ClusterConfig
from reflow.replay.client import InprocReplayClient
from reflow.replay.store import ReplayStore
from reflow.report import plot
from reflow.scheduler.generation.dispatch import BUDGET_POLL_S, Dispatcher
from reflow.scheduler.placement.elastic import ElasticPool
from reflow.rollout.scoring import GroupScoring
from reflow.scheduler.placement.feed import PlacementFeed, planner_for
from reflow.sim.costs import SimConfig
from reflow.sim.engine import SimEngine
from reflow.sim.lora import transfers
from reflow.sim.pool import SimLeader, SimWorkerClient
from reflow.trainer.records import engine_step_fields
from reflow.tasks import Prompt

JOB_ID = "sim"


class SimTask:
    """The dispatcher's prompt stream: prompts are ids (lengths are the engines')."""

    def prompts(self):
        i = 0
        while True:
            i += 1
            yield Prompt(f"p{i}", f"prompt {i}", "")


def job_spec(config: SimConfig, mode: str, gpus: int) -> JobSpec:
    data = json.loads(json.dumps(config.job))
    data["mode"] = mode
    # The fields a mode fixes (MODE_PRESETS) are the mode's: the config's reflow
    # settings (σ, τ, ...) do not carry over to a baseline.
    for section, name in MODE_PRESETS[mode]:
        data.get(section, {}).pop(name, None)
    data.setdefault("model", {"path": "simulated"})
    if config.samples_per_gpu is not None:
        group = data.get("rollout", {}).get("group_size", 8)
        batch = max(group, config.samples_per_gpu * gpus // group * group)
        data.setdefault("trainer", {})["batch_size"] = batch
    data.setdefault("trainer", {})["num_steps"] = config.steps
    return parse_job_spec(data)


def split(config: SimConfig, spec: JobSpec, gpus: int) -> tuple[int, int]:
    """(rollout engines, trainer GPUs) for `gpus`."""
    per_engine = config.costs.gpus_per_engine
    if spec.colocated:
        return max(1, gpus // per_engine), gpus
    rollout_gpus = max(per_engine, round(gpus * config.rollout_fraction) // per_engine * per_engine)
    if rollout_gpus >= gpus:
        raise ValueError(f"rollout_fraction {config.rollout_fraction} leaves no trainer GPU "
                         f"of {gpus}")
    return rollout_gpus // per_engine, gpus - rollout_gpus


class Simulation:
    def __init__(self, config: SimConfig, mode: str, gpus: int, redis_client, out: Path,
                 report: bool = True) -> None:
        """`report`: also draw OUT/report.png (reflow.report.plot, a real run's)."""
        self.config, self.mode, self.gpus, self.out = config, mode, gpus, out
        self.report = report
        self.spec = spec = job_spec(config, mode, gpus)
        self.costs = config.costs
        # What a sync and a flip move: the weights, or with spec.lora the adapters.
        self.transfers = transfers(self.costs, spec)
        self.clock = VirtualClock(epoch=0.0)
        redis_client.flushdb()
        self.replay = InprocReplayClient(ReplayStore(redis_client, seed=config.seed))
        self.replay.configure(JOB_ID, spec.replay)
        engines, self.trainer_gpus = split(config, spec, gpus)
        per_engine = self.costs.gpus_per_engine
        # Reflow's elastic pool: unit 0 holds the trainer's leader, every other unit
        # an engine and a trainer replica (the trainer's engines out of routing);
        # Algorithm 1 moves them (paper §5-6.2).
        units = gpus // per_engine
        planner = (planner_for(spec, units)
                   if spec.mode == "reflow" and not spec.colocated else None)
        names = [f"rollout-{i}" for i in range(engines)]
        if planner is not None:
            self.spec = spec = spec.model_copy(update={"cluster": ClusterConfig(
                workers=units, trainer_workers=units - engines)})
            names = ["trainer-0", *(f"rollout-{i}" for i in range(1, units))]
        # The simulation's draws (lengths, rewards), seeded: one seed, one result.
        rng = random.Random(config.seed)  # nosec B311 # a simulation's draws, not security
        self.sample_tokens: dict[str, tuple[int, int]] = {}
        self.step = 0
        self.engines = {name: SimEngine(name, JOB_ID, self.costs, self.replay,
                                        random.Random(rng.random()),  # nosec B311
                                        spec.rollout.group_size, lambda: self.step,
                                        self.sample_tokens, self.clock,
                                        GroupScoring(spec.algorithm))
                        for name in names if not name.startswith("trainer")}
        group_ids = itertools.count(1)
        out.mkdir(parents=True, exist_ok=True)
        events = out / "scheduler_events.jsonl"
        events.unlink(missing_ok=True)
        self.dispatcher = Dispatcher(JOB_ID, spec, self.replay, self.engines, SimTask(),
                                     clock=self.clock,
                                     # Only the elastic pool has engines that start in
                                     # the trainer's role; without it every engine serves.
                                     standby=[n for i, n in enumerate(names)
                                              if planner is not None and n in self.engines
                                              and spec.cluster.initial_role(i) == "trainer"],
                                     events_path=events if planner is not None else None,
                                     new_group_id=lambda: f"g{next(group_ids):08d}")
        self.initial_rollout_engines = engines
        self.pool = self.feed = self.leader = None
        self.flip_events: list[dict] = []
        if planner is not None:
            self.leader = SimLeader(JOB_ID, [n for i, n in enumerate(names)
                                             if i and spec.cluster.initial_role(i) == "trainer"])
            self.pool = ElasticPool(JOB_ID, spec, names, self.leader, self.dispatcher,
                                    lambda name: SimWorkerClient(self.engines[name], self.clock),
                                    record=self._flip_event, names=names, clock=self.clock)
            self.pool.start_roles(thread=False)
            self.feed = PlacementFeed(planner, self.dispatcher, self.pool)
        self.version = 0
        self.records: list[dict] = []
        # When each sample of the current step ended (virtual seconds): the step's tail.
        self._sample_ends: list[float] = []

    def _flip_event(self, event: dict) -> None:
        self.flip_events.append({"time_s": round(self.clock.now, 3), **event})
        self.dispatcher.record(event)

    def _take_events(self, engine: SimEngine) -> tuple[bool, bool]:
        """The engine's events to the dispatcher: (any, a group among them ended)."""
        events = engine.take_events()
        if not events:
            return False, False
        self._sample_ends += [self.clock.now for ev in events
                              if ev.sample_index >= 0 and not ev.error]
        self.dispatcher.apply_events(events)
        return True, any(e.sample_index < 0 for e in events)

    # --- the event loop ---------------------------------------------------------------

    def run(self) -> dict:
        started = time.monotonic()
        spec, clock = self.spec, self.clock
        per_engine = self.costs.gpus_per_engine
        interval = spec.scheduler.control_interval_s
        next_control = interval
        next_dispatch = 0.0
        state, state_until = "idle", 0.0  # idle | training | draining | syncing
        step_start = wait_s = sync_wait_s = sync_s = train_s = 0.0
        previous_end = 0.0
        lease = None
        before = self._rollout_totals()
        dirty = True
        # Whether a lease could now succeed where the last failed: a group was put, a
        # batch released or a version published (a lease is the buffer's Lua script,
        # so it is tried again only then, not at every event).
        fresh_data = fresh_budget = True
        regroup: tuple[list[str], float] = ([], 0.0)  # the membership being applied
        while len(self.records) < spec.trainer.num_steps:
            now = clock.now
            if self.pool is not None and self.pool.step():
                # A flip began or ended: routing changes, and an engine that handed
                # its groups back has events to deliver.
                dirty = True
                for e in self.engines.values():
                    _, put = self._take_events(e)
                    fresh_data |= put
                    fresh_budget |= put
                if self.pool.error:
                    raise RuntimeError(f"{self.mode} at {self.gpus} GPUs: {self.pool.error}")
            if dirty and self.dispatcher.budget_refused and not fresh_budget:
                # Refused, and neither a release, an eviction nor a version since:
                # the buffer would refuse again (the freed slots wait for budget).
                dirty = False
            if dirty and now >= next_dispatch:
                # At most one round a budget poll (what a round trip to the buffer
                # takes anyway): the sample ends within it are routed for together.
                self.dispatcher.dispatch_round()
                dirty, fresh_budget, next_dispatch = False, False, now + BUDGET_POLL_S
            if now >= next_control:
                caps = {n: w.cap for n, w in self.dispatcher.loads.items()}
                self.dispatcher.control_round()
                dirty |= caps != {n: w.cap for n, w in self.dispatcher.loads.items()}
                next_control = now + interval
            if state == "idle" and fresh_data:
                # A lease evicts what δ has made stale, which refunds budget.
                fresh_data, fresh_budget = False, True
                batch = self.replay.sample(JOB_ID, spec.trainer.batch_size,
                                           spec.replay.lease_ttl_s, timeout_s=0.0)
                if batch is not None:
                    lease, wait_s = batch, now - step_start
                    tokens = sum(self.sample_tokens[t.sample_id][1] for t in batch.trajectories)
                    gpus = self.trainer_gpus
                    train_s = self.costs.train.step_s(tokens, gpus)
                    if spec.colocated:
                        train_s += 2 * self.costs.sync.colocate_switch_s
                    state, state_until = "training", now + train_s
                    continue
            elif state == "training" and now >= state_until:
                self.replay.release(JOB_ID, lease.lease_id)
                self.step += 1
                if self.leader is not None:
                    self.leader.step = self.step
                dirty = fresh_data = fresh_budget = True
                sync_wait_s = sync_s = 0.0
                if self.step % spec.trainer.sync_interval == 0:
                    # Without partial rollout the engines admit nothing more and
                    # finish what runs under the old weights first.
                    for e in self.engines.values():
                        e.advance_to(now)
                        e.drain(not spec.rollout.partial_rollout)
                    state, state_until, sync_started = "draining", now, now
                else:
                    state = "step_end"
                continue
            elif state == "draining":
                if spec.rollout.partial_rollout or not any(e.running
                                                           for e in self.engines.values()):
                    sync_wait_s = now - sync_started
                    state, state_until = "syncing", now + self.transfers.sync_s
                    for e in self.engines.values():
                        e.load_weights(self.version + 1, now, state_until)
                    continue
            elif state == "syncing" and now >= state_until:
                self.version += 1
                self.replay.publish_version(JOB_ID, self.version)
                sync_s = now - sync_started
                state, dirty = "step_end", True
                fresh_data = fresh_budget = True
                # Roles move at sync boundaries (paper §5): the leader applies the
                # membership the pool asked for, the trainer pausing for it.
                peers = self.leader.take_pending() if self.leader is not None else None
                if peers is not None:
                    grew = len(peers) > len(self.leader.peers)
                    pause = self.transfers.flip_pause_s(
                        grew, self.trainer_gpus, (1 + len(peers)) * per_engine)
                    state, state_until, regroup = "regrouping", now + pause, (peers, pause)
                continue
            elif state == "regrouping" and now >= state_until:
                self.leader.applied(*regroup)
                self.trainer_gpus = (1 + len(regroup[0])) * per_engine
                state, dirty = "step_end", True
                continue
            elif state == "step_end":
                after = self._rollout_totals()
                self._record(lease, now - previous_end, wait_s, train_s, sync_s, sync_wait_s,
                             before, after)
                if self.feed is not None:
                    self.feed.observe(self.records[-1:])
                before, previous_end = after, now
                step_start, state = now, "idle"
                continue
            # Nothing to do now: on to the next event.
            nxt = min([next_control, *(e.next_time() for e in self.engines.values()),
                       state_until if state in ("training", "syncing", "regrouping")
                       else math.inf,
                       next_dispatch if dirty else math.inf])
            if nxt == math.inf:
                raise RuntimeError(f"{self.mode} at {self.gpus} GPUs stalled at step {self.step}: "
                                   "no engine runs and the trainer has no batch")
            clock.advance_to(max(nxt, now))
            for e in self.engines.values():
                if e.next_time() <= clock.now:
                    e.advance_to(clock.now)
                    any_events, put = self._take_events(e)
                    dirty |= any_events
                    # A put may evict stale samples, which refunds budget.
                    fresh_data |= put
                    fresh_budget |= put
        return self._summary(time.monotonic() - started)

    # --- records ----------------------------------------------------------------------

    def _rollout_totals(self) -> dict[str, tuple[float, float, int, int, float, int, int]]:
        now = self.clock.now
        for e in self.engines.values():
            e.advance_to(now)
        return {n: (e.idle_s, e.occupancy_s, e.generated_tokens, e.finished_samples, e.busy_s,
                    e.decode_steps, e.filtered_groups)
                for n, e in self.engines.items()}

    def _rollout_names(self) -> list[str]:
        """The units on rollout: with an elastic pool, the workers in the rollout
        role and out of the trainer's group (a unit flipping back to rollout leaves
        the group at the sync boundary; one flipping to the trainer is in neither
        from the end of its drain to the boundary)."""
        if self.pool is None:
            return list(self.engines)
        return [n for n in self.pool.by_role()["rollout"] if n not in self.leader.peers]

    def _record(self, batch, step_s, wait_s, train_s, sync_s, sync_wait_s, before, after) -> None:
        trajs = batch.trajectories
        staleness = [batch.policy_version - t.oldest_version for t in trajs]
        replayed = sum(1 for t in trajs if t.uses > 0)
        fresh = sum(1 for t, s in zip(trajs, staleness) if t.uses == 0 and s == 0)
        trained = sum(self.sample_tokens[t.sample_id][1] for t in trajs)
        # Of those, the tokens of samples trained for the first time (trainer/records.py).
        first_use = sum(self.sample_tokens[t.sample_id][1] for t in trajs if t.uses == 0)
        # Over the engines on rollout at the step's end (a unit that flipped during
        # the step counts on the side it ended on).
        names = self._rollout_names()
        n = len(names)
        delta = [sum(after[k][i] - before[k][i] for k in names) for i in range(7)]
        histogram: dict[str, int] = {}
        for s in staleness:
            histogram[str(s)] = histogram.get(str(s), 0) + 1
        record = {
            "step": self.step, "policy_version": self.version, "time_s": round(self.clock.now, 3),
            # A real run's fields (trainer/records.py), so reflow.report reads both: the
            # clock here is the simulation's.
            "wall_time_s": self.clock.now,
            "reward_mean": sum(t.reward for t in trajs) / len(trajs),
            "max_staleness": max(staleness),
            "trained_tokens": trained, "step_time_s": step_s,
            "trainer_tokens_per_s": trained / step_s if step_s > 0 else 0.0,
            "first_use_tokens": first_use,
            "first_use_tokens_per_s": first_use / step_s if step_s > 0 else 0.0,
            "trainer_idle_ratio": min(1.0, (wait_s + sync_wait_s) / step_s) if step_s else 0.0,
            "rollout_idle_ratio": min(1.0, delta[0] / (step_s * n)) if step_s else 0.0,
            "rollout_utilisation": min(1.0, delta[1] / (step_s * n)) if step_s else 0.0,
            "rollout_busy_ratio": min(1.0, delta[4] / (step_s * n)) if step_s else 0.0,
            **engine_step_fields(delta[4], delta[5], delta[2]),
            "generated_tokens": delta[2], "generated_samples": delta[3],
            "filtered_groups": delta[6],
            "fresh_samples": fresh, "stale_samples": len(trajs) - fresh - replayed,
            "replay_samples": replayed, "staleness_histogram": histogram,
            "wait_s": wait_s, "train_s": train_s, "sync_s": sync_s, "sync_wait_s": sync_wait_s,
            "weight_sync_s": self.transfers.sync_s if sync_s else 0.0,
            **self._tail_share(self.clock.now - step_s),
            "rollout_workers": n, "trainer_gpus": self.trainer_gpus,
            "trainer_workers": self.trainer_gpus // self.costs.gpus_per_engine,
        }
        self.records.append(record)

    def _tail_share(self, step_start: float) -> dict:
        """`rollout_tail_share`: of the time from the step's start to its last sample's
        end, the share after 90 % of its samples had ended. In sync, how long the
        stragglers hold the batch (Seer: the last 10 % of requests up to half of
        rollout time). Only the simulator records sample ends on one clock."""
        ends, self._sample_ends = sorted(self._sample_ends), []
        if len(ends) < 10 or ends[-1] <= step_start:
            return {}
        p90 = ends[math.ceil(0.9 * len(ends)) - 1]
        return {"rollout_tail_share": (ends[-1] - p90) / (ends[-1] - step_start)}

    def _summary(self, wall_s: float) -> dict:
        with (self.out / "metrics.jsonl").open("w") as f:
            for r in self.records:
                f.write(json.dumps(r) + "\n")
        measured = self.records[self.config.warmup_steps:]
        span = sum(r["step_time_s"] for r in measured)
        trained = sum(r["trained_tokens"] for r in measured)

        def mean(key: str) -> float:
            return sum(r[key] * r["step_time_s"] for r in measured) / span if span else 0.0

        snapshot = self.dispatcher.snapshot()
        summary = {
            "mode": self.mode, "gpus": self.gpus,
            "rollout_engines": self.initial_rollout_engines,
            "trainer_gpus": self.trainer_gpus, "steps": self.step, "phase": "SUCCEEDED",
            "weight_sync_bytes": self.transfers.sync_bytes,
            "simulated_s": round(self.clock.now, 3), "wall_s": round(wall_s, 3),
            "throughput_tokens_per_s": trained / span if span else 0.0,
            # Trained tokens less replay's repeats: the rate new rollouts are trained.
            "first_use_tokens_per_s": sum(r["first_use_tokens"] for r in measured) / span
            if span else 0.0,
            "trainer_idle_ratio": mean("trainer_idle_ratio"),
            "rollout_idle_ratio": mean("rollout_idle_ratio"),
            "rollout_tail_share": statistics.median(
                [r["rollout_tail_share"] for r in measured if "rollout_tail_share" in r] or [0.0]),
            "replay_fraction": sum(r["replay_samples"] for r in measured)
            / max(1, sum(r["replay_samples"] + r["fresh_samples"] + r["stale_samples"]
                         for r in measured)),
            "mean_staleness": sum(int(k) * v for r in measured
                                  for k, v in r["staleness_histogram"].items())
            / max(1, sum(v for r in measured for v in r["staleness_histogram"].values())),
            "preempted_requests": sum(e.preemptions for e in self.engines.values()),
            "cap_changes": snapshot["cap_changes"],
            "role_flips": sum(1 for e in self.flip_events if e["event"] == "role_flip"),
            "rollout_engines_final": len(self._rollout_names()),
            "rollout_engines_mean": mean("rollout_workers"),
            "admission_rejections": snapshot["admission_rejections"],
        }
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if self.report:
            plot(self.records, self.out / "report.png",
                 title=f"{self.mode}, {self.gpus} simulated GPUs (simulated time)")
        return summary
