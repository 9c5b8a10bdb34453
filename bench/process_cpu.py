"""CPU used by each process of a run, read from the OS, grouped by role.

    python bench/process_cpu.py --out /tmp/cpu.json -- \
        .venv/bin/reflow run examples/quickstart.yaml --out /tmp/run trainer.num_steps=20
    python bench/process_cpu.py --out /tmp/cpu.json --pid PID   # a process tree already running

A sampling profiler (py-spy, bench/profile_summary.py) sees Python frames and misses
gRPC's C core, Redis and the kernel; the OS's per-process CPU time (user + system,
psutil) counts all of it. Every `--interval-s` the sampler walks the process tree under
the command it started (or under `--pid`) and records each process's CPU time; a
role's cores used is its CPU seconds over the window's wall seconds (1.0 = one core
busy the whole window).

Roles come from how `reflow run` starts its processes (reflow.launcher, the local
backend in reflow.scheduler.cluster.local): each service is `python -m reflow.cli serve
SERVICE`, the rollout service's vLLM engine core renames itself `VLLM::EngineCore` (and
a multiprocess executor's workers `VLLM::Worker_*`), and the embedded Redis is
`redis-server`. The rollout service's own process is the "rollout front end": our
asyncio loop, vLLM's output processing and gRPC.

The window: by default the whole sampled run. With a metrics file to follow
(`--metrics`, or the `--out DIR` of a `reflow run` command, DIR/metrics.jsonl), it runs
from the sample at which step `--from-step` was recorded to the one at which the last
step was: the steady state, without start-up and shutdown. A `reflow bench modes`
command runs one job after another, so it gets the whole run.

Not counted: CPU of a process that starts and ends between two samples, and the part
of the last interval of one that ends. The sampler's own CPU is reported apart.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess  # nosec B404 # runs the command given on our own command line
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

# In the order the table prints them.
ROLES = ("launcher", "api", "scheduler", "replay", "trainer", "rollout front end",
         "VLLM::EngineCore", "VLLM::Worker", "worker (AsyncHybrid)", "redis", "other")
_SERVE = re.compile(r"(?:reflow\.cli|reflow)\s+serve\s+(\w+)")
_SERVICE_ROLES = {"api": "api", "scheduler": "scheduler", "replay": "replay",
                  "trainer": "trainer", "rollout": "rollout front end",
                  "worker": "worker (AsyncHybrid)"}
_DRIVER = re.compile(r"(?:reflow\.cli|reflow)\s+(?:run|bench)\b|bench/modes\.py|bench/role_flip\.py")


def role_of(name: str, cmdline: list[str]) -> str:
    """A process's role from its name and command line."""
    cmd = " ".join(cmdline)
    # vLLM's processes retitle themselves (setproctitle): the title is the command line.
    if "VLLM::EngineCore" in cmd or name.startswith("VLLM::Engine"):
        return "VLLM::EngineCore"
    if "VLLM::Worker" in cmd or name.startswith("VLLM::Worker"):
        return "VLLM::Worker"
    if m := _SERVE.search(cmd):
        return _SERVICE_ROLES.get(m.group(1), "other")
    if _DRIVER.search(cmd):
        return "launcher"
    if name.startswith("redis-server") or "redis-server" in cmd:
        return "redis"
    return "other"


@dataclass
class Sample:
    """One walk of the process tree: when, how many steps were recorded by then, and
    every live process's CPU seconds, by (pid, start time) so a reused pid is new."""

    t: float
    steps: int
    cpu_s: dict[tuple[int, float], float]


def sample_tree(root_pid: int, steps: int, known: dict[tuple[int, float], tuple[str, str]]) -> Sample:
    """Read the CPU time of `root_pid` and its descendants; `known` keeps each
    process's (role, command line) as last seen."""
    try:
        root = psutil.Process(root_pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    cpu: dict[tuple[int, float], float] = {}
    for proc in tree:
        try:
            with proc.oneshot():
                key = (proc.pid, proc.create_time())
                times = proc.cpu_times()
                # Looked at on every sample, the last look wins: a child seen between
                # fork and exec still has its parent's command line, and vLLM's engine
                # core starts as a multiprocessing child and takes its title later.
                cmdline = proc.cmdline()
                known[key] = (role_of(proc.name(), cmdline), " ".join(cmdline))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        cpu[key] = times.user + times.system
    return Sample(time.monotonic(), steps, cpu)


def window(samples: list[Sample], from_step: int | None) -> tuple[int, int]:
    """Indices of the window's first and last sample. Without a step count to follow
    (`from_step` None), all of them; with one, from the first sample that saw
    `from_step` steps recorded to the first that saw the last step."""
    if from_step is None:
        return 0, len(samples) - 1
    first = next((i for i, s in enumerate(samples) if s.steps >= from_step), None)
    if first is None:
        raise ValueError(f"no sample saw {from_step} steps recorded")
    final = samples[-1].steps
    last = next(i for i, s in enumerate(samples) if s.steps == final)
    return first, max(first, last)


def cpu_in_window(samples: list[Sample], first: int, last: int) -> dict[tuple[int, float], float]:
    """Each process's CPU seconds between samples `first` and `last`: from its value
    at `first` (or from 0 for one that started later) to its last value up to `last`.
    A process that ended before `first` or started after `last` is not in it."""
    base = samples[first].cpu_s
    out: dict[tuple[int, float], float] = {}
    for s in samples[first:last + 1]:
        for key, cpu_s in s.cpu_s.items():
            out[key] = cpu_s - base.get(key, 0.0)
    return out


def summarize(samples: list[Sample], known: dict[tuple[int, float], tuple[str, str]],
              from_step: int | None) -> dict:
    """Per role: CPU seconds in the window, cores used and processes; and the total."""
    first, last = window(samples, from_step)
    window_s = samples[last].t - samples[first].t
    cpu = cpu_in_window(samples, first, last)
    roles: dict[str, dict] = {}
    for key, cpu_s in cpu.items():
        entry = roles.setdefault(known[key][0], {"processes": 0, "cpu_s": 0.0})
        entry["processes"] += 1
        entry["cpu_s"] += cpu_s
    ordered = {r: roles[r] for r in ROLES if r in roles}
    total = sum(e["cpu_s"] for e in ordered.values())
    for entry in [*ordered.values()]:
        entry["cores"] = entry["cpu_s"] / window_s if window_s > 0 else 0.0
    return {
        "window_s": window_s, "roles": ordered,
        "all": {"cpu_s": total, "cores": total / window_s if window_s > 0 else 0.0},
        "processes": [{"pid": key[0], "role": known[key][0], "cmdline": known[key][1][:300],
                       "cpu_s": cpu_s} for key, cpu_s in sorted(cpu.items())],
    }


def print_table(result: dict) -> None:
    print(f"\nCPU over {result['window_s']:.1f} s ({result['window']}), "
          f"cores used (1.0 = one core busy throughout):")
    print(f"{'role':<22}{'processes':>10}{'cpu s':>10}{'cores':>8}")
    for role, e in result["roles"].items():
        print(f"{role:<22}{e['processes']:>10}{e['cpu_s']:>10.1f}{e['cores']:>8.2f}")
    print(f"{'all':<22}{'':>10}{result['all']['cpu_s']:>10.1f}{result['all']['cores']:>8.2f}")
    print(f"(the sampler itself: {result['sampler_cpu_s']:.1f} cpu s, not in `all`)")


def _metrics_of(command: list[str]) -> Path | None:
    """DIR/metrics.jsonl of a `reflow run ... --out DIR` command, if it names one."""
    if "run" not in command:
        return None
    for i, arg in enumerate(command):
        if arg == "--out" and i + 1 < len(command):
            return Path(command[i + 1]) / "metrics.jsonl"
        if arg.startswith("--out="):
            return Path(arg.removeprefix("--out=")) / "metrics.jsonl"
    return None


def _steps_recorded(path: Path | None) -> int:
    if path is None or not path.exists():
        return 0
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def watch(root_pid: int, alive, interval_s: float, metrics: Path | None):
    """Sample the tree every `interval_s` until `alive()` is false."""
    samples: list[Sample] = []
    known: dict[tuple[int, float], tuple[str, str]] = {}
    while True:
        running = alive()
        samples.append(sample_tree(root_pid, _steps_recorded(metrics), known))
        if not running:
            return samples, known
        time.sleep(interval_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the result as JSON here")
    parser.add_argument("--pid", type=int, help="attach to this running process and its descendants")
    parser.add_argument("--interval-s", type=float, default=0.25)
    parser.add_argument("--metrics", help="metrics.jsonl to follow for the window "
                        "(default: that of a `reflow run --out DIR` command)")
    parser.add_argument("--from-step", type=int, default=5,
                        help="with a metrics file, the window opens once this many steps are recorded")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="the command to run and sample (after --)")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if bool(command) == (args.pid is not None):
        parser.error("give either a command to run (after --) or --pid")
    if args.interval_s <= 0 or args.from_step < 1:
        parser.error("--interval-s must be positive and --from-step at least 1")
    metrics = Path(args.metrics) if args.metrics else _metrics_of(command)
    me = psutil.Process()
    sampler_before = sum(me.cpu_times()[:2])
    rc = 0
    if command:
        proc = subprocess.Popen(command)  # nosec B603 # argv from our own command line
        try:
            samples, known = watch(proc.pid, lambda: proc.poll() is None, args.interval_s, metrics)
        except KeyboardInterrupt:
            proc.terminate()  # the run's own handler stops every process it started
            proc.wait()
            raise
        rc = proc.returncode
    else:
        root = psutil.Process(args.pid)

        def alive() -> bool:
            try:  # a zombie is "running" to psutil until its parent reaps it
                return root.is_running() and root.status() != psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return False

        samples, known = watch(args.pid, alive, args.interval_s, metrics)
    try:
        result = summarize(samples, known, args.from_step if metrics else None)
    except ValueError as e:
        print(f"{e} (in {metrics})", file=sys.stderr)
        return rc or 1
    result.update({
        "command": command or None, "pid": args.pid, "interval_s": args.interval_s,
        "window": f"from step {args.from_step} to the last of {metrics}" if metrics
        else "the whole run",
        "sampler_cpu_s": sum(me.cpu_times()[:2]) - sampler_before,
    })
    print_table(result)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
        print(f"results: {args.out}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
