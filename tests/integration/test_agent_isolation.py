"""Hostile agent programs, run as a rollout worker runs them (under bubblewrap,
reflow.rollout.agent_process) against a scripted engine: what they try to read
of the worker (its /proc/<pid>/environ, a secret file, the test's directory, the
repository) is not there, what they try to hold (memory, processes) is bounded,
and they still reach the worker's endpoint on loopback. Each agent reports what
it found in its one call (it can write nowhere the test could read)."""

import os
import shutil
import textwrap
from pathlib import Path

import pytest

from reflow.rollout import agent_process
from reflow.rollout.agent_episode import AgentRunner
from reflow.tasks.agent import AGENTS_DIR_ENV
from reflow.tasks.confine import SECRET_PATHS_ENV
from tests.integration.test_agent_episode import RENDERER, Scripted, play, reported, task

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None,
                                reason="needs bubblewrap (apt-get install bubblewrap)")

REPO = Path(__file__).resolve().parents[2]
SECRET_TEXT = "agent-test-secret-6f0d2c"

# Each probe: what the agent got trying it, as "ok: <what it read>" or the error's name.
PROBER = """
    import json, os, sys
    from openai import OpenAI

    def attempt(fn):
        try:
            return "ok: " + str(fn())
        except Exception as err:
            return type(err).__name__

    def read(path):
        with open(path) as f:
            return f.read()

    def write(path):
        with open(path, "w") as f:
            return f.write("x")

    given = json.load(sys.stdin)
    seen = {
        "worker_environ": attempt(lambda: read(f"/proc/{WORKER_PID}/environ")),
        "pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()),
        "environs": [attempt(lambda: read(f"/proc/{p}/environ")) for p in os.listdir("/proc")
                     if p.isdigit()],
        "secret_file": attempt(lambda: read(SECRET_FILE)),
        "secret_dir": attempt(lambda: os.listdir(SECRET_DIR)),
        "outside_secret": attempt(lambda: read(OUTSIDE_SECRET)),
        "test_dir": attempt(lambda: sorted(os.listdir(TEST_DIR))),
        "dataset": attempt(lambda: read(DATASET)),
        "repo": attempt(lambda: sorted(os.listdir(REPO))),
        "readme": attempt(lambda: read(os.path.join(REPO, "README.md"))),
        "write_repo": attempt(lambda: write(os.path.join(REPO, "agent-was-here"))),
        "write_agents_dir": attempt(lambda: write(os.path.join(AGENTS_DIR, "planted.py"))),
        "uid": os.getuid(),
        "cap_eff": [line.split()[1] for line in read("/proc/self/status").splitlines()
                    if line.startswith("CapEff")][0],
    }
    OpenAI().chat.completions.create(model="any", messages=[
        {"role": "user", "content": "SEEN " + json.dumps(seen)}])
    print(json.dumps({"reward": 1.0}))
"""

# Holds what it can: memory past RLIMIT_AS, processes past RLIMIT_NPROC.
HOARDER = """
    import json, os, signal, sys, time
    given = json.load(sys.stdin)
    seen = {}
    try:
        hoard = bytearray(2 * 2**30)
        seen["allocation"] = "ok"
    except MemoryError:
        seen["allocation"] = "MemoryError"
    children = []
    while len(children) < 200:
        try:
            pid = os.fork()
        except OSError as err:
            seen["fork_error"] = type(err).__name__
            break
        if pid == 0:
            time.sleep(60)
            os._exit(0)
        children.append(pid)
    seen["forked"] = len(children)
    for pid in children:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    from openai import OpenAI
    OpenAI().chat.completions.create(model="any", messages=[
        {"role": "user", "content": "SEEN " + json.dumps(seen)}])
    print(json.dumps({"reward": 1.0}))
"""


@pytest.fixture
def hostile(tmp_path, monkeypatch):
    """The agents directory (a secret file and a secret directory inside it,
    listed in REFLOW_SECRET_PATHS, as is one outside every agent's view)."""
    agents = tmp_path / "agents"
    (agents / "tls").mkdir(parents=True)
    (agents / "token").write_text(SECRET_TEXT)
    (agents / "tls" / "key.pem").write_text(SECRET_TEXT)
    outside = tmp_path / "run" / "redis.password"
    outside.parent.mkdir()
    outside.write_text(SECRET_TEXT)
    names = {"WORKER_PID": os.getpid(), "SECRET_FILE": str(agents / "token"),
             "SECRET_DIR": str(agents / "tls"), "OUTSIDE_SECRET": str(outside),
             "TEST_DIR": str(tmp_path), "DATASET": str(tmp_path / "problems.jsonl"),
             "REPO": str(REPO), "AGENTS_DIR": str(agents)}
    constants = "".join(f"{name} = {value!r}\n" for name, value in names.items())
    for name, source in (("prober", PROBER), ("hoarder", HOARDER)):
        (agents / f"{name}.py").write_text(constants + textwrap.dedent(source))
    monkeypatch.setenv(AGENTS_DIR_ENV, str(agents))
    monkeypatch.setenv(SECRET_PATHS_ENV, os.pathsep.join(
        [str(agents / "token"), str(agents / "tls"), str(outside)]))
    return tmp_path


def run_agent(tmp_path, agent, **args):
    engine = Scripted()
    t = task(tmp_path, agent, reward_source="agent", **args)
    result = play(AgentRunner(t, RENDERER), engine, next(t.prompts()))
    assert (result.reward, result.reward_error) == (1.0, ""), result
    return reported(engine)


def test_an_agent_sees_nothing_of_the_worker_but_its_endpoint(hostile):
    seen = run_agent(hostile, "prober")
    # (a) The worker's process is not there to read: a pid namespace of the agent's own.
    assert seen["worker_environ"] == "FileNotFoundError"
    assert os.getpid() not in seen["pids"] and max(seen["pids"]) < 100
    assert not any(SECRET_TEXT in e or "PYTEST" in e for e in seen["environs"])
    # (b) Secret paths inside its view are covered; the one outside is not in it.
    assert seen["secret_file"] == "PermissionError"  # /dev/null, on a nodev bind
    assert seen["secret_dir"] == "ok: []"
    assert seen["outside_secret"] == "FileNotFoundError"
    # (c) Of the test's directory only the agents' own shows; the repository is absent
    # but for the interpreter's venv, and nothing is writable outside the scratch.
    assert seen["test_dir"] == "ok: ['agents']"
    assert seen["dataset"] == "FileNotFoundError"
    assert "README.md" not in seen["repo"] and "runs" not in seen["repo"]
    assert seen["readme"] == "FileNotFoundError"
    assert seen["write_repo"] in ("OSError", "PermissionError")
    assert seen["write_agents_dir"] in ("OSError", "PermissionError")
    assert not (hostile / "agents" / "planted.py").exists()
    # Not root, no capability.
    assert seen["uid"] == 65534 and int(seen["cap_eff"], 16) == 0
    # (d) And still it called the endpoint on 127.0.0.1: this report came that way.


def test_an_agents_memory_and_processes_are_bounded(hostile):
    seen = run_agent(hostile, "hoarder", memory_bytes=1 << 30, max_processes=16)
    assert seen["allocation"] == "MemoryError"
    assert seen["fork_error"] == "BlockingIOError"
    # Itself and 15 more (fewer where other processes of its uid count: Linux < 5.14).
    assert 8 <= seen["forked"] <= 15


def test_without_bubblewrap_the_runner_refuses_unless_the_operator_allows_it(hostile,
                                                                            monkeypatch, caplog):
    monkeypatch.setattr(agent_process.shutil, "which", lambda name: None)
    t = task(hostile, "prober", reward_source="agent")
    with pytest.raises(RuntimeError, match="apt-get install bubblewrap"):
        AgentRunner(t, RENDERER)
    monkeypatch.setenv(agent_process.UNCONFINED_ENV, "1")
    runner = AgentRunner(t, RENDERER)
    assert runner.launcher.isolation is None
    assert "runs as a plain process of the worker" in caplog.text
    engine = Scripted()
    try:
        play(runner, engine, next(t.prompts()))
    finally:
        # Unconfined, it writes where the worker may: the probe's file in the repository.
        (REPO / "agent-was-here").unlink(missing_ok=True)
    # Unconfined, it reads what the worker reads (which is why it takes an operator's word).
    assert "problems.jsonl" in reported(engine)["test_dir"]
    assert reported(engine)["write_repo"] == "ok: 1"
    monkeypatch.setenv(agent_process.UNCONFINED_ENV, "yes")
    with pytest.raises(ValueError, match=agent_process.UNCONFINED_ENV):
        AgentRunner(t, RENDERER)
