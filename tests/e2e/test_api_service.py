"""`reflow serve api` and `reflow serve scheduler` as processes, driven by
`reflow submit` / `reflow jobs` and curl-like HTTP: the token is required, and
killing the API loses nothing, since jobs live in the scheduler's Redis."""

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from reflow import procs, rpc
from reflow.launcher import wait_http
from reflow.replay.embedded import EmbeddedRedis

from tests.e2e.test_cli import REPO, reflow

TOKEN = "e2e-token-abcdef"


def _serve(service, port, env, log):
    return subprocess.Popen([sys.executable, "-m", "reflow.cli", "serve", service, "--port", str(port)],
                            cwd=REPO, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT)


@pytest.fixture
def control_plane(tmp_path):
    redis = EmbeddedRedis(tmp_path / "redis").start()
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    sched_port, api_port, metrics_port = procs.free_port(), procs.free_port(), procs.free_port()
    env = {"REDIS_URL": redis.url, "REFLOW_RUNS_DIR": str(tmp_path / "runs"),
           "REFLOW_SCHEDULER_ADDRESS": f"127.0.0.1:{sched_port}",
           "REFLOW_API_TOKEN_FILE": str(token_file), "REFLOW_METRICS_PORT": str(metrics_port)}
    log = open(tmp_path / "services.log", "ab")
    started = [_serve("scheduler", sched_port, {**env, "REFLOW_METRICS_PORT": str(procs.free_port())}, log)]
    rpc.wait_healthy(f"127.0.0.1:{sched_port}", 60, service="reflow.v1.Scheduler")

    def start_api():
        proc = _serve("api", api_port, env, log)
        started.append(proc)
        wait_http(f"http://127.0.0.1:{api_port}/healthz", 60)
        return proc

    yield f"http://127.0.0.1:{api_port}", start_api, metrics_port
    for proc in started:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    redis.stop()
    log.close()


def test_jobs_survive_an_api_restart_and_submission_is_idempotent(control_plane, tmp_path):
    url, start_api, metrics_port = control_plane
    api = start_api()
    config = tmp_path / "job.yaml"
    # No model at this path: the scheduler fails the job quickly, naming the field.
    config.write_text(f"name: restart\nmodel: {{path: {tmp_path / 'no-model'}}}\n"
                      "trainer: {num_steps: 2}\n")

    denied = reflow("submit", str(config), "--url", url, "--token", "wrong")
    assert denied.returncode == 1 and "401" in denied.stderr
    first = reflow("submit", str(config), "--url", url, "--token", TOKEN, "--submission-id", "keep-me")
    assert first.returncode == 0, first.stderr

    auth = {"Authorization": f"Bearer {TOKEN}"}
    deadline = time.monotonic() + 60
    while (job := httpx.get(f"{url}/v1/jobs/keep-me", headers=auth).json())["phase"] != "FAILED":
        assert time.monotonic() < deadline, job
        time.sleep(0.2)
    assert "model.path" in job["reason"]
    scraped = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").text
    assert 'reflow_api_requests_total{method="GET",route="/v1/jobs/{job_id}",status="200"}' in scraped

    api.kill()  # no graceful shutdown: nothing may depend on it
    api.wait(10)
    start_api()
    assert httpx.get(f"{url}/v1/jobs/keep-me", headers=auth).json() == job
    again = httpx.post(f"{url}/v1/jobs", headers=auth, json={
        "name": "restart", "model": {"path": str(tmp_path / "no-model")},
        "trainer": {"num_steps": 2}, "submission_id": "keep-me"})
    assert again.status_code == 200 and again.json() == job
    listed = reflow("jobs", "--url", url, "--token", TOKEN)
    assert listed.returncode == 0 and listed.stdout.count("keep-me") == 1


def test_a_worker_serves_both_the_rollout_and_the_trainer_api(tmp_path):
    """`reflow serve worker`, the AsyncHybrid worker pod's command."""
    port, metrics_port = procs.free_port(), procs.free_port()
    with open(tmp_path / "worker.log", "ab") as log:
        worker = _serve("worker", port, {"REFLOW_METRICS_PORT": str(metrics_port)}, log)
        try:
            for service in ("", "reflow.v1.Rollout", "reflow.v1.Trainer", "reflow.v1.Worker"):
                rpc.wait_healthy(f"127.0.0.1:{port}", 60, service=service)
            import grpc

            from reflow.rollout.client import GrpcRolloutClient
            from reflow.trainer.client import GrpcTrainerClient
            from reflow.worker.client import GrpcWorkerClient

            assert GrpcTrainerClient(f"127.0.0.1:{port}").status().state == "idle"
            with pytest.raises(Exception, match="no-such-job"):
                GrpcRolloutClient(f"127.0.0.1:{port}").stats("no-such-job")
            # The Worker service: no role without a job; bad requests named, not crashes.
            roles = GrpcWorkerClient(f"127.0.0.1:{port}")
            assert roles.role("").role == ""
            with pytest.raises(grpc.RpcError) as bad:
                roles.set_role("job-1", "critic")
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "role" in bad.value.details()
            with pytest.raises(grpc.RpcError) as absent:
                roles.set_role("job-1", "trainer")  # no engine of that job here
            assert absent.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert GrpcTrainerClient(f"127.0.0.1:{port}").status().state == "idle"
            wait_http(f"http://127.0.0.1:{metrics_port}/metrics", 60)
        finally:
            worker.send_signal(signal.SIGTERM)
            assert worker.wait(30) == 0


@pytest.mark.security
def test_the_api_refuses_to_start_without_a_token_unless_told_to_run_open(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("REFLOW_API_TOKEN", "REFLOW_API_TOKEN_FILE")}
    port = procs.free_port()
    refused = subprocess.run([sys.executable, "-m", "reflow.cli", "serve", "api", "--port",
                              str(port)], cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=60)
    assert refused.returncode != 0
    assert "no API token" in refused.stderr and "REFLOW_API_TOKEN_FILE" in refused.stderr
    with open(tmp_path / "api.log", "wb") as log:
        api = subprocess.Popen([sys.executable, "-m", "reflow.cli", "serve", "api", "--port",
                                str(port), "--insecure-no-auth"], cwd=REPO, env=env,
                               stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_http(f"http://127.0.0.1:{port}/healthz", 60)
        finally:
            api.send_signal(signal.SIGTERM)
            api.wait(30)
    assert "NO AUTHENTICATION" in (tmp_path / "api.log").read_text()
