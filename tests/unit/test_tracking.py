"""Experiment trackers (reflow.tracking): each backend's store read back by its own
reader, the hub that keeps a slow or broken tracker away from training, the spec's
`tracking` section, and a tiny job with every tracker on."""

from __future__ import annotations

import json
import os
import random
import struct
import threading
from pathlib import Path

import pytest
import torch

from reflow.core.config import JobSpecError, parse_job_spec
from reflow.core.tracking_config import TrackingConfig
from reflow.core.types import Batch, Segment, Trajectory, group_advantages
from reflow.replay.store import BufferStats
from reflow.tracking import (GENERATION_COLUMNS, Tracker, TrackerContext, TrackerHub,
                             open_trackers, register_tracker, unregister_tracker)
from reflow.trainer.loop import TrainLoop
from reflow.trainer.metrics import TrainerMetrics

# --- each store, read back by its own reader ------------------------------------------


def read_tensorboard(run_dir: Path):
    """(scalars by tag as [(step, value)], text by tag as [(step, text)])."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    scalars = {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in tags["scalars"]}
    texts = {t: [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(t)]
             for t in tags["tensors"]}
    return scalars, texts


def read_mlflow(run_dir: Path):
    """The run in the local store: (client, run)."""
    from mlflow import MlflowClient

    # MLflow 3 opens a file store only with this switch (the tracker sets it too).
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")

    client = MlflowClient(tracking_uri=(run_dir / "mlflow").resolve().as_uri())
    experiments = client.search_experiments()
    runs = [r for e in experiments for r in client.search_runs([e.experiment_id])]
    assert len(runs) == 1, runs
    return client, runs[0]


def mlflow_curve(client, run, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))


def read_wandb(run_dir: Path):
    """The offline run's history rows (from its .wandb record log: 32 KiB blocks of
    length-prefixed chunks, each record a protobuf) and its files directory."""
    from wandb.proto import wandb_internal_pb2 as pb

    [path] = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, chunks, partial = 32768, 7, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:
            chunks.append(chunk)
        elif kind in (2, 3):
            partial = (partial if kind == 3 else b"") + chunk
        elif kind == 4:
            chunks.append(partial + chunk)
    history = []
    for chunk in chunks:
        record = pb.Record()
        record.ParseFromString(chunk)
        if record.WhichOneof("record_type") == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})
    return history, path.parent / "files"


def wandb_curve(history: list[dict], key: str) -> list[tuple[int, float]]:
    return [(row["_step"], row[key]) for row in history if key in row]


# --- feeding a hub ---------------------------------------------------------------------


class _Tokens:
    def decode(self, ids, skip_special_tokens=False):
        return " ".join(f"t{i}" for i in ids)


def _trajectories(n: int = 6) -> list[Trajectory]:
    return [Trajectory(f"s{i}", f"g{i // 2}", prompt_ids=[1, 2, i], response_ids=[7] * (i + 1),
                       logprobs=[-1.0] * (i + 1), loss_mask=[1] * (i + 1),
                       segments=[Segment(3, i + 1)], reward=i / 10) for i in range(n)]


RECORDS = [{"step": s, "policy_version": s, "reward_mean": s / 10, "trained_tokens": 100 + s,
            "optimizer_step_skipped": False, "staleness_histogram": {"0": 8}, "phase": "x"}
           for s in (1, 2, 3, 4)]
# An evaluation of version 1 arrives with step 2's record.
RECORDS[1].update(eval_reward=0.5, eval_policy_version=1, eval_pass_at_4=0.75)


def _hub(tmp_path: Path, backends: list[str], metrics=None, **settings) -> TrackerHub:
    config = TrackingConfig(backends=backends, generations_interval=2,
                            generations_per_table=4, **settings)
    context = TrackerContext(tmp_path, "job-1", "demo", config)
    return TrackerHub(backends, context, {"job_id": "job-1", "trainer": {"batch_size": 8}},
                      on_error=metrics.tracker_error if metrics else None,
                      on_drop=metrics.tracker_drop if metrics else None)


def _feed(hub: TrackerHub) -> None:
    for record in RECORDS:
        hub.log_record(record)
        hub.log_generations(record["step"], _trajectories(), _Tokens())
    hub.close()


def test_tensorboard_writes_event_files_tensorboard_reads_back(tmp_path):
    hub = _hub(tmp_path, ["tensorboard"])
    _feed(hub)
    assert hub.errors == {"tensorboard": 0}
    scalars, texts = read_tensorboard(tmp_path)
    assert scalars["reward_mean"] == [(s, pytest.approx(s / 10)) for s in (1, 2, 3, 4)]
    assert [v for _, v in scalars["optimizer_step_skipped"]] == [0.0] * 4
    # Evaluation fields at the version they scored; no histogram or string as a curve.
    assert scalars["eval_reward"] == [(1, 0.5)] and scalars["eval_pass_at_4"] == [(1, 0.75)]
    assert not {"eval_policy_version", "staleness_histogram", "phase", "step"} & set(scalars)
    assert "batch_size: 8" in texts["config/text_summary"][0][1]
    tables = texts["generations/text_summary"]
    assert [step for step, _ in tables] == [2, 4]
    header, _, *rows = tables[0][1].splitlines()
    assert header == "| " + " | ".join(GENERATION_COLUMNS) + " |"
    # One sample per group first, then the rest, up to generations_per_table rows.
    assert len(rows) == 4 and rows[0] == "| 2 | 3 | 0 | t1 t2 t0 | t7 |"
    assert rows[1].startswith("| 2 | 3 | 0.2 | t1 t2 t2 |")


def test_mlflow_writes_a_local_store_mlflow_client_reads_back(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("REFLOW_MLFLOW_TRACKING_URI", raising=False)
    hub = _hub(tmp_path, ["mlflow"])
    _feed(hub)
    assert hub.errors == {"mlflow": 0}
    client, run = read_mlflow(tmp_path)
    assert run.info.status == "FINISHED" and run.info.run_name == "job-1"
    assert run.data.params["trainer.batch_size"] == "8" and run.data.params["job_id"] == "job-1"
    assert mlflow_curve(client, run, "reward_mean") == [(s, pytest.approx(s / 10))
                                                        for s in (1, 2, 3, 4)]
    assert mlflow_curve(client, run, "eval_pass_at_4") == [(1, 0.75)]
    assert "eval_policy_version" not in run.data.metrics
    table = json.loads(Path(client.download_artifacts(
        run.info.run_id, "generations/step_00000004.json", str(tmp_path))).read_text())
    assert table["columns"] == list(GENERATION_COLUMNS)
    assert table["data"][0] == [4, 3, 0.0, "t1 t2 t0", "t7"] and len(table["data"]) == 4


def test_wandb_writes_an_offline_run_its_record_log_reads_back(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    hub = _hub(tmp_path, ["wandb"])
    _feed(hub)
    assert hub.errors == {"wandb": 0}
    history, files = read_wandb(tmp_path)
    assert wandb_curve(history, "reward_mean") == [(s, pytest.approx(s / 10)) for s in (1, 2, 3, 4)]
    [eval_row] = [row for row in history if "eval/reward" in row]
    assert (eval_row["eval/policy_version"], eval_row["eval/pass_at_4"]) == (1, 0.75)
    tables = [row["generations"]["path"] for row in history if "generations" in row] or [
        row["generations/path"] for row in history if "generations/path" in row]
    assert len(tables) == 2
    table = json.loads((files / tables[0]).read_text())
    assert table["columns"] == list(GENERATION_COLUMNS)
    assert table["data"][0] == [2, 3, 0.0, "t1 t2 t0", "t7"]


def test_an_online_wandb_run_without_a_key_is_disabled_and_nothing_else_is(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    metrics = TrainerMetrics()
    hub = _hub(tmp_path, ["wandb", "tensorboard"], metrics, wandb_mode="online")
    _feed(hub)
    assert hub.errors == {"wandb": 1, "tensorboard": 0} and list(hub.trackers) == ["tensorboard"]
    assert metrics.tracker_errors.labels("wandb")._value.get() == 1
    assert read_tensorboard(tmp_path)[0]["reward_mean"][-1][0] == 4


# --- a broken or stuck tracker never reaches training -----------------------------------


class Raising(Tracker):
    """Raises on every call, start included when `at_start`."""

    at_start = False

    def start(self, config):
        if self.at_start:
            raise RuntimeError("no server")

    def log_step(self, step, scalars):
        raise RuntimeError("boom")

    log_eval = log_generations = close = log_step


class Blocking(Tracker):
    """Blocks forever in its first call after start (until the test lets it go)."""

    release = threading.Event()

    def start(self, config):
        pass

    def log_step(self, step, scalars):
        self.release.wait()

    log_eval = log_generations = close = log_step


@pytest.fixture
def registered():
    names = []

    def register(name, factory):
        register_tracker(name, factory)
        names.append(name)

    yield register
    for name in names:
        unregister_tracker(name)


@pytest.mark.timeout(60)
def test_a_tracker_that_raises_on_every_call_is_counted_and_never_raises_to_the_caller(
        tmp_path, registered):
    registered("raising", Raising)
    metrics = TrainerMetrics()
    hub = _hub(tmp_path, ["raising", "tensorboard"], metrics)
    _feed(hub)
    # 4 steps, 1 evaluation, 2 tables, and the close.
    assert hub.errors == {"raising": 4 + 1 + 2 + 1, "tensorboard": 0}
    assert metrics.tracker_errors.labels("raising")._value.get() == 8
    # The other tracker got everything.
    assert [s for s, _ in read_tensorboard(tmp_path)[0]["reward_mean"]] == [1, 2, 3, 4]


@pytest.mark.timeout(60)
def test_a_tracker_failing_at_start_is_disabled_and_the_rest_go_on(tmp_path, registered):
    registered("no_server", type("NoServer", (Raising,), {"at_start": True}))
    hub = _hub(tmp_path, ["no_server", "tensorboard"])
    _feed(hub)
    assert hub.errors == {"no_server": 1, "tensorboard": 0} and list(hub.trackers) == ["tensorboard"]


@pytest.mark.timeout(60)
def test_a_tracker_that_blocks_forever_never_stalls_enqueueing_and_close_is_bounded(
        tmp_path, registered):
    Blocking.release.clear()
    registered("blocking", Blocking)
    metrics = TrainerMetrics()
    hub = _hub(tmp_path, ["blocking"], metrics, queue_size=3)
    # The thread is stuck in its first call; every record after the queue's three
    # is dropped at once, not waited for (a wait here would never end: timeout).
    accepted = [hub.log_record(dict(RECORDS[0], step=s)) for s in range(1, 201)]
    assert sum(accepted) <= 4 and hub.dropped == 200 - sum(accepted) >= 196
    assert metrics.tracker_dropped._value.get() == hub.dropped
    hub.close(timeout_s=0.5)
    assert hub._thread.is_alive()  # left behind, a daemon; the caller went on
    assert not hub.log_record(RECORDS[0])  # closed: nothing more is queued
    Blocking.release.set()
    hub._thread.join(10)
    assert not hub._thread.is_alive()


# --- the spec -------------------------------------------------------------------------


def _spec(**tracking):
    return parse_job_spec({"model": {"path": "/m"}, "tracking": tracking})


def test_the_tracking_section_defaults_to_off_and_errors_name_the_field(monkeypatch):
    assert _spec().tracking.backends == []
    assert _spec(backends=["tensorboard", "mlflow", "wandb"]).tracking.backends[2] == "wandb"
    cases = [
        ({"backends": ["neptune"]}, "tracking.backends: unknown tracker 'neptune'"),
        ({"backends": ["my.module:Tracker"]}, "module paths are not accepted"),
        ({"backends": ["mlflow", "mlflow"]}, "tracking.backends: 'mlflow' is listed twice"),
        ({"queue_size": 0}, "tracking.queue_size"),
        ({"generations_per_table": 10_000}, "tracking.generations_per_table"),
        ({"wandb_mode": "cloud"}, "tracking.wandb_mode"),
        ({"wandb_api_key": "x"}, "tracking.wandb_api_key: unknown field"),
        ({"mlflow_tracking_uri": "https://u:secret@mlflow.example"},
         "tracking.mlflow_tracking_uri: credentials do not belong in the spec"),
        ({"mlflow_tracking_uri": "file:///etc/reflow"},
         "tracking.mlflow_tracking_uri: file scheme; a spec names an MLflow server"),
        ({"mlflow_tracking_uri": "sqlite:////var/lib/x.db"},
         "tracking.mlflow_tracking_uri: sqlite scheme"),
        ({"mlflow_tracking_uri": "/tmp/mlruns"},
         "tracking.mlflow_tracking_uri: no scheme"),
    ]
    for tracking, message in cases:
        with pytest.raises(JobSpecError, match=message.replace("(", r"\(").replace(".", r"\.")):
            _spec(**tracking)
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(JobSpecError) as err:
        _spec(backends=["tensorboard", "wandb"])
    assert ("tracking.backends: wandb is not installed (pip install 'reflow[trackers]')"
            in str(err.value))


def test_a_registered_tracker_is_a_name_the_spec_may_use(registered):
    with pytest.raises(JobSpecError, match="unknown tracker 'raising'"):
        _spec(backends=["raising"])
    registered("raising", Raising)
    assert _spec(backends=["raising"]).tracking.backends == ["raising"]
    with pytest.raises(ValueError, match="built-in"):
        register_tracker("wandb", Raising)


def test_only_the_trainer_writing_metrics_jsonl_opens_trackers(tmp_path):
    spec = parse_job_spec({"model": {"path": "/m"}, "tracking": {"backends": ["tensorboard"]}})
    assert open_trackers("j", spec, None) is None  # a replica: no run directory
    assert open_trackers("j", spec.model_copy(update={"tracking": TrackingConfig()}),
                         tmp_path) is None
    hub = open_trackers("j", spec, tmp_path)
    hub.close()
    assert hub.trackers and read_tensorboard(tmp_path)[1]["config/text_summary"]


# --- a tiny job with every tracker on -----------------------------------------------------


class _OnPolicyReplay:
    """A replay buffer that generates each batch from the loop's current model, as a
    synchronous job does: the repeat task's reward (the share of response tokens
    equal to the prompt's first one), so rewards follow what training did."""

    def __init__(self, seed: int, groups: int = 2, group_size: int = 4) -> None:
        self.loop: TrainLoop | None = None
        self.seed, self.groups, self.group_size = seed, groups, group_size
        self.version = 0

    def configure(self, job_id, config):
        pass

    def sample(self, job_id, n, ttl_s, timeout_s=0.0):
        loop = self.loop
        rng = random.Random(self.seed * 1000 + loop.step)
        torch.manual_seed(self.seed * 1000 + loop.step)
        vocab = loop.model.config.vocab_size
        out = []
        for g in range(self.groups):
            prompt = [rng.randrange(3, vocab) for _ in range(4)]
            ids = torch.tensor([prompt] * self.group_size)
            with torch.no_grad():
                gen = loop.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                          max_new_tokens=6, min_new_tokens=6, top_k=0, top_p=1.0,
                                          temperature=1.0, output_scores=True,
                                          return_dict_in_generate=True, pad_token_id=0)
            logps = torch.stack(gen.scores, 1).log_softmax(-1)
            responses = gen.sequences[:, len(prompt):]
            taken = logps.gather(-1, responses.unsqueeze(-1)).squeeze(-1)
            rewards = [(r == prompt[0]).float().mean().item() for r in responses]
            for i, (resp, lp, reward, adv) in enumerate(
                    zip(responses.tolist(), taken.tolist(), rewards, group_advantages(rewards))):
                out.append(Trajectory(f"s{loop.step}-{g}-{i}", f"g{loop.step}-{g}", prompt, resp,
                                      lp, [1] * len(resp), [Segment(self.version, len(resp))],
                                      reward=reward, advantage=adv))
        return Batch(lease_id=f"l{loop.step}", trajectories=out, policy_version=self.version)

    def release(self, job_id, lease_id, stats):
        pass

    def renew_lease(self, job_id, lease_id, ttl_s):
        return True

    def return_lease(self, job_id, lease_id):
        pass

    def publish_version(self, job_id, version):
        self.version = version

    def stats(self, job_id):
        return BufferStats(policy_version=self.version)


def _run_tiny_job(tiny_model: str, run_dir: Path, backends: list[str]) -> list[dict]:
    spec = parse_job_spec({
        "mode": "sync", "seed": 3, "model": {"path": tiny_model},
        "rollout": {"group_size": 4, "max_tokens": 6},
        "trainer": {"batch_size": 8, "num_steps": 4, "learning_rate": 0.05},
        "tracking": {"backends": backends, "generations_interval": 2,
                     "generations_per_table": 3}})
    replay = _OnPolicyReplay(seed=spec.seed)
    run_dir.mkdir()
    loop = TrainLoop("tiny", spec, replay, rollouts=[], run_dir=str(run_dir),
                     device=torch.device("cpu"), metrics=TrainerMetrics())
    replay.loop = loop
    loop._send_weights = lambda: None  # no rollout engine to send weights to
    try:
        loop.load()
        loop.run()
    finally:
        loop.close()
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(120)
def test_a_tiny_job_logs_every_tracker_and_a_raising_one_changes_nothing(
        tiny_model, tmp_path, registered, monkeypatch):
    for key in ("MLFLOW_TRACKING_URI", "REFLOW_MLFLOW_TRACKING_URI", "WANDB_API_KEY"):
        monkeypatch.delenv(key, raising=False)
    registered("raising", Raising)
    plain = _run_tiny_job(tiny_model, tmp_path / "plain", [])
    tracked_dir = tmp_path / "tracked"
    tracked = _run_tiny_job(tiny_model, tracked_dir, ["raising", "tensorboard", "mlflow", "wandb"])
    # The same deterministic job, step for step, with every tracker on and one raising.
    steps = [r["step"] for r in plain]
    rewards = [r["reward_mean"] for r in plain]
    assert steps == [1, 2, 3, 4] and len(set(rewards)) > 1
    assert [r["step"] for r in tracked] == steps
    assert [r["reward_mean"] for r in tracked] == rewards
    assert [r["loss"] for r in tracked] == [r["loss"] for r in plain]
    # Each store holds the curve of metrics.jsonl, and the generation tables.
    expected = [(s, pytest.approx(r, abs=1e-6)) for s, r in zip(steps, rewards)]
    scalars, texts = read_tensorboard(tracked_dir)
    assert scalars["reward_mean"] == expected
    assert [s for s, _ in texts["generations/text_summary"]] == [2, 4]
    client, run = read_mlflow(tracked_dir)
    assert mlflow_curve(client, run, "reward_mean") == expected
    assert run.data.params["mode"] == "sync"
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id, "generations")]
    assert artifacts == ["generations/step_00000002.json", "generations/step_00000004.json"]
    history, files = read_wandb(tracked_dir)
    assert wandb_curve(history, "reward_mean") == expected
    [table_path] = [row["generations/path"] for row in history
                    if row.get("_step") == 2 and "generations/path" in row]
    table = json.loads((files / table_path).read_text())
    assert len(table["data"]) == 3 and table["data"][0][2] in [0.0, 1 / 6, 2 / 6, 3 / 6, 4 / 6,
                                                               5 / 6, 1.0]
