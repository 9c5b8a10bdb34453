"""`reflow sim CONFIG [--gpus 8,32,128] [--modes ...] --out DIR [job overrides]`:
each mode at each GPU count, one embedded Redis for all of them (flushed between runs).
Writes DIR/<gpus>gpus/<mode>/{metrics.jsonl,summary.json} and DIR/results.json,
and prints the modes table (throughput against sync, idle ratios)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import yaml

from reflow.core.config import apply_overrides
from reflow.sim.costs import SimConfig

MODES = ("sync", "one_step_off", "fully_async", "reflow")


def load_config(path: Path) -> SimConfig:
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a sim config is a mapping (job, costs, ...)")
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


def table(results: dict) -> str:
    lines = [f"{'gpus':>5} {'mode':<13} {'tokens/s':>10} {'vs sync':>8} {'trainer idle':>13} "
             f"{'rollout idle':>13} {'staleness':>10} {'replay':>7} {'wall s':>7}"]
    for n, by_mode in results.items():
        base = by_mode.get("sync", {}).get("throughput_tokens_per_s")
        for mode, s in by_mode.items():
            ratio = f"{s['throughput_tokens_per_s'] / base:.2f}" if base else "-"
            lines.append(f"{n:>5} {mode:<13} {s['throughput_tokens_per_s']:>10.0f} {ratio:>8} "
                         f"{s['trainer_idle_ratio']:>13.3f} {s['rollout_idle_ratio']:>13.3f} "
                         f"{s['mean_staleness']:>10.2f} {s['replay_fraction']:>7.2f} "
                         f"{s['wall_s']:>7.1f}")
    return "\n".join(lines)


def main(args) -> int:
    config = load_config(Path(args.config))
    overrides = getattr(args, "overrides", None) or []
    if overrides:
        job = apply_overrides(json.loads(json.dumps(config.job)), overrides)
        config = config.model_copy(update={"job": job})
    gpus = [int(g) for g in args.gpus.split(",") if g]
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise SystemExit(f"--modes: {', '.join(unknown) or 'none given'}; choose from "
                         f"{', '.join(MODES)}")
    if not gpus or min(gpus) < 2:
        raise SystemExit("--gpus: a comma-separated list of GPU counts, each at least 2")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(table(simulate(config, gpus, modes, out)))
    return 0
