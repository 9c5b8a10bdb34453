"""A real Prometheus scrapes a live local run (`reflow run`), and every PromQL
expression in the shipped Grafana dashboards returns data. Also runs
`promtool check metrics` on each service's exposition."""

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from reflow import procs

from tests.e2e.test_cli import QUICKSTART, REPO, _interruptible

DASHBOARDS = sorted((REPO / "charts" / "reflow" / "dashboards").glob("*.json"))
SERVICES = {"api", "scheduler", "replay", "rollout", "trainer"}
# Grafana's variables, as a user looking at every job would have them.
VARIABLES = {"$__rate_interval": "30s", "$job_id": ".*"}


def dashboard_queries() -> list[tuple[str, str]]:
    out = []
    for path in DASHBOARDS:
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel["targets"]:
                expr = target["expr"]
                for var, value in VARIABLES.items():
                    expr = expr.replace(var, value)
                out.append((f"{path.stem}: {panel['title']} [{target['refId']}]", expr))
    return out


def _require(binary: str) -> str:
    path = shutil.which(binary) or (f"/usr/bin/{binary}" if Path(f"/usr/bin/{binary}").exists() else None)
    if path is None:
        pytest.fail(f"{binary} is not installed: apt-get install -y prometheus (make test does it as root)")
    return path


@pytest.mark.slow
def test_every_dashboard_query_returns_data_from_a_live_run(tmp_path, tiny_model):
    prometheus, promtool = _require("prometheus"), _require("promtool")
    queries = dashboard_queries()
    assert len(queries) >= 9
    out = tmp_path / "run"
    run = subprocess.Popen(
        [sys.executable, "-m", "reflow.cli", "run", str(QUICKSTART), "--out", str(out),
         "trainer.num_steps=2000", f"model.path={tiny_model}"],
        # Stopped by Ctrl-C at the end, also from a suite started in the background.
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=_interruptible)
    prom = None
    try:
        targets_file = out / "prometheus-targets.json"
        deadline = time.monotonic() + 300
        while True:
            assert run.poll() is None, run.communicate()[0]
            assert time.monotonic() < deadline, "the run never listed all its metrics endpoints"
            if targets_file.exists():
                targets = json.loads(targets_file.read_text())
                if {t["labels"]["service"] for t in targets} == SERVICES:
                    break
            time.sleep(1)

        port = procs.free_port()
        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            "scrape_configs:\n"
            "  - job_name: reflow\n"
            f"    file_sd_configs: [{{files: ['{targets_file}'], refresh_interval: 1s}}]\n")
        check = subprocess.run([promtool, "check", "config", str(config)], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
        prom = subprocess.Popen(
            [prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "wb"))
        api = f"http://127.0.0.1:{port}/api/v1"

        missing = dict(queries)
        deadline = time.monotonic() + 300
        while missing and time.monotonic() < deadline:
            assert run.poll() is None, "the run ended before every query had data"
            time.sleep(2)
            for name, expr in list(missing.items()):
                try:
                    reply = httpx.get(f"{api}/query", params={"query": expr}, timeout=10).json()
                except httpx.HTTPError:
                    break  # Prometheus still starting
                assert reply["status"] == "success", (name, expr, reply)
                if any(_is_number(r["value"][1]) for r in reply["data"]["result"]):
                    del missing[name]
        assert not missing, f"queries without data: {missing}"

        # Each target is up, and each exposition passes promtool's lint.
        up = httpx.get(f"{api}/query", params={"query": "up"}, timeout=10).json()["data"]["result"]
        assert {r["metric"]["service"] for r in up if r["value"][1] == "1"} == SERVICES
        for target in json.loads(targets_file.read_text()):
            text = httpx.get(f"http://{target['targets'][0]}/metrics", timeout=10).text
            lint = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
            assert lint.returncode == 0, (target["labels"]["service"], lint.stdout + lint.stderr)
    finally:
        if prom is not None:
            prom.terminate()
            prom.wait(30)
        if run.poll() is None:
            run.send_signal(signal.SIGINT)
            try:
                run.wait(120)
            except subprocess.TimeoutExpired:
                run.kill()


def _is_number(value: str) -> bool:
    return value not in ("NaN", "+Inf", "-Inf")
