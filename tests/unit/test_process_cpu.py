"""bench/process_cpu.py: roles from command lines, and CPU over the steady-state window."""

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

_PATH = Path(__file__).resolve().parents[2] / "bench" / "process_cpu.py"
_spec = importlib.util.spec_from_file_location("process_cpu", _PATH)
process_cpu = importlib.util.module_from_spec(_spec)
sys.modules["process_cpu"] = process_cpu  # dataclasses look their module up
_spec.loader.exec_module(process_cpu)
Sample = process_cpu.Sample


@pytest.mark.parametrize(("name", "cmdline", "role"), [
    ("python", ["/v/bin/python", "/v/bin/reflow", "run", "examples/quickstart.yaml"], "launcher"),
    ("python", ["/v/bin/python", "-m", "reflow.cli", "bench", "modes", "--out", "x"], "launcher"),
    ("python", ["/v/bin/python", "-m", "reflow.cli", "serve", "scheduler", "--port", "1"],
     "scheduler"),
    ("python", ["/v/bin/python", "-m", "reflow.cli", "serve", "rollout", "--port", "1"],
     "rollout front end"),
    ("python", ["/v/bin/python", "-m", "reflow.cli", "serve", "trainer", "--port", "1"], "trainer"),
    ("python", ["/v/bin/python", "-m", "reflow.cli", "serve", "replay", "--port", "1"], "replay"),
    ("python", ["/v/bin/python", "-m", "reflow.cli", "serve", "api", "--port", "1"], "api"),
    ("VLLM::EngineCor", ["VLLM::EngineCore"], "VLLM::EngineCore"),
    ("VLLM::Worker_TP", ["VLLM::Worker_TP0"], "VLLM::Worker"),
    ("redis-server", ["/usr/bin/redis-server", "127.0.0.1:6379"], "redis"),
    ("python", ["/v/bin/python", "-c", "from multiprocessing.resource_tracker import main"],
     "other"),
])
def test_role_of(name, cmdline, role):
    assert process_cpu.role_of(name, cmdline) == role


def _known(*roles):
    return {(pid, 0.0): (role, role) for pid, role in enumerate(roles, start=1)}


def test_window_runs_from_the_step_to_the_first_sample_that_saw_the_last():
    samples = [Sample(0.0, 0, {}), Sample(1.0, 5, {}), Sample(2.0, 9, {}), Sample(3.0, 10, {}),
               Sample(4.0, 10, {}), Sample(5.0, 10, {})]
    assert process_cpu.window(samples, from_step=5) == (1, 3)
    assert process_cpu.window(samples, from_step=None) == (0, 5)
    with pytest.raises(ValueError, match="11 steps"):
        process_cpu.window(samples, from_step=11)


def test_cpu_counts_inside_the_window_only():
    # pid 1 runs throughout; 2 ends before the window; 3 starts inside it and ends;
    # 4 starts after its last sample.
    samples = [
        Sample(0.0, 0, {(1, 0.0): 1.0, (2, 0.0): 4.0}),
        Sample(1.0, 5, {(1, 0.0): 2.0}),
        Sample(2.0, 7, {(1, 0.0): 2.5, (3, 0.0): 0.4}),
        Sample(3.0, 8, {(1, 0.0): 3.0}),
        Sample(4.0, 8, {(1, 0.0): 9.0, (4, 0.0): 5.0}),
    ]
    known = _known("trainer", "replay", "trainer", "redis")
    result = process_cpu.summarize(samples, known, from_step=5)
    assert result["window_s"] == 2.0
    assert result["roles"]["trainer"] == {"processes": 2, "cpu_s": pytest.approx(1.4),
                                          "cores": pytest.approx(0.7)}
    assert set(result["roles"]) == {"trainer"}
    assert result["all"]["cores"] == pytest.approx(0.7)


def test_metrics_file_of_a_run_command():
    assert process_cpu._metrics_of(["reflow", "run", "x.yaml", "--out", "/tmp/r"]) == \
        Path("/tmp/r/metrics.jsonl")
    assert process_cpu._metrics_of(["reflow", "run", "x.yaml", "--out=/tmp/r"]) == \
        Path("/tmp/r/metrics.jsonl")
    assert process_cpu._metrics_of(["reflow", "bench", "modes", "--out", "/tmp/r"]) is None


def test_samples_a_command_and_its_children(tmp_path):
    """A command whose child burns CPU: the child is seen and its CPU counted."""
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
    child = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {burn!r}])"
    out = tmp_path / "cpu.json"
    rc = process_cpu.main(["--out", str(out), "--interval-s", "0.05", "--",
                           sys.executable, "-c", child])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["roles"]["other"]["processes"] == 2
    # CPU time, not wall time: the child burns 0.3 s of it whatever the load; the
    # sampler may miss what it burnt after the last sample before it exited.
    assert result["roles"]["other"]["cpu_s"] >= 0.1
    assert result["window"] == "the whole run"


def test_a_process_is_placed_by_its_latest_command_line():
    """Seen first between fork and exec (its parent's command line), a service is
    placed by the command line it runs later."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)",
                              "-m", "reflow.cli", "serve", "replay"])
    try:
        key = (child.pid, psutil.Process(child.pid).create_time())
        known = {key: ("launcher", "reflow run x.yaml")}
        # Under load the child may not have exec'd yet: what is placed is the command
        # line it runs once it has.
        deadline = time.monotonic() + 30
        while "serve" not in psutil.Process(child.pid).cmdline() and time.monotonic() < deadline:
            time.sleep(0.01)
        sample = process_cpu.sample_tree(child.pid, 0, known)
        assert key in sample.cpu_s
        assert known[key][0] == "replay"
    finally:
        child.kill()
        child.wait()
