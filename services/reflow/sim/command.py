"""`reflow sim CONFIG [--gpus 8,32,128] [--modes ...] [--seeds 0,1,2] --out DIR [job overrides]`:
each mode at each GPU count, one embedded Redis for all of them (flushed between runs).
Writes DIR/<gpus>gpus/<mode>/{metrics.jsonl,summary.json} and DIR/results.json,
and prints the modes table (throughput against sync, idle ratios).

With several seeds (each a draw of response lengths and rewards) every seed's
runs go under DIR/seed<k>/ and its results into results.json's `seeds`; the
table and results.json's `spread` give median [min-max] over the seeds, each
ratio taken within a seed."""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

import yaml

from reflow.core.config import apply_overrides
from reflow.sim.costs import SimConfig

MODES = ("sync", "one_step_off", "fully_async", "reflow")


def load_config(path: Path, overrides: list[str] | None = None) -> SimConfig:
    """The config at `path` with `overrides`: `section.field=value` sets the job's
    field (an ablation: `replay.replay_cap=0`); a key that starts with one of the
    sim config's own fields sets that (`samples_per_gpu=256`,
    `costs.train.utilisation=0.2`). Validated once, after every override."""
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ValueError(f"{path}: not YAML a sim config can be read from: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a sim config is a mapping (job, costs, ...)")
    own, job = [], []
    for item in overrides or []:
        # The sim config's own fields by their first part; the rest (and what is
        # malformed, which apply_overrides names) go to the job.
        head = item.partition("=")[0].split(".")[0]
        (own if head in SimConfig.model_fields and head != "job" else job).append(item)
    apply_overrides(data, own)
    if job:
        data["job"] = apply_overrides(data.get("job") or {}, job)
    return SimConfig.model_validate(data)


def simulate(config: SimConfig, gpus: list[int], modes: list[str], out: Path) -> dict:
    import redis

    from reflow.replay.embedded import EmbeddedRedis
    from reflow.sim.run import Simulation

    results: dict[str, dict[str, dict]] = {}
    with tempfile.TemporaryDirectory(prefix="reflow-sim-") as data_dir:
        server = EmbeddedRedis(data_dir, appendonly=False).start()
        try:
            client = redis.Redis.from_url(server.url)
            for n in gpus:
                for mode in modes:
                    sim = Simulation(config, mode, n, client, out / f"{n}gpus" / mode)
                    results.setdefault(str(n), {})[mode] = sim.run()
            client.close()
        finally:
            server.stop()
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    return results


# What the spread over seeds is given for, per mode (`vs_sync` is taken within a seed).
SPREAD_FIELDS = ("throughput_tokens_per_s", "first_use_tokens_per_s", "vs_sync",
                 "trainer_idle_ratio", "rollout_idle_ratio", "mean_staleness", "replay_fraction")


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}


def spread(by_seed: dict[str, dict]) -> dict:
    """Median, min and max over seeds of each mode's SPREAD_FIELDS."""
    out: dict[str, dict[str, dict]] = {}
    first = next(iter(by_seed.values()))
    for n, by_mode in first.items():
        for mode in by_mode:
            fields = {}
            for field in SPREAD_FIELDS:
                values = []
                for results in by_seed.values():
                    summary = results[n][mode]
                    if field == "vs_sync":
                        base = results[n].get("sync", {}).get("throughput_tokens_per_s")
                        if not base:
                            continue
                        values.append(summary["throughput_tokens_per_s"] / base)
                    elif field in summary:  # results.json of an older run may lack one
                        values.append(summary[field])
                if values:
                    fields[field] = _spread(values)
            out.setdefault(n, {})[mode] = fields
    return out


def spread_table(spreads: dict) -> str:
    def cell(s: dict | None, fmt: str) -> str:
        if s is None:
            return "-"
        return f"{s['median']:{fmt}} [{s['min']:{fmt}}-{s['max']:{fmt}}]"

    lines = [f"{'gpus':>5} {'mode':<13} {'tokens/s':>22} {'first-use tokens/s':>22} "
             f"{'vs sync':>17} {'trainer idle':>20} {'rollout idle':>20}"]
    for n, by_mode in spreads.items():
        for mode, f in by_mode.items():
            lines.append(f"{n:>5} {mode:<13} {cell(f.get('throughput_tokens_per_s'), '.0f'):>22} "
                         f"{cell(f.get('first_use_tokens_per_s'), '.0f'):>22} "
                         f"{cell(f.get('vs_sync'), '.2f'):>17} "
                         f"{cell(f.get('trainer_idle_ratio'), '.3f'):>20} "
                         f"{cell(f.get('rollout_idle_ratio'), '.3f'):>20}")
    return "\n".join(lines)


def simulate_seeds(config: SimConfig, gpus: list[int], modes: list[str], seeds: list[int],
                   out: Path) -> dict:
    """`simulate` once per seed, under out/seed<k>; writes out/results.json with every
    seed's results and their spread."""
    by_seed = {str(seed): simulate(config.model_copy(update={"seed": seed}), gpus, modes,
                                   out / f"seed{seed}")
               for seed in seeds}
    results = {"seeds": by_seed, "spread": spread(by_seed)}
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    return results


def table(results: dict) -> str:
    # tokens/s counts replayed samples' tokens again; first-use tokens/s only the
    # samples trained for the first time.
    lines = [f"{'gpus':>5} {'mode':<13} {'tokens/s':>10} {'first-use/s':>12} {'vs sync':>8} "
             f"{'trainer idle':>13} {'rollout idle':>13} {'staleness':>10} {'replay':>7} "
             f"{'wall s':>7}"]
    for n, by_mode in results.items():
        base = by_mode.get("sync", {}).get("throughput_tokens_per_s")
        for mode, s in by_mode.items():
            ratio = f"{s['throughput_tokens_per_s'] / base:.2f}" if base else "-"
            first = s.get("first_use_tokens_per_s")
            first_cell = f"{first:.0f}" if first is not None else "-"
            lines.append(f"{n:>5} {mode:<13} {s['throughput_tokens_per_s']:>10.0f} "
                         f"{first_cell:>12} {ratio:>8} "
                         f"{s['trainer_idle_ratio']:>13.3f} {s['rollout_idle_ratio']:>13.3f} "
                         f"{s['mean_staleness']:>10.2f} {s['replay_fraction']:>7.2f} "
                         f"{s['wall_s']:>7.1f}")
    return "\n".join(lines)


def with_tool_latency(config: SimConfig, bench_path: str, callers: int) -> SimConfig:
    """`config` with costs.tools' latency from a sandbox benchmark's JSON
    (reflow.sim.calibrate.tool_cost); SystemExit naming the flag otherwise."""
    from reflow.sim.calibrate import tool_cost

    try:
        bench = json.loads(Path(bench_path).read_text())
        tools = tool_cost(bench, config.costs.tools, callers=callers)
    except (OSError, ValueError) as err:
        raise SystemExit(f"--tool-latency-from: {err}") from None
    print(f"tool latency from {bench_path} ({callers} callers): median "
          f"{tools.latency_median_s * 1000:.1f} ms, sigma {tools.latency_sigma:.2f}")
    return config.model_copy(update={"costs": config.costs.model_copy(update={"tools": tools})})


def main(args) -> int:
    config = load_config(Path(args.config), getattr(args, "overrides", None))
    if getattr(args, "tool_latency_from", None):
        config = with_tool_latency(config, args.tool_latency_from, args.tool_callers)
    gpus = [int(g) for g in args.gpus.split(",") if g]
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise SystemExit(f"--modes: {', '.join(unknown) or 'none given'}; choose from "
                         f"{', '.join(MODES)}")
    if not gpus or min(gpus) < 2:
        raise SystemExit("--gpus: a comma-separated list of GPU counts, each at least 2")
    try:
        seeds = [int(s) for s in (getattr(args, "seeds", None) or "").split(",") if s]
    except ValueError:
        raise SystemExit(f"--seeds: a comma-separated list of integers, not {args.seeds!r}")
    if len(set(seeds)) != len(seeds):
        raise SystemExit(f"--seeds: {args.seeds!r} repeats a seed")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if len(seeds) > 1:
        results = simulate_seeds(config, gpus, modes, seeds, out)
        for seed, by_gpus in results["seeds"].items():
            print(f"seed {seed}\n{table(by_gpus)}")
        print(f"over seeds {','.join(map(str, seeds))}: median [min-max]\n"
              f"{spread_table(results['spread'])}")
        return 0
    if seeds:
        config = config.model_copy(update={"seed": seeds[0]})
    print(table(simulate(config, gpus, modes, out)))
    return 0
