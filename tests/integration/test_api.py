"""The REST API's contract: auth, 401/413/422/409, idempotent submission,
paging, logs and metrics, request metrics."""

import pytest
from fastapi.testclient import TestClient

from reflow.api.app import ApiSettings

from tests.integration.api_fixtures import TOKEN, api_stack

AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def stack(redis_server, redis_client, tmp_path):
    with api_stack(redis_server.url, tmp_path,
                   ApiSettings(token=TOKEN, max_body_bytes=4096)) as (app, core, registry):
        yield TestClient(app), core, registry


def _spec(tmp_path, **trainer):
    return {"model": {"path": str(tmp_path / "model")}, "trainer": {"num_steps": 3, **trainer}}


def test_v1_routes_want_the_bearer_token_and_health_and_openapi_do_not(stack):
    client, _, _ = stack
    r = client.get("/v1/jobs")
    assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
    r = client.get("/v1/jobs", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and 'error="invalid_token"' in r.headers["www-authenticate"]
    r = client.get("/v1/jobs", headers={"Authorization": f"Basic {TOKEN}"})
    assert r.status_code == 401
    assert client.get("/v1/jobs", headers=AUTH).status_code == 200
    assert client.get("/healthz").status_code == 200
    doc = client.get("/openapi.json").json()
    assert {"/v1/jobs", "/v1/jobs/{job_id}", "/v1/jobs/{job_id}/stop", "/v1/jobs/{job_id}/logs",
            "/v1/jobs/{job_id}/metrics"} <= set(doc["paths"])
    assert "HTTPBearer" in doc["components"]["securitySchemes"]


def test_oversized_bodies_get_413_declared_or_streamed(stack, tmp_path):
    client, core, _ = stack
    big = _spec(tmp_path) | {"name": "x" * 5000}
    r = client.post("/v1/jobs", json=big, headers=AUTH)
    assert r.status_code == 413 and "4096" in r.json()["detail"]

    def chunks():
        for _ in range(10):
            yield b"{" + b" " * 1000

    r = client.post("/v1/jobs", content=chunks(), headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 413
    assert core.list()[0] == []


def test_unknown_fields_and_bad_parameters_get_422_naming_the_field(stack, tmp_path):
    client, _, _ = stack
    r = client.post("/v1/jobs", json=_spec(tmp_path) | {"replay": {"replay_cup": 0.5}}, headers=AUTH)
    assert r.status_code == 422 and "replay.replay_cup: unknown field" in r.json()["detail"]
    r = client.post("/v1/jobs", json=_spec(tmp_path) | {"submission_id": "Bad_Id"}, headers=AUTH)
    assert r.status_code == 422 and "submission_id" in r.json()["detail"]
    r = client.get("/v1/jobs", params={"limit": 0}, headers=AUTH)
    assert r.status_code == 422 and "limit" in r.json()["detail"]
    for token in ("abc", "²"):  # "²" is a digit to str.isdigit(), not to Redis
        r = client.get("/v1/jobs", params={"page_token": token}, headers=AUTH)
        assert r.status_code == 422 and "page_token" in r.json()["detail"]
    r = client.post("/v1/jobs", content=b"{not json", headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 422


def test_submission_id_makes_submission_idempotent(stack, tmp_path):
    client, core, _ = stack
    body = _spec(tmp_path) | {"submission_id": "exp-1"}
    first = client.post("/v1/jobs", json=body, headers=AUTH)
    again = client.post("/v1/jobs", json=body, headers=AUTH)
    assert (first.status_code, again.status_code) == (201, 200)
    assert first.json()["job_id"] == again.json()["job_id"] == "exp-1"
    changed = client.post("/v1/jobs", json=_spec(tmp_path, num_steps=9) | {"submission_id": "exp-1"},
                          headers=AUTH)
    assert changed.status_code == 409 and "different spec" in changed.json()["detail"]
    jobs, _ = core.list()
    assert [j.job_id for j in jobs] == ["exp-1"]
    # Without a submission_id every POST is a new job.
    a = client.post("/v1/jobs", json=_spec(tmp_path), headers=AUTH).json()["job_id"]
    b = client.post("/v1/jobs", json=_spec(tmp_path), headers=AUTH).json()["job_id"]
    assert a != b


def test_jobs_are_listed_in_pages_newest_first(stack, tmp_path):
    client, _, _ = stack
    for i in range(5):
        client.post("/v1/jobs", json=_spec(tmp_path) | {"submission_id": f"j{i}"}, headers=AUTH)
    seen, token = [], ""
    while True:
        page = client.get("/v1/jobs", params={"limit": 2, "page_token": token}, headers=AUTH).json()
        seen += [j["job_id"] for j in page["jobs"]]
        token = page["next_page_token"]
        if not token:
            break
    assert seen == ["j4", "j3", "j2", "j1", "j0"]
    job = client.get("/v1/jobs/j2", headers=AUTH).json()
    assert job["phase"] == "FAILED" and job["created_at"] > 0 and job["finished_at"] >= job["created_at"]
    assert client.get("/v1/jobs/none", headers=AUTH).status_code == 404


def test_logs_and_step_metrics_of_a_job(stack, tmp_path):
    client, core, _ = stack
    record = client.post("/v1/jobs", json=_spec(tmp_path) | {"submission_id": "lm"}, headers=AUTH).json()
    run_dir = tmp_path / record["job_id"]
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "logs" / "trainer.log").write_text("".join(f"line {i}\n" for i in range(1000)))
    core.store.append_metrics("lm", [{"step": s, "reward_mean": s / 10} for s in (1, 2, 3)])

    text = client.get("/v1/jobs/lm/logs", params={"service": "trainer", "tail_bytes": 9},
                      headers=AUTH).text
    assert text == "line 999\n"
    everything = client.get("/v1/jobs/lm/logs", headers=AUTH).text
    assert "==> trainer <==" in everything and "==> rollout <==" in everything
    r = client.get("/v1/jobs/lm/logs", params={"service": "gpu"}, headers=AUTH)
    assert r.status_code == 422 and "service" in r.json()["detail"]

    page = client.get("/v1/jobs/lm/metrics", params={"limit": 2}, headers=AUTH).json()
    assert [r["step"] for r in page["records"]] == [1, 2] and page["next_since_step"] == 2
    rest = client.get("/v1/jobs/lm/metrics", params={"since_step": 2}, headers=AUTH).json()
    assert [r["reward_mean"] for r in rest["records"]] == [0.3]
    assert client.get("/v1/jobs/nope/metrics", headers=AUTH).status_code == 404
    assert client.get("/v1/jobs/nope/logs", headers=AUTH).status_code == 404


def test_requests_are_counted_by_route_template_and_status(stack):
    client, _, registry = stack
    client.get("/v1/jobs/abc", headers=AUTH)
    client.get("/v1/jobs/def", headers=AUTH)
    client.get("/v1/jobs")
    value = registry.get_sample_value
    assert value("reflow_api_requests_total",
                 {"route": "/v1/jobs/{job_id}", "method": "GET", "status": "404"}) == 2
    assert value("reflow_api_requests_total",
                 {"route": "/v1/jobs", "method": "GET", "status": "401"}) == 1
