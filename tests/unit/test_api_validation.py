"""HTTP-level validation of the API. The scheduler behind it is a recording
stand-in here: these requests must be answered by the API alone."""

from fastapi.testclient import TestClient

from reflow.api.app import ApiSettings, create_app
from reflow.core.errors import NotFound
from reflow.scheduler.jobcontrol.jobs import JobRecord


TOKEN = "unit-test-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class RecordingScheduler:
    def __init__(self):
        self.submitted = []

    def submit(self, spec_json, job_id="", run_dir=""):
        self.submitted.append(spec_json)
        return JobRecord(job_id="j1", name="x", spec_json=spec_json, num_steps=3), True

    def get(self, job_id):
        raise NotFound(f"no job {job_id!r}")


def test_malformed_specs_are_rejected_with_the_field_named():
    sched = RecordingScheduler()
    client = TestClient(create_app(sched, ApiSettings(token=TOKEN)), headers=AUTH)
    r = client.post("/v1/jobs", json={"model": {"path": "/m"}, "trainer": {"batch_size": -1}})
    assert r.status_code == 422
    assert "trainer.batch_size" in r.json()["detail"]
    r = client.post("/v1/jobs", json={"model": {"path": "/m"}, "trainer": {"typo": 1}})
    assert r.status_code == 422
    assert "trainer.typo: unknown field" in r.json()["detail"]
    assert sched.submitted == []


def test_valid_spec_reaches_the_scheduler_and_unknown_job_is_404():
    sched = RecordingScheduler()
    client = TestClient(create_app(sched, ApiSettings(token=TOKEN)), headers=AUTH)
    r = client.post("/v1/jobs", json={"model": {"path": "/m"}, "trainer": {"num_steps": 3}})
    assert r.status_code == 201 and r.json()["phase"] == "PENDING"
    assert len(sched.submitted) == 1
    assert client.get("/v1/jobs/nope").status_code == 404
    assert client.get("/healthz").json() == {"status": "ok"}


def test_api_settings_come_from_the_environment_and_name_a_bad_value(monkeypatch, tmp_path):
    import pytest
    from pydantic import ValidationError

    from reflow.api.app import ApiSettings

    token_file = tmp_path / "token"
    token_file.write_text("from-secret-0123456789\n")
    monkeypatch.setenv("REFLOW_API_TOKEN", "from-env-0123456789")
    monkeypatch.setenv("REFLOW_API_TOKEN_FILE", str(token_file))
    monkeypatch.setenv("REFLOW_API_MAX_BODY_BYTES", "4096")
    assert ApiSettings.from_env() == ApiSettings(token="from-secret-0123456789",
                                                 max_body_bytes=4096)
    monkeypatch.setenv("REFLOW_API_MAX_BODY_BYTES", "lots")
    with pytest.raises(ValidationError, match="max_body_bytes"):
        ApiSettings.from_env()


def _post_raw(client, body: bytes, content_type: str = "application/json"):
    return client.post("/v1/jobs", content=body, headers={**AUTH, "Content-Type": content_type})


def test_a_bad_body_is_answered_naming_what_is_wrong_with_it():
    sched = RecordingScheduler()
    client = TestClient(create_app(sched, ApiSettings(token=TOKEN, max_body_bytes=1 << 20)),
                        headers=AUTH)
    cases = [
        (b'{"model": {"path": "/m"', "application/json", 422,
         "(body): not valid JSON (Expecting ',' delimiter) at character 23"),
        (b"", "application/json", 422, "(body): empty; send a JSON object"),
        (b"[1, 2]", "application/json", 422, "(body): not a JSON object"),
        # Non-finite numbers, in a typed field and in a free-form one.
        (b'{"model": {"path": "/m"}, "replay": {"replay_cap": NaN}}', "application/json", 422,
         "replay.replay_cap: NaN is not a JSON number; send a finite number"),
        (b'{"model": {"path": "/m"}, "task": {"args": {"scale": [1, -Infinity]}}}',
         "application/json", 422, "task.args.scale.1: -Infinity is not a JSON number"),
        (b'{"model": {"path": "/m"}, "rollout": {"temperature": 1e999}}', "application/json",
         422, "rollout.temperature: 1e999 is not a JSON number"),
        (b'{"model": {"path": "/m"}}', "application/x-www-form-urlencoded", 415,
         "Content-Type: 'application/x-www-form-urlencoded' is not JSON"),
        (b'{"model": {"path": "/m"}, "name": "' + b"x" * (10 << 20) + b'"}',
         "application/json", 413, "request body exceeds 1048576 bytes"),
    ]
    for body, content_type, status, message in cases:
        r = _post_raw(client, body, content_type)
        assert r.status_code == status, (body[:60], r.text)
        assert message in r.json()["detail"], (body[:60], r.json())
        assert "Field required" not in r.text
    # A NaN inside a string is text, not a number.
    r = _post_raw(client, b'{"model": {"path": "/m/NaN Infinity"}}')
    assert r.status_code == 201, r.text
    assert len(sched.submitted) == 1
