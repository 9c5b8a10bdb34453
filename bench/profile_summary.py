"""Summarise a py-spy raw profile of a whole `reflow run` (every process) by process
and by where the time goes.

    py-spy record --subprocesses -r 50 -f raw -o prof.txt -- \
        .venv/bin/python -m reflow.cli run examples/bench_modes.yaml --out DIR mode=reflow
    python bench/profile_summary.py prof.txt --rate 50 [--top 12] [--json FILE]

py-spy's raw format is one folded stack per line, "frame;frame;... count", where the
leading frames name the process chain (`process PID:"command line"`). Samples are of
non-idle threads only (py-spy's default), so seconds here are busy time, not wall
time; frames that are plainly a wait (selectors, condition variables, idle pool
workers, sleeps) are counted apart as waiting. Start-up (imports, engine and model
construction, weight-sync group setup) is split from the steady state by the frames
it runs under.
"""

from __future__ import annotations

import argparse
import functools
import json
import linecache
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path

PROCESS = re.compile(r'^process \d+:"(?P<cmd>.*)"$')
# Frames that mark start-up work wherever they appear in a stack.
STARTUP_MARKERS = ("_find_and_load", "from_engine_args", "from_pretrained", "ensure_model",
                   "_initialize_kv_caches", "load_model", "init_weight_sync", "make_group",
                   "EngineCoreProc.__init__", "allocate_kv_cache",
                   "_init_executor", "triton_key", "build_tiny_qwen3")
# Innermost frames that are a thread waiting, not working. py-spy drops idle threads by
# their OS state, which misses waits in epoll, condition variables and queues.
# A blocking read from Redis or a blocking gRPC call is the caller waiting on its peer
# (whose own work shows under that peer, or, for Redis, outside Python).
WAIT_FRAMES = ("select (selectors.py", "Condition.wait (threading.py", "Event.wait",
               "_worker (concurrent/futures/thread.py", "_serve (grpc/_server.py", "sleep",
               "poll (", "recv_multipart", "_recv (", "Queue.get", "_wait_for_signal",
               "_read_from_socket (redis", "_blocking (grpc/_channel.py")
FRAME_SOURCE = re.compile(r"\((?P<file>[^()]+\.py):(?P<line>\d+)\)$")
# A Python frame whose own line sleeps or waits (its C call has no frame of its own).
WAIT_CALLS = ("sleep(", ".wait(", "select(")


@functools.cache
def waits_on_its_line(frame: str) -> bool:
    m = FRAME_SOURCE.search(frame)
    if not m:
        return False
    for root in sys.path:
        candidate = Path(root) / m.group("file")
        if candidate.is_file():
            text = linecache.getline(str(candidate), int(m.group("line")))
            return any(call in text for call in WAIT_CALLS)
    return False


def role_of(cmd: str) -> str:
    """A readable process name from its command line."""
    if m := re.search(r"reflow\.cli serve (\w+)", cmd):
        return m.group(1)
    if "reflow.cli run" in cmd:
        return "launcher"
    if "multiprocessing" in cmd or "spawn_main" in cmd:
        return "rollout engine core"
    return cmd[:40]


def parse(path: Path) -> dict[str, dict]:
    by_role: dict[str, dict] = defaultdict(lambda: {"startup": 0, "steady": 0, "waiting": 0,
                                                     "self": Counter(), "lines": Counter()})
    for line in path.read_text().splitlines():
        # multiprocessing's command line holds "; " itself: keep it in one frame.
        line = line.replace("; spawn_main(", " spawn_main(")
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        procs = [i for i, f in enumerate(frames) if PROCESS.match(f)]
        if not procs:
            continue
        cmd = PROCESS.match(frames[procs[-1]]).group("cmd")
        # A process spawned by multiprocessing shows under its parent's chain.
        role = role_of(cmd)
        calls = frames[procs[-1] + 1:]
        entry = by_role[role]
        phase = "startup" if any(m in f for f in calls for m in STARTUP_MARKERS) else "steady"
        if phase == "steady" and (not calls or any(w in calls[-1] for w in WAIT_FRAMES)
                                  or waits_on_its_line(calls[-1])):
            entry["waiting"] += count
            continue
        entry[phase] += count
        if phase == "steady" and calls:
            entry["self"][calls[-1]] += count
            # The innermost frame inside our own package: which line of ours pays for it.
            ours = [f for f in calls if "/reflow/" in f or "reflow/" in f.split("(")[-1]]
            entry["lines"][ours[-1] if ours else "(outside reflow)"] += count
    return by_role


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", type=Path)
    parser.add_argument("--rate", type=float, default=50.0, help="py-spy's -r (samples/s)")
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    by_role = parse(args.profile)
    s = lambda n: n / args.rate  # noqa: E731
    report = {}
    print(f"{'process':<22}{'start-up s':>12}{'steady busy s':>15}{'steady waiting s':>18}")
    for role, e in sorted(by_role.items(), key=lambda kv: -kv[1]["steady"]):
        print(f"{role:<22}{s(e['startup']):>12.1f}{s(e['steady']):>15.1f}{s(e['waiting']):>18.1f}")
        report[role] = {"startup_s": s(e["startup"]), "steady_s": s(e["steady"]),
                        "waiting_s": s(e["waiting"]),
                        "top_self": [(f, s(n)) for f, n in e["self"].most_common(args.top)],
                        "top_reflow_lines": [(f, s(n)) for f, n in e["lines"].most_common(args.top)]}
    for role, r in report.items():
        if r["steady_s"] < 1.0:
            continue
        print(f"\n{role}: steady-state busy {r['steady_s']:.1f} s; innermost frames")
        for frame, sec in r["top_self"]:
            print(f"  {sec:7.1f} s  {100 * sec / r['steady_s']:4.0f}%  {frame[:110]}")
        print(f"{role}: by the innermost ReFlow frame on the stack")
        for frame, sec in r["top_reflow_lines"]:
            print(f"  {sec:7.1f} s  {100 * sec / r['steady_s']:4.0f}%  {frame[:110]}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
