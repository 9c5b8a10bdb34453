"""Hostile job specs over REST (the real API in front of the real scheduler over
gRPC, jobs in real Redis): each is refused with the right status and a message
naming the field, nothing it names is imported, opened or executed, and no job
is recorded."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from reflow.api.app import ApiSettings
from reflow.core.errors import InvalidArgument
from reflow.core.limits import OperatorLimits
from reflow.scheduler.client import GrpcSchedulerClient

from tests.integration.api_fixtures import TOKEN, RecordOnlyScheduler, api_stack

pytestmark = pytest.mark.security

AUTH = {"Authorization": f"Bearer {TOKEN}"}
MODULE_PATHS = ["subprocess:Popen", "os:system", "builtins:exec", "posix.system",
                "reflow.replay.plugins:AcceptAll"]
LIMITS = OperatorLimits(max_batch_size=256, max_response_tokens=1024, max_inflight_samples=512,
                        max_samples_per_step=512, max_kv_cache_gb=4, max_num_steps=1000,
                        max_active_jobs=2)


class HoldingScheduler(RecordOnlyScheduler):
    """Jobs stay active (pending) until stopped."""

    def _run_job(self, record, stop, resume=False, adopted=None) -> None:
        stop.wait(60)
        super()._run_job(record, stop, resume, adopted)


@pytest.fixture
def stack(redis_server, redis_client, tmp_path):
    with api_stack(redis_server.url, tmp_path, ApiSettings(token=TOKEN), LIMITS,
                   HoldingScheduler) as (app, core, _):
        yield TestClient(app), core
        core.shutdown()


@pytest.fixture
def canary(tmp_path):
    path = tmp_path / "pwned"
    yield path
    assert not path.exists(), "an attack ran code: the canary file exists"


def _spec(tmp_path, **sections):
    return {"model": {"path": str(tmp_path / "model")}, "trainer": {"num_steps": 3}, **sections}


@pytest.mark.parametrize("path", MODULE_PATHS)
@pytest.mark.parametrize("field,args_field", [("sampler", "sampler_args"),
                                              ("replay_filter", "filter_args")])
def test_module_paths_in_plugin_fields_are_refused_and_run_nothing(stack, tmp_path, canary, path,
                                                                   field, args_field):
    client, core = stack
    body = _spec(tmp_path, replay={field: path,
                                   args_field: {"args": f"touch {canary}", "shell": True}})
    r = client.post("/v1/jobs", json=body, headers=AUTH)
    assert r.status_code == 422, r.text
    assert r.json()["errors"][0]["field"] == f"replay.{field}"
    assert "module paths are not accepted" in r.json()["detail"] or "unknown" in r.json()["detail"]
    assert core.list()[0] == []


@pytest.mark.parametrize("path", MODULE_PATHS)
def test_a_module_path_as_task_is_refused(stack, tmp_path, canary, path):
    client, core = stack
    r = client.post("/v1/jobs", json=_spec(tmp_path, task={"name": path}), headers=AUTH)
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "task.name"
    assert core.list()[0] == []


def test_plugin_arguments_are_checked_by_the_plugins_own_model(stack, tmp_path):
    client, _ = stack
    cases = [({"replay_filter": "max_use_count", "filter_args": {"max_uses": 0}},
              "replay.filter_args.max_uses"),
             ({"replay_filter": "accept_all", "filter_args": {"shell": True}},
              "replay.filter_args.shell"),
             ({"sampler": "medium_reward", "sampler_args": {"low": 0.9, "high": 0.1}},
              "replay.sampler_args"),
             ({"sampler_args": {f"k{i}": i for i in range(40)}}, "replay.sampler_args")]
    for replay, field in cases:
        r = client.post("/v1/jobs", json=_spec(tmp_path, replay=replay), headers=AUTH)
        assert r.status_code == 422 and field in r.json()["detail"], (replay, r.text)


def test_paths_outside_the_roots_get_422_naming_the_field(stack, tmp_path):
    client, core = stack
    (tmp_path / "link").symlink_to("/etc")
    for bad in ("/etc/passwd", "../../etc", f"{tmp_path}/../elsewhere", str(tmp_path / "link"),
                "link/ssl", str(tmp_path)):
        r = client.post("/v1/jobs", json=_spec(tmp_path) | {"model": {"path": bad}}, headers=AUTH)
        assert r.status_code == 422 and "model.path" in r.json()["detail"], (bad, r.text)
        assert "REFLOW_MODELS_DIR" in r.json()["detail"]
    # A relative path is taken under the models root.
    ok = client.post("/v1/jobs", json=_spec(tmp_path) | {"model": {"path": "tiny"}}, headers=AUTH)
    assert ok.status_code == 201, ok.text
    assert core.list()[0][0].job_id == ok.json()["job_id"]


def test_run_dir_over_grpc_is_confined_to_the_runs_root(stack, tmp_path):
    _, core = stack
    import json

    spec = json.dumps(_spec(tmp_path))
    for bad in ("/etc/cron.d", "../../x", str(tmp_path.parent)):
        with pytest.raises(ValueError, match="run_dir"):
            core.submit(spec, job_id="direct", run_dir=bad)
    # The same through the scheduler's gRPC service, as any in-cluster caller sends it.
    from reflow.scheduler.server import serve

    server, port = serve(core, "127.0.0.1:0")
    client = GrpcSchedulerClient(f"127.0.0.1:{port}")
    try:
        with pytest.raises(InvalidArgument, match="run_dir"):
            client.submit(spec, job_id="over-grpc", run_dir="/var/lib")
    finally:
        client.close()
        server.stop(0)
    assert core.list()[0] == []


def test_logs_never_follow_a_symlink_out_of_the_run_directory(stack, tmp_path):
    client, _ = stack
    secret = tmp_path.parent / "secret.txt"
    secret.write_text("TOP-SECRET")
    job = client.post("/v1/jobs", json=_spec(tmp_path) | {"submission_id": "logs"},
                      headers=AUTH).json()
    logs = tmp_path / job["job_id"] / "logs"
    logs.mkdir(parents=True)
    (logs / "trainer.log").symlink_to(secret)
    r = client.get("/v1/jobs/logs/logs", params={"service": "trainer"}, headers=AUTH)
    assert r.status_code == 422 and "TOP-SECRET" not in r.text
    assert "logs.trainer" in r.json()["detail"]


def test_no_token_or_a_wrong_one_is_401_and_the_api_will_not_start_open(stack, tmp_path):
    client, core = stack
    for headers in ({}, {"Authorization": "Bearer wrong-token-0123456789"},
                    {"Authorization": f"Basic {TOKEN}"}, {"Authorization": f"Bearer {TOKEN}x"}):
        assert client.post("/v1/jobs", json=_spec(tmp_path), headers=headers).status_code == 401
        assert client.get("/v1/jobs", headers=headers).status_code == 401
    assert core.list()[0] == []
    with pytest.raises(ValueError, match="no API token"):
        ApiSettings(token="")
    with pytest.raises(ValueError, match="at least 16"):
        ApiSettings(token="short")
    assert ApiSettings(insecure_no_auth=True).token == ""


@pytest.mark.parametrize("section,field,value,ceiling", [
    ("trainer", "batch_size", 512, 256), ("rollout", "max_tokens", 4096, 1024),
    ("rollout", "max_inflight_samples", 1024, 512), ("rollout", "max_samples_per_step", 1024, 512),
    ("rollout", "kv_cache_gb", 8.0, 4), ("trainer", "num_steps", 5000, 1000)])
def test_specs_over_an_operator_ceiling_get_422_naming_field_and_ceiling(stack, tmp_path, section,
                                                                         field, value, ceiling):
    client, core = stack
    r = client.post("/v1/jobs", json=_spec(tmp_path, **{section: {field: value}})
                    | ({"trainer": {"num_steps": 3, field: value}} if section == "trainer" else {}),
                    headers=AUTH)
    assert r.status_code == 422, r.text
    assert f"{section}.{field}: {value} exceeds" in r.json()["detail"]
    assert f"ceiling of {ceiling}" in r.json()["detail"]
    assert core.list()[0] == []


def test_a_value_far_over_a_ceiling_names_the_configured_ceiling(stack, tmp_path):
    client, core = stack
    r = client.post("/v1/jobs", json=_spec(tmp_path) | {"trainer": {"num_steps": 3,
                                                                    "batch_size": 10**12}},
                    headers=AUTH)
    assert r.status_code == 422, r.text
    assert "trainer.batch_size" in r.text and "ceiling of 256" in r.text
    assert "REFLOW_MAX_BATCH_SIZE" in r.text
    assert core.list()[0] == []


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_a_non_finite_number_is_refused_as_such(stack, tmp_path, value):
    client, core = stack
    body = '{"model": {"path": "%s"}, "trainer": {"num_steps": 3, "learning_rate": %s}}' % (
        _spec(tmp_path)["model"]["path"], value)
    r = client.post("/v1/jobs", content=body, headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 422, r.text
    assert "trainer.learning_rate" in r.text and "finite" in r.text
    assert "less than" not in r.text
    assert core.list()[0] == []


def test_auth_is_checked_before_the_body_and_bad_json_names_no_field(stack, tmp_path):
    client, core = stack
    broken = '{"model": {"path": '
    for headers in ({}, {"Authorization": "Bearer wrong-token-0123456789"}):
        r = client.post("/v1/jobs", content=broken,
                        headers={**headers, "content-type": "application/json"})
        assert r.status_code == 401, r.text
        assert "model" not in r.text
    r = client.post("/v1/jobs", content=broken,
                    headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 422
    assert r.json()["errors"][0]["field"] == "(body)"
    assert "not valid JSON" in r.json()["detail"]
    assert core.list()[0] == []


def test_more_active_jobs_than_the_ceiling_get_429(stack, tmp_path):
    client, core = stack
    for i in range(LIMITS.max_active_jobs):
        assert client.post("/v1/jobs", json=_spec(tmp_path) | {"submission_id": f"a{i}"},
                           headers=AUTH).status_code == 201
    r = client.post("/v1/jobs", json=_spec(tmp_path), headers=AUTH)
    assert r.status_code == 429 and "REFLOW_MAX_ACTIVE_JOBS=2" in r.json()["detail"]
    assert r.headers["retry-after"]
    # An idempotent resubmission of an existing job is not a new job: still 200.
    again = client.post("/v1/jobs", json=_spec(tmp_path) | {"submission_id": "a0"}, headers=AUTH)
    assert again.status_code == 200
    client.post("/v1/jobs/a0/stop", headers=AUTH)
    assert client.post("/v1/jobs", json=_spec(tmp_path), headers=AUTH).status_code == 201


def test_task_datasets_and_arguments_are_checked_at_submission(stack, tmp_path, canary):
    """An unknown task, bad task arguments, a dataset outside the datasets root, a
    dataset without the named column: 422 naming the field, and no job recorded."""
    client, core = stack
    (tmp_path / "rows.jsonl").write_text('{"question": "1 + 1?", "answer": "2"}\n' * 4)
    outside = tmp_path.parent / f"{tmp_path.name}-outside.jsonl"
    outside.write_text('{"question": "q", "answer": "1"}\n')
    (tmp_path / "escape.jsonl").symlink_to(outside)
    # A row is data: a "prompt" that names a command is text, nothing runs it.
    (tmp_path / "hostile.jsonl").write_text(
        '{"question": "__import__(\'os\').system(\'touch %s\')", "answer": "1"}\n' % canary)
    cases = [
        ({"name": "no_such_task"}, "task.name"),
        ({"name": "repeat", "args": {"max_count": -1}}, "task.args.max_count"),
        ({"name": "math", "args": {"path": str(outside)}}, "task.args.path"),
        ({"name": "math", "args": {"path": "escape.jsonl"}}, "task.args.path"),
        ({"name": "math", "args": {"path": "../../etc/passwd"}}, "task.args.path"),
        ({"name": "math", "args": {"path": "rows.jsonl", "answer_column": "solution"}},
         "task.args.answer_column"),
        ({"name": "reasoning_gym", "args": {"dataset": "os.system"}}, "task.args.dataset"),
    ]
    for task, field in cases:
        r = client.post("/v1/jobs", json=_spec(tmp_path, task=task), headers=AUTH)
        assert r.status_code == 422 and field in r.json()["detail"], (task, r.text)
    assert core.list()[0] == []
    r = client.post("/v1/jobs", json=_spec(tmp_path, task={"name": "math",
                                                           "args": {"path": "hostile.jsonl"}}),
                    headers=AUTH)
    assert r.status_code == 201, r.text
