"""The example plug-in package (examples/plugins/reflow-example-plugins), installed
the way an operator would: its entry points make `newest_first` and `min_reward`
nameable in a spec, with their arguments checked against the plug-ins' own Args.

The package is installed with `pip --target` into a temporary folder and used
from subprocesses that put that folder on PYTHONPATH, so the entry points are
discovered from its installed metadata and the project environment is untouched.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from reflow.core import plugins
from reflow.core.config import JobSpecError, parse_job_spec

PACKAGE = Path(__file__).resolve().parents[2] / "examples" / "plugins" / "reflow-example-plugins"


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory) -> str:
    """A folder holding the installed example package (module and *.dist-info)."""
    root = tmp_path_factory.mktemp("plugin-package")
    # Build from a copy: an in-tree build leaves build/ and *.egg-info behind.
    source = root / "src"
    shutil.copytree(PACKAGE, source, ignore=shutil.ignore_patterns(
        "build", "*.egg-info", "__pycache__"))
    target = root / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
         "--no-index", "--disable-pip-version-check", "--quiet", "--target", str(target),
         str(source)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"pip install failed:\n{proc.stdout}\n{proc.stderr}"
    assert list(target.glob("reflow_example_plugins-*.dist-info")), sorted(os.listdir(target))
    return str(target)


def run_with_plugins(plugin_path: str, script: str, **env: str) -> dict:
    """Run `script` in a fresh interpreter that sees the installed package; it
    prints one JSON object as its last line of output."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": plugin_path, **env})
    assert proc.returncode == 0, (f"subprocess failed (rc {proc.returncode}):\n"
                                  f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


REGISTRY_SCRIPT = """
    import json
    import random

    from reflow.core import plugins
    from reflow.core.config import JobSpecError, parse_job_spec
    from reflow.replay.plugins import GroupInfo, SampleInfo, load_filter, load_sampler

    out = {"samplers": plugins.registered("sampler"),
           "filters": plugins.registered("replay_filter")}
    assert "newest_first" in out["samplers"], out
    assert "min_reward" in out["filters"], out

    def spec(filter_args):
        return {"model": {"path": "/m"},
                "replay": {"sampler": "newest_first", "replay_filter": "min_reward",
                           "filter_args": filter_args}}

    parsed = parse_job_spec(spec({"threshold": 0.8}))
    out["parsed"] = [parsed.replay.sampler, parsed.replay.replay_filter,
                     parsed.replay.filter_args]

    out["errors"] = {}
    for label, args in (("bad_value", {"threshold": "high"}), ("unknown", {"thresh": 1})):
        try:
            parse_job_spec(spec(args))
        except JobSpecError as err:
            out["errors"][label] = str(err)
        else:
            raise AssertionError(f"{args} was accepted")

    keep = load_filter("min_reward", {"threshold": 0.8})
    def sample(reward):
        return SampleInfo("s", "g", reward, 0.0, 1, 3, 0)
    out["keeps"] = [keep.keep(sample(0.9)), keep.keep(sample(0.8)), keep.keep(sample(0.5))]
    out["default_threshold"] = load_filter("min_reward").threshold

    def group(gid, version, created):
        return GroupInfo(gid, 4, 0.5, version, 0, 12, created)
    candidates = [group("old", 0, 1.0), group("new-early", 2, 2.0),
                  group("mid", 1, 5.0), group("new-late", 2, 3.0)]
    ranked = load_sampler("newest_first").rank(candidates, random.Random(0))
    out["ranked"] = [g.group_id for g in ranked]
    print(json.dumps(out))
"""


def test_installed_package_registers_and_validates_its_plugins(plugin_path):
    out = run_with_plugins(plugin_path, REGISTRY_SCRIPT)
    assert "newest_first" in out["samplers"] and "uniform" in out["samplers"]
    assert "min_reward" in out["filters"] and "accept_all" in out["filters"]
    assert out["parsed"] == ["newest_first", "min_reward", {"threshold": 0.8}]
    assert "replay.filter_args.threshold" in out["errors"]["bad_value"]
    assert "replay.filter_args.thresh" in out["errors"]["unknown"]
    # The unknown-key message lists what the plug-in does take.
    assert "threshold" in out["errors"]["unknown"].split("replay.filter_args.thresh", 1)[1]
    assert out["keeps"] == [True, True, False]
    assert out["default_threshold"] == 0.5
    assert out["ranked"] == ["new-late", "new-early", "mid", "old"]


def test_without_the_package_its_names_are_refused():
    plugins.refresh()
    assert "newest_first" not in plugins.registered("sampler")
    assert "min_reward" not in plugins.registered("replay_filter")
    with pytest.raises(JobSpecError) as err:
        parse_job_spec({"model": {"path": "/m"}, "replay": {"sampler": "newest_first"}})
    message = str(err.value)
    assert "replay.sampler" in message and "'newest_first'" in message
    assert "registered: " + ", ".join(plugins.registered("sampler")) in message


def test_module_path_is_refused_even_with_the_package_installed(plugin_path):
    out = run_with_plugins(plugin_path, """
        import json
        from reflow.core.config import JobSpecError, parse_job_spec
        try:
            parse_job_spec({"model": {"path": "/m"}, "replay": {
                "sampler": "reflow_example_plugins:NewestFirstSampler"}})
        except JobSpecError as err:
            print(json.dumps({"error": str(err)}))
        else:
            raise AssertionError("a module path was accepted")
    """)
    assert "module paths are not accepted" in out["error"]
    assert "newest_first" in out["error"]


REPLAY_SCRIPT = """
    import json
    import os

    from reflow.core.config import ReplayConfig
    from reflow.core.types import Segment, Trajectory
    from reflow.replay.store import ReplayStore

    store = ReplayStore.from_url(os.environ["REDIS_URL"])
    job = "plugin-package"
    store.configure(job, ReplayConfig(replay_filter="min_reward",
                                      filter_args={"threshold": 0.8}, max_staleness=10))
    rewards = [1.0, 0.0]
    store.put(job, [Trajectory(f"g-{i}", "g", [1, 2], [3, 4, 5], [-0.1, -0.2, -0.3], [1, 1, 1],
                               [Segment(0, 3)], reward=r, advantage=r - 0.5)
                    for i, r in enumerate(rewards)])
    batch = store.lease(job, 2, 30, timeout_s=1.0)
    assert batch is not None, store.stats(job)
    leased = sorted(t.sample_id for t in batch.trajectories)
    store.release(job, batch.lease_id)
    stats = store.stats(job)
    out = {"leased": leased, "replay_samples": stats.replay_samples,
           "dropped_total": stats.dropped_total, "unused_samples": stats.unused_samples}

    # The replay pool now holds the kept sample alone: the next batch of two
    # takes it next to one fresh sample (σ = 0.5 allows one replayed).
    store.put(job, [Trajectory("h-0", "h", [1, 2], [3, 4, 5], [-0.1, -0.2, -0.3], [1, 1, 1],
                               [Segment(0, 3)], reward=0.5, advantage=0.0)])
    again = store.lease(job, 2, 30, timeout_s=1.0)
    out["replayed"] = sorted(t.sample_id for t in again.trajectories if t.uses > 0) if again else None
    print(json.dumps(out))
"""


def test_min_reward_filter_decides_replay_in_a_real_store(plugin_path, redis_server, redis_client):
    out = run_with_plugins(plugin_path, REPLAY_SCRIPT, REDIS_URL=redis_server.url)
    assert out["leased"] == ["g-0", "g-1"]
    assert (out["replay_samples"], out["dropped_total"], out["unused_samples"]) == (1, 1, 0)
    assert out["replayed"] == ["g-0"]
