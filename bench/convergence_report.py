"""The learning tables: bench/convergence.py's printed tables and plot, and every
table the docs quote, rebuilt from committed data alone.

    python bench/convergence_report.py --check   # fails naming any table that differs
    python bench/convergence_report.py --write   # rewrites them from bench/data/

A table in bench/RESULTS.md or docs/ stands between `<!-- table STUDY/NAME -->` and
`<!-- /table -->`; its body is what bench/study_analysis.py makes of the committed
runs of bench/data/STUDY/ (their study.yaml fixes how), nothing typed by hand."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

# The x axes of the learning curves, by the step-record quantity they count.
AXES = {"trained_samples": "trained samples", "first_use_samples": "first-use samples",
        "first_use_tokens": "first-use tokens", "wall_time_s": "wall time (s)"}


def json_safe(value):
    """inf and NaN (a seed that never reached the target, an interval of one seed) as
    null: JSON has neither."""
    if isinstance(value, float):
        return value if np.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def _cell(stat: dict | None, fmt: str = ".3f", keys=("mean", "low", "high")) -> str:
    if not stat:
        return "–"
    mid, lo, hi = (stat[k] for k in keys)
    if not np.isfinite(lo):
        return f"{mid:{fmt}}" if np.isfinite(mid) else "not reached"
    bound = lambda v: f"{v:{fmt}}" if np.isfinite(v) else "∞"  # noqa: E731
    return f"{bound(mid)} [{bound(lo)}, {bound(hi)}]"


def print_table(plan, result: dict, missing: dict[str, list[int]]) -> None:
    boot = ("estimate", "t_low", "t_high")  # the paired t-interval: the one convention
    span = result["equal_first_use_range"]
    where = f"{span[0]:.0f}-{span[1]:.0f} first-use samples" if span else "no common range"
    print(f"\nReward at equal first-use samples ({where}); Δ: paired difference to "
          f"{plan.reference}, paired 95 % t-interval over seeds; others: mean [95 % t-interval] "
          f"over seeds; time to {plan.target_reward}: median [bootstrap 95 %].\n")
    print("| entry | seeds | run (s), mean [min, max] | reward, final window | Δ final | reward, mean over range "
          "| Δ mean | t to target (s) | reached | held-out, last version | Δ held-out last |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for entry in plan.entries:
        summary = result["entries"].get(entry.name)
        if summary is None:
            print(f"| {entry.name} | 0 | | | | | | | | | |")
            continue
        equal = summary.get("at_equal_first_use", {})
        diff = result["paired_vs_reference"].get(entry.name, {})
        held = summary["held_out"]
        held_last = ({"mean": held["mean"][-1], "low": held["low"][-1], "high": held["high"][-1]}
                     if held else None)
        ttt = summary["time_to_target_s"]
        elapsed = summary["run_elapsed_s"]
        print(f"| {entry.name} | {summary['num_seeds']} | {_cell(elapsed, '.0f', ('mean', 'min', 'max'))} "
              f"| {_cell(equal.get('final_reward'))} | {_cell(diff.get('final_reward'), '+.3f', boot)} "
              f"| {_cell(equal.get('auc_reward'))} | {_cell(diff.get('auc_reward'), '+.3f', boot)} "
              f"| {_cell(ttt, '.0f', ('estimate', 'low', 'high'))} | {ttt['reached']}/{summary['num_seeds']} "
              f"| {_cell(held_last)} | {_cell(diff.get('held_out_last'), '+.3f', boot)} |")
    print(f"\nPaired differences to {plan.reference}: the paired t-interval, and beside it, "
          "labelled, the percentile bootstrap (too narrow with few seeds)\n")
    print("| entry | Δ final, bootstrap | Δ final, t | Δ mean, bootstrap | Δ mean, t |")
    print("|---|---|---|---|---|")
    t_keys = boot
    boot = ("estimate", "low", "high")
    for entry in plan.entries:
        diff = result["paired_vs_reference"].get(entry.name, {})
        if not diff.get("final_reward") or "t_low" not in diff["final_reward"]:
            continue
        print(f"| {entry.name} | {_cell(diff['final_reward'], '+.3f', boot)} "
              f"| {_cell(diff['final_reward'], '+.3f', t_keys)} "
              f"| {_cell(diff['auc_reward'], '+.3f', boot)} "
              f"| {_cell(diff['auc_reward'], '+.3f', t_keys)} |")
    print("\nOff-policy figures per step, mean over seeds [min, max] (max_staleness: the "
          "largest over every step and seed)\n")
    print("| entry | replay | clip | mismatch KL | ESS | stale clip | stale KL | replayed clip "
          "| replayed KL | entropy | max lag |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    spread = ("mean", "min", "max")
    for entry in plan.entries:
        off = result["entries"].get(entry.name, {}).get("offpolicy", {})
        cells = [_cell(off.get(n), ".4f" if "kl" in n else ".3f", spread) for n in
                 ("replay_fraction", "clip_fraction", "mismatch_kl", "importance_ess",
                  "stale_clip_fraction", "stale_mismatch_kl", "replayed_clip_fraction",
                  "replayed_mismatch_kl", "entropy")]
        lag = off.get("max_staleness")
        print(f"| {entry.name} | " + " | ".join(cells) + f" | {lag['max']:.0f} |" if lag else
              f"| {entry.name} | " + " | ".join(cells) + " | – |")
    for name, seeds in missing.items():
        print(f"\n{name}: seeds {seeds} not finished (left out)")
    for name, summary in result["entries"].items():
        for axis in (a for a, c in summary["curves"].items() if c is None):
            print(f"\n{name}: no {AXES[axis]} range that every seed covers: no curve")


def plot(plan, result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = result["entries"]
    axes = [a for a in AXES if any(e["curves"].get(a) for e in entries.values())]
    panels = axes + (["held_out"] if any(e["held_out"] for e in entries.values()) else [])
    fig, grid = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4.2), squeeze=False)
    for ax, panel in zip(grid[0], panels):
        for i, (name, summary) in enumerate(entries.items()):
            band = summary["held_out"] if panel == "held_out" else summary["curves"].get(panel)
            if not band:
                continue
            x = band["versions"] if panel == "held_out" else band["grid"]
            color = f"C{i}"
            ax.plot(x, band["mean"], color=color, label=f"{name} ({summary['num_seeds']})",
                    marker="o" if panel == "held_out" else None)
            if summary["num_seeds"] > 1:
                ax.fill_between(x, band["low"], band["high"], color=color, alpha=0.2)
        ax.set_xlabel("policy version" if panel == "held_out" else AXES[panel])
        ax.set_ylabel("held-out reward" if panel == "held_out" else "reward (smoothed)")
        if panel == "wall_time_s":
            ax.axhline(plan.target_reward, color="grey", linestyle=":", linewidth=1)
        ax.grid(alpha=0.3)
    grid[0][0].legend(title="entry (seeds)")
    fig.suptitle("mean over seeds, shaded: 95 % t-interval")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --- the learning tables in the docs, rebuilt from committed data -------------------

TABLE = re.compile(r"(?P<open><!-- table (?P<key>[\w.-]+/[\w.-]+) -->\n)(?P<body>.*?)"
                   r"(?P<close><!-- /table -->)", re.S)
DATA = Path(__file__).resolve().parent / "data"


def pages(root: Path) -> list[Path]:
    """Where learning tables may stand: the measurement log and the docs."""
    return [root / "bench" / "RESULTS.md", *sorted((root / "docs").rglob("*.md"))]


def rendered_tables(data: Path = DATA) -> dict[str, str]:
    """Every committed study's tables, `study/name` -> markdown, from its files alone."""
    import study_analysis as sa
    import yaml

    out = {}
    for study_file in sorted(data.glob("*/study.yaml")):
        study = sa.Study.from_yaml(study_file.parent.name, yaml.safe_load(study_file.read_text()))
        for name, text in sa.tables(study, study_file.parent).items():
            out[f"{study.name}/{name}"] = text.strip()
    return out


def sync_tables(root: Path, write: bool, data: Path | None = None) -> list[str]:
    """Compare (or, with `write`, replace) every `<!-- table study/name -->` block with
    its table rebuilt from committed data; the problems, one line each."""
    tables = rendered_tables(data or root / "bench" / "data")
    problems = []
    for page in pages(root):
        text = page.read_text()
        new = text
        for m in reversed(list(TABLE.finditer(text))):
            key, body = m["key"], m["body"].strip()
            line = text.count("\n", 0, m.start()) + 1
            where = f"{page.relative_to(root)}:{line}"
            if key not in tables:
                problems.append(f"{where}: table {key}: no committed study makes it")
                continue
            if body != tables[key]:
                problems.append(f"{where}: table {key} differs from its committed data "
                                "(python bench/convergence_report.py --write rebuilds it)")
                # The close marker on a line of its own: a table's last row stays a row.
                new = new[:m.start("body")] + tables[key] + "\n" + new[m.end("body"):]
        if write and new != text:
            page.write_text(new)
    return problems


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Rebuild the learning tables in "
                                     "bench/RESULTS.md and docs/ from bench/data/ alone.")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true",
                      help="fail (exit 1) naming every table that differs from its data")
    mode.add_argument("--write", action="store_true", help="rewrite the tables from the data")
    args = parser.parse_args(argv)
    root = Path(__file__).resolve().parents[1]
    problems = sync_tables(root, write=args.write)
    for p in problems:
        print(p)
    if args.check and problems:
        return 1
    if args.write:
        print(f"{len(problems)} tables rewritten" if problems else "every table matches its data")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
