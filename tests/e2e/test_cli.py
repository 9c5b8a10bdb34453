"""The `reflow` CLI as a user runs it."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "examples" / "quickstart.yaml"
SERVICES = ("api", "scheduler", "replay", "rollout", "trainer")
REQUIRED_KEYS = {"step", "policy_version", "reward_mean", "trained_tokens", "step_time_s",
                 "trainer_tokens_per_s", "trainer_idle_ratio", "rollout_idle_ratio",
                 "fresh_samples", "replay_samples", "max_staleness", "wall_time_s"}


def reflow(*args, **kwargs):
    return subprocess.run([sys.executable, "-m", "reflow.cli", *args], capture_output=True,
                          text=True, cwd=REPO, **kwargs)


def _services_running(proc: psutil.Process) -> dict[str, int]:
    found = {}
    for child in proc.children(recursive=True):
        try:
            cmd = child.cmdline()
        except psutil.Error:
            continue
        if "serve" in cmd:
            found[cmd[cmd.index("serve") + 1]] = child.pid
    return found


def _redis_env(pid: int) -> dict[str, str]:
    """The Redis URLs a service process was started with ("" for none)."""
    try:
        env = psutil.Process(pid).environ()
    except psutil.Error:
        return {}
    return {key: env.get(key, "") for key in ("REDIS_URL", "REFLOW_REPLAY_REDIS_URL")}


def _tls_env(pid: int) -> dict[str, str]:
    """The TLS settings a service process was started with."""
    try:
        env = psutil.Process(pid).environ()
    except psutil.Error:
        return {}
    return {k: v for k, v in env.items() if k.startswith("REFLOW_TLS")}


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_malformed_spec_is_rejected_naming_the_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {path: /m}\ntrainer: {batch_size: -8, learning_rat: 0.1}\n")
    result = reflow("run", str(bad))
    assert result.returncode == 2
    assert "trainer.batch_size" in result.stderr
    assert "trainer.learning_rat: unknown field" in result.stderr


def _one_line_error(result) -> str:
    """The refusal as a user sees it: exit 2, no traceback, `error: ...` lines."""
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines and all(line.startswith("error: ") for line in lines), result.stderr
    return result.stderr


def test_each_bad_field_is_one_error_line_without_a_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {path: /m}\ntrainer: {batch_size: -8, learning_rat: 0.1}\n")
    err = _one_line_error(reflow("run", str(bad), "--dry-run"))
    assert len(err.strip().splitlines()) == 2
    assert "error: trainer.batch_size: " in err
    assert "error: trainer.learning_rat: unknown field" in err
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: {path: [\n")
    err = _one_line_error(reflow("run", str(broken), "--dry-run"))
    assert f"error: {broken}: not valid YAML at line 2" in err


@pytest.mark.parametrize("rows,message", [
    ('{"prompt": "1+1", "answer": "2"}\n{"prompt": null, "answer": "3"}\n',
     "error: task.args.prompt_column: row 1 holds null, not text or a number"),
    ('{"question": "1+1", "answer": "2"}\n',
     "error: task.args.prompt_column: row 0 has no column 'prompt'"),
    ('{"prompt": "1+1", "answer": "2"}\n{"prompt": "2+2"\n',
     "error: task.args.path: line 2 is not JSON"),
])
def test_a_bad_dataset_row_is_one_line_naming_the_row_and_the_field(tmp_path, rows, message):
    (tmp_path / "data.jsonl").write_text(rows)
    # Refused before any service starts, --dry-run or not.
    for extra in (["--dry-run"], ["--out", str(tmp_path / "run")]):
        result = reflow("run", str(REPO / "examples" / "math.yaml"), *extra,
                        "task.args.path=data.jsonl", "task.args.prompt_column=prompt",
                        env={**os.environ, "REFLOW_DATASETS_DIR": str(tmp_path)}, timeout=120)
        assert message in _one_line_error(result)
    assert not (tmp_path / "run").exists()


def test_an_unreachable_api_is_one_line_naming_the_url():
    err = _one_line_error(reflow("jobs", "--url", "http://127.0.0.1:9", "--token", "t"))
    assert "error: http://127.0.0.1:9: cannot reach the REST API" in err


def test_dry_run_prints_the_resolved_config():
    result = reflow("run", str(QUICKSTART), "--dry-run", "trainer.num_steps=7")
    assert result.returncode == 0, result.stderr
    assert "num_steps: 7" in result.stdout and "replay:" in result.stdout


@pytest.mark.slow
def test_quickstart_runs_as_five_processes_and_writes_the_run_directory(tmp_path, tiny_model):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "reflow.cli", "run", str(QUICKSTART), "--out", str(out),
         "trainer.num_steps=4", f"model.path={tiny_model}",
         # Every experiment tracker on, each writing its store in the run directory.
         "tracking.backends=[tensorboard,mlflow,wandb]", "tracking.generations_interval=2"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={k: v for k, v in os.environ.items()
             if k not in ("MLFLOW_TRACKING_URI", "REFLOW_MLFLOW_TRACKING_URI", "WANDB_API_KEY")},
    )
    cli = psutil.Process(proc.pid)
    seen: dict[str, int] = {}
    redis_env: dict[str, dict[str, str]] = {}
    tls_env: dict[str, dict[str, str]] = {}
    deadline = time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        seen.update(_services_running(cli))
        for service, pid in seen.items():
            if service not in redis_env:
                redis_env[service] = _redis_env(pid)
                tls_env[service] = _tls_env(pid)
        time.sleep(0.5)
    output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, output
    # Every service ran as its own process, with its own pid.
    assert set(seen) == set(SERVICES), seen
    assert len(set(seen.values())) == 5
    assert not [pid for pid in seen.values() if _alive(pid)]
    # Redis users (reflow/redis_acl.py): the buffer and the scheduler each logged in as
    # its own, the scheduler holding the buffer's URL to start it with; the API, the
    # rollout worker and the trainer got no Redis credential.
    replay_url = redis_env["replay"]["REDIS_URL"]
    assert replay_url.startswith("redis://replay:"), redis_env
    assert redis_env["scheduler"] == {"REDIS_URL": redis_env["scheduler"]["REDIS_URL"],
                                      "REFLOW_REPLAY_REDIS_URL": replay_url}
    assert redis_env["scheduler"]["REDIS_URL"].startswith("redis://scheduler:")
    for service in ("api", "rollout", "trainer"):
        assert redis_env[service] == {"REDIS_URL": "", "REFLOW_REPLAY_REDIS_URL": ""}, service
    acl = out / "redis" / "users.acl"
    assert acl.stat().st_mode & 0o777 == 0o600
    passwords = [urlsplit(redis_env[s]["REDIS_URL"]).password for s in ("replay", "scheduler")]
    for path in [acl, *(out / "logs").glob("*.log"), *out.glob("*.json*")]:
        text = path.read_text(errors="replace")
        assert not [pw for pw in passwords if pw in text], path
    # Mutual TLS, by default: a CA made for the run (its key never written) and a
    # certificate per role; each service was given its own key and no other.
    certs = out / "tls"
    assert (certs / "ca.crt").is_file() and not list(certs.glob("ca.key"))
    for service in SERVICES:
        env = tls_env[service]
        assert (certs / f"{service}.key").stat().st_mode & 0o777 == 0o600
        assert env["REFLOW_TLS"] == "on", (service, env)
        assert [v for v in env.values() if v.endswith(".key")] == [str(certs / f"{service}.key")]
        # Only the scheduler, which starts the job's services, knows where the rest are.
        assert env.get("REFLOW_TLS_DIR", "") == (str(certs) if service == "scheduler" else "")
        if service != "api":  # the API serves REST, and dials the scheduler with its own
            log = (out / "logs" / f"{service}.log").read_text()
            assert "(mutual TLS)" in log and "WITHOUT TLS" not in log, service

    records = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        assert REQUIRED_KEYS <= set(r)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["phase"] == "SUCCEEDED" and summary["steps"] == 4
    # Start-up is measured and reported once, apart from the steady state: vLLM takes
    # seconds to build, and the step clock (wall_time_s) starts after both.
    assert summary["engine_startup_s"] > 1.0 and summary["trainer_startup_s"] > 0.0
    assert "engine_startup_s" in records[0] and "engine_startup_s" not in records[1]
    assert (out / "report.png").stat().st_size > 10_000
    # The run's API had auth on: a random token, readable by its owner only.
    token_file = out / "api-token"
    assert token_file.stat().st_mode & 0o777 == 0o600 and len(token_file.read_text().strip()) >= 32
    assert "num_steps: 4" in (out / "config.yaml").read_text()
    _check_trackers(out, records)


def _check_trackers(out: Path, records: list[dict]) -> None:
    """Each tracker's store, read back by its own reader, holds the reward curve of
    metrics.jsonl and the generations tables of steps 2 and 4."""
    from tests.unit.test_tracking import (mlflow_curve, read_mlflow, read_tensorboard,
                                          read_wandb, wandb_curve)

    curve = [(r["step"], pytest.approx(r["reward_mean"], abs=1e-6)) for r in records]
    scalars, texts = read_tensorboard(out)
    assert scalars["reward_mean"] == curve
    assert [step for step, _ in texts["generations/text_summary"]] == [2, 4]
    client, run = read_mlflow(out)
    assert mlflow_curve(client, run, "reward_mean") == curve and run.info.status == "FINISHED"
    assert [a.path for a in client.list_artifacts(run.info.run_id, "generations")] == [
        "generations/step_00000002.json", "generations/step_00000004.json"]
    history, files = read_wandb(out)
    assert wandb_curve(history, "reward_mean") == curve
    tables = [row["generations/path"] for row in history if "generations/path" in row]
    assert len(tables) == 2
    table = json.loads((files / tables[0]).read_text())
    assert table["columns"][-2:] == ["prompt", "response"] and table["data"][0][3]


def _interruptible() -> None:
    """The run's SIGINT as a terminal gives it: a suite started in the background
    (`cmd &`, nohup) passes SIGINT on ignored, and Python keeps it ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
@pytest.mark.parametrize("target", ["cli", "process-group"])
def test_ctrl_c_leaves_no_process_behind(tmp_path, tiny_model, target):
    """`cli`: SIGINT to the reflow process alone (kill -INT). `process-group`: what a
    terminal's Ctrl-C does, SIGINT to every process of the foreground group at once."""
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "reflow.cli", "run", str(QUICKSTART), "--out", str(out),
         "trainer.num_steps=10000", f"model.path={tiny_model}"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True, preexec_fn=_interruptible,
    )
    cli = psutil.Process(proc.pid)
    descendants: list[int] = []
    try:
        deadline = time.monotonic() + 300
        metrics = out / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "the job never started training"
            time.sleep(0.5)
        descendants = [p.pid for p in cli.children(recursive=True)]
        assert len(descendants) >= 6  # redis, five services, vLLM's engine core
        if target == "cli":
            os.kill(proc.pid, signal.SIGINT)
        else:
            os.killpg(proc.pid, signal.SIGINT)
        output = proc.communicate(timeout=120)[0]
        assert "interrupted" in output
        leftovers = [pid for pid in descendants if _alive(pid)]
        assert not leftovers, [psutil.Process(p).cmdline() for p in leftovers]
    finally:
        # A failed run must not train on beside the rest of the suite.
        for pid in [proc.pid, *descendants]:
            if _alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    summary = json.loads((out / "summary.json").read_text())
    assert summary["phase"] == "STOPPED"


@pytest.mark.slow
@pytest.mark.parametrize("mode,bound", [("sync", 0), ("one_step_off", 1), ("fully_async", None),
                                        ("reflow", 1)])
def test_each_mode_keeps_its_staleness_guarantee(tmp_path, tiny_model, mode, bound):
    out = tmp_path / mode
    # The metrics count a sample's lag from its oldest segment, which δ bounds when
    # versions are counted that way; the default (`completed`) bounds the version a
    # group finished under instead, checked in the buffer (test_replay_cycle).
    versions = ["replay.staleness_version=oldest"] if mode == "reflow" else []
    result = reflow("run", str(REPO / "examples" / "bench_modes.yaml"), "--out", str(out),
                    f"mode={mode}", "trainer.num_steps=6", "trainer.batch_size=16",
                    "rollout.group_size=4", "rollout.max_tokens=24", f"model.path={tiny_model}",
                    *versions, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    records = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 6
    if bound is not None:
        assert max(r["max_staleness"] for r in records) <= bound
    for r in records:
        # Idle is the wait for a batch plus the wait for the rollout workers to pause
        # for a weight update (with partial rollout off, their samples finishing).
        idle_s = r["batch_wait_s"] + r["sync_wait_s"]
        assert 0 <= r["sync_wait_s"] <= r["weight_sync_s"]
        assert r["trainer_idle_ratio"] == pytest.approx(min(1.0, idle_s / r["step_time_s"]))
    if mode in ("one_step_off", "fully_async"):
        # As their authors run them: throttled, never evicting a finished sample.
        assert records[-1]["evicted_samples_total"] == 0
    if mode != "reflow":
        assert all(r["replay_samples"] == 0 for r in records)
    if mode == "sync":
        # Trained on data from exactly the current policy, every step.
        assert all(r["fresh_samples"] == 16 for r in records)
