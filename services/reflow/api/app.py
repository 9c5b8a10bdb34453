"""The REST API: jobs in, status out. Transport only: it validates the
JobSpec at the edge and forwards to the scheduler through its client.

    POST /v1/jobs          submit a JobSpec            201, 422 on a bad spec
    GET  /v1/jobs          list jobs (newest first)
    GET  /v1/jobs/{id}     one job's status            404 when unknown
    POST /v1/jobs/{id}/stop
    GET  /healthz
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from reflow.core.config import JobSpec
from reflow.core.errors import InvalidArgument, NotFound, Unavailable
from reflow.scheduler.jobs import JobRecord

logger = logging.getLogger(__name__)


class JobStatus(BaseModel):
    job_id: str
    name: str
    phase: str
    reason: str
    step: int
    num_steps: int
    policy_version: int
    reward_mean: float
    trainer_tokens_per_s: float
    created_at: float
    started_at: float
    finished_at: float


def _status(r: JobRecord) -> JobStatus:
    return JobStatus(
        job_id=r.job_id, name=r.name, phase=r.phase, reason=r.reason, step=r.step,
        num_steps=r.num_steps, policy_version=r.policy_version, reward_mean=r.reward_mean,
        trainer_tokens_per_s=r.trainer_tokens_per_s, created_at=r.created_at,
        started_at=r.started_at, finished_at=r.finished_at,
    )


def _field_errors(err: RequestValidationError) -> list[dict[str, Any]]:
    out = []
    for e in err.errors():
        loc = [str(p) for p in e.get("loc", ()) if p != "body"]
        msg = e.get("msg", "")
        if e.get("type") == "extra_forbidden":
            msg = "unknown field; remove it or check its spelling"
        out.append({"field": ".".join(loc) or "(body)", "message": msg})
    return out


def create_app(scheduler) -> FastAPI:
    """`scheduler` is a scheduler client (gRPC, or any object with the same methods)."""
    app = FastAPI(title="ReFlow", version="0.1.0",
                  description="Submit and watch replay-driven RL post-training jobs.")

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        errors = _field_errors(err)
        message = "invalid job spec: " + "; ".join(f"{e['field']}: {e['message']}" for e in errors)
        return JSONResponse(status_code=422, content={"detail": message, "errors": errors})

    def _call(fn, *args):
        try:
            return fn(*args)
        except NotFound as err:
            raise HTTPException(404, str(err)) from None
        except InvalidArgument as err:
            raise HTTPException(422, str(err)) from None
        except Unavailable as err:
            raise HTTPException(503, str(err)) from None

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/jobs", status_code=201, response_model=JobStatus)
    def submit(spec: JobSpec) -> JobStatus:
        return _status(_call(scheduler.submit, spec.model_dump_json()))

    @app.get("/v1/jobs", response_model=list[JobStatus])
    def list_jobs(limit: int = 100) -> list[JobStatus]:
        if not 1 <= limit <= 1000:
            raise HTTPException(422, "limit: must lie in [1, 1000]")
        return [_status(r) for r in _call(scheduler.list, limit)]

    @app.get("/v1/jobs/{job_id}", response_model=JobStatus)
    def get_job(job_id: str) -> JobStatus:
        return _status(_call(scheduler.get, job_id))

    @app.post("/v1/jobs/{job_id}/stop", response_model=JobStatus)
    def stop_job(job_id: str) -> JobStatus:
        return _status(_call(scheduler.stop, job_id))

    return app
