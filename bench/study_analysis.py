"""A pre-registered study's tables, from its committed runs alone (bench/evidence.py):
what its `study.yaml` fixed (entries, seeds, the primary metric, the points it is
read at, the comparisons, the level and the correction) applied to the per-run
files under `bench/data/<study>/`.

The statistics are the one convention of every learning table: the paired
t-interval over seeds (bench/convergence_stats.paired_t), each interval widened
for the number of intervals the primary table reads (Bonferroni), and a verdict
per comparison by the rule the study names: ahead or behind where the corrected
interval excludes 0, else not distinguishable.

What it deliberately doesn't know: how runs are started or scored (bench/study.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import convergence_stats as cs
import evidence

POINTS = ("wall_time_s", "first_use_samples")
POINT_LABEL = {"wall_time_s": "equal training wall time", "first_use_samples": "equal first-use samples"}


@dataclass
class Primary:
    metric: str = "eval_pass_at_1"
    points: dict[str, float] = field(default_factory=dict)  # point kind -> value
    num_prompts: int = 100
    snapshot_interval: int = 2
    level: float = 0.95
    correction: str = "bonferroni"


@dataclass
class Gate:
    entries: list[str] = field(default_factory=list)
    min_replay_fraction: float = 0.0
    steady_from_step: int = 1


@dataclass
class Study:
    name: str
    config: str
    entries: dict[str, list[str]]  # in run order
    seeds: list[int]
    reference: str
    comparisons: list[str]  # entries compared with the reference, reference − entry
    primary: Primary
    gate: Gate
    overrides: list[str] = field(default_factory=list)
    steady_from_step: int = 1

    @classmethod
    def from_yaml(cls, name: str, data: dict) -> Study:
        from convergence import parse_seeds  # the one seed syntax of the benchmarks

        entries = {str(k): [str(o) for o in (v or [])] for k, v in (data.get("entries") or {}).items()}
        primary = Primary(**(data.get("primary") or {}))
        gate = Gate(**(data.get("gate") or {}))
        study = cls(name=name, config=str(data.get("config", "")), entries=entries,
                    seeds=parse_seeds(data.get("seeds", "0")),
                    reference=str(data.get("reference", "")),
                    comparisons=[str(c) for c in data.get("comparisons") or []],
                    primary=primary, gate=gate,
                    overrides=[str(o) for o in data.get("overrides") or []],
                    steady_from_step=int(data.get("steady_from_step", gate.steady_from_step)))
        study.validate()
        return study

    def validate(self) -> None:
        if not self.config or not self.entries:
            raise ValueError(f"study {self.name}: config and entries are required")
        named = {self.reference, *self.comparisons, *self.gate.entries}
        if named - set(self.entries):
            raise ValueError(f"study {self.name}: {sorted(named - set(self.entries))} are not "
                             "entries")
        if not self.primary.points or set(self.primary.points) - set(POINTS):
            raise ValueError(f"study {self.name}: primary.points must name some of {POINTS}")
        if any(o.startswith("seed=") for e in self.entries.values() for o in [*e, *self.overrides]):
            raise ValueError(f"study {self.name}: the seed is the study's, not an override")

    @property
    def num_intervals(self) -> int:
        """The intervals the primary table reads: every comparison at every point."""
        return max(1, len(self.comparisons) * len(self.primary.points))


# --- per run ------------------------------------------------------------------


def training_wall(records: list[dict]) -> np.ndarray:
    """Each step's wall time from the trainer's start, less the policy snapshots
    written before it (they are the benchmark's, not training's)."""
    wall = np.array([float(r.get("wall_time_s", 0.0)) for r in records])
    snap = np.array([float(r.get("policy_snapshot_s", 0.0)) for r in records])
    return wall - np.concatenate([[0.0], np.cumsum(snap)[:-1]])


def first_use(records: list[dict]) -> np.ndarray:
    return np.cumsum([int(r.get("fresh_samples", 0)) + int(r.get("stale_samples", 0))
                      for r in records])


def point_position(records: list[dict], step: int) -> dict[str, float]:
    """Where the policy after `step` stands (step 0: the initial weights)."""
    if step == 0:
        return {"training_wall_s": 0.0, "first_use_samples": 0}
    return {"training_wall_s": round(float(training_wall(records)[step - 1]), 2),
            "first_use_samples": int(first_use(records)[step - 1])}


def snapshot_at(records: list[dict], point: str, value: float, interval: int) -> int:
    """The step whose policy a run holds at `point` = `value`: the last snapshot (every
    `interval` steps, the final policy at the last step, the initial weights at 0)
    at or before it. A run that ends before the point is read at its final policy."""
    n = len(records)
    position = training_wall(records) if point == "wall_time_s" else first_use(records)
    candidates = sorted({0, n, *range(interval, n, interval)})
    best = 0
    for step in candidates:
        if step == 0 or position[step - 1] <= value + 1e-9:
            best = step
    return best


def steady_replay(records: list[dict], from_step: int) -> float:
    values = [float(r.get("replay_fraction", 0.0)) for r in records if r.get("step", 0) >= from_step]
    return float(np.mean(values)) if values else 0.0


# --- the study ----------------------------------------------------------------


def load(study: Study, directory: Path) -> dict[str, dict[int, dict]]:
    """entry -> seed -> committed run (only the runs that exist)."""
    runs: dict[str, dict[int, dict]] = {}
    for entry in study.entries:
        for seed in study.seeds:
            path = evidence.run_path(directory, entry, seed)
            if path.exists():
                runs.setdefault(entry, {})[seed] = evidence.read_run(path)
    return runs


def _fmt(value: float, fmt: str = ".3f") -> str:
    return "–" if value is None or not np.isfinite(value) else f"{value:{fmt}}".replace("-", "−")


def _interval(stat: dict, fmt: str = ".3f", sign: bool = False) -> str:
    f = ("+" if sign else "") + fmt
    if not np.isfinite(stat["low"]):
        return _fmt(stat["estimate"], f)
    return f"{_fmt(stat['estimate'], f)} [{_fmt(stat['low'], f)}, {_fmt(stat['high'], f)}]"


def _mean_interval(values: list[float]) -> dict:
    mean, lo, hi = cs.t_interval(np.array(values, dtype=float))
    return {"estimate": float(mean), "low": float(lo), "high": float(hi)}


def heldout(run: dict, point: str, metric: str) -> float:
    return float(run["heldout"][point][metric])


def verdict(stat: dict) -> str:
    if not np.isfinite(stat["low"]):
        return "too few seeds"
    if stat["low"] > 0:
        return "reference ahead"
    if stat["high"] < 0:
        return "reference behind"
    return "not distinguishable"


def primary_table(study: Study, runs: dict) -> str:
    p = study.primary
    level = cs.corrected_level(study.num_intervals, p.level)
    ref = runs.get(study.reference, {})
    head = ["entry", "seeds"]
    for point in p.points:
        head += [f"{p.metric} at {POINT_LABEL[point]}",
                 f"{study.reference} − entry (paired t, {level:.2%})"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    verdicts = []
    for entry in study.entries:
        seeds = sorted(runs.get(entry, {}))
        cells = [entry, str(len(seeds))]
        for point in p.points:
            values = [heldout(runs[entry][s], point, p.metric) for s in seeds]
            cells.append(_interval(_mean_interval(values)) if values else "–")
            paired = sorted(set(seeds) & set(ref))
            if entry in study.comparisons and len(paired) >= 1:
                stat = cs.paired_t([heldout(ref[s], point, p.metric) for s in paired],
                                   [heldout(runs[entry][s], point, p.metric) for s in paired],
                                   level)
                cells.append(_interval(stat, sign=True))
                verdicts.append(f"{study.reference} against {entry} at {POINT_LABEL[point]}: "
                                f"{verdict(stat)} ({len(paired)} paired seeds)")
            else:
                cells.append("–")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\n" + "\n".join(f"- {v}" for v in verdicts)


def _per_run(values: list[float], fmt: str) -> str:
    return _interval(_mean_interval(values), fmt) if values else "–"


def secondary_table(study: Study, runs: dict) -> str:
    head = ["entry", "steady replay fraction", "first-use reward, steady steps",
            "steps run", "first-use samples", "evicted unused", "trainer idle",
            "step time (s), median", "training wall (s)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    start = study.steady_from_step
    for entry in study.entries:
        rs = [runs[entry][s] for s in sorted(runs.get(entry, {}))]
        recs = [r["records"] for r in rs]
        steady = lambda rec: [x for x in rec if x.get("step", 0) >= start]  # noqa: E731
        cells = [entry,
                 _per_run([steady_replay(rec, start) for rec in recs], ".3f"),
                 _per_run([float(np.mean([x["first_use_reward_mean"] for x in steady(rec)
                                          if "first_use_reward_mean" in x] or [np.nan]))
                           for rec in recs], ".3f"),
                 _per_run([float(len(rec)) for rec in recs], ".1f"),
                 _per_run([float(first_use(rec)[-1]) for rec in recs], ".0f"),
                 _per_run([float(rec[-1].get("evicted_unused_samples_total", 0)) for rec in recs],
                          ".1f"),
                 _per_run([float(np.mean([x.get("trainer_idle_ratio", 0.0) for x in steady(rec)]))
                           for rec in recs], ".2f"),
                 _per_run([float(np.median([x.get("step_time_s", 0.0) for x in steady(rec)]))
                           for rec in recs], ".1f"),
                 _per_run([float(training_wall(rec)[-1]) for rec in recs], ".0f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


SLICES = ("fresh", "stale", "replayed")


def offpolicy_table(study: Study, runs: dict) -> str:
    head = ["entry"] + [f"{s} {m}" for s in SLICES for m in ("clip", "mismatch KL", "ESS")]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for entry in study.entries:
        recs = [runs[entry][s]["records"] for s in sorted(runs.get(entry, {}))]
        cells = [entry]
        for sl in SLICES:
            for metric, fmt in (("clip_fraction", ".3f"), ("mismatch_kl", ".4f"),
                                ("importance_ess", ".3f")):
                name = f"{sl}_{metric}"
                per_run = [float(np.mean(v)) for v in
                           ([x[name] for x in rec if name in x] for rec in recs) if v]
                cells.append(_fmt(float(np.mean(per_run)), fmt) if per_run else "–")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def tables(study: Study, directory: Path) -> dict[str, str]:
    """The study's tables by name, as markdown: what `<!-- table STUDY/NAME -->`
    blocks in the docs hold."""
    runs = load(study, directory)
    done = sum(len(v) for v in runs.values())
    total = len(study.entries) * len(study.seeds)
    status = f"{done} of {total} runs committed ({len(study.seeds)} seeds x {len(study.entries)} entries)"
    tripped = [f"{entry} seed {seed} ({run['steady_replay_fraction']:.3f})"
               for entry in study.gate.entries for seed, run in sorted(runs.get(entry, {}).items())
               if run.get("steady_replay_fraction", 1.0) < study.gate.min_replay_fraction]
    if tripped:
        status += (f"; stopped by its replay gate: {', '.join(tripped)} replayed less than "
                   f"{study.gate.min_replay_fraction} of its trained samples from step "
                   f"{study.gate.steady_from_step} on")
    return {"status": status,
            "primary": primary_table(study, runs),
            "secondary": secondary_table(study, runs),
            "offpolicy": offpolicy_table(study, runs)}
