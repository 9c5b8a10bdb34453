"""The REST API: jobs in, status, logs and metrics out. Transport only: it
authenticates, validates the JobSpec at the edge and forwards to the
scheduler through its client. Jobs live in the scheduler's Redis job store,
so restarting the API loses nothing.

    POST /v1/jobs                    submit a JobSpec (+ optional submission_id)
    GET  /v1/jobs                    one page of jobs, newest first
    GET  /v1/jobs/{id}               one job's status
    POST /v1/jobs/{id}/stop          stop a job
    POST /v1/jobs/{id}/resume        continue a stopped or failed job from its checkpoint
    GET  /v1/jobs/{id}/logs          its services' logs (text)
    GET  /v1/jobs/{id}/metrics       its per-step training metrics
    GET  /healthz, /openapi.json, /docs   open, no token

Every /v1 route wants `Authorization: Bearer <token>`. The API refuses to
start without a token unless it is explicitly told to run open
(`insecure_no_auth`, logged loudly at start).
"""

from __future__ import annotations

import hmac
import logging
import os
from pathlib import Path
from typing import Any, Literal

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CollectorRegistry
from pydantic import BaseModel, ConfigDict, Field, model_validator

from reflow.api.middleware import BearerAuth, BodySizeLimit, JsonBody, RequestMetrics
from reflow.core.config import JobSpec
from reflow.core.errors import (
    Conflict, FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted, Unavailable,
)
from reflow.scheduler.jobcontrol.jobs import LOG_SERVICES, JobRecord

logger = logging.getLogger(__name__)

SUBMISSION_ID_PATTERN = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
MIN_TOKEN_CHARS = 16


class ApiSettings(BaseModel):
    """How the API runs; read from the environment by `reflow serve api`."""

    model_config = ConfigDict(extra="forbid")

    token: str = Field(default="", max_length=4096,
                       description="Bearer token every /v1 call must carry. Required unless "
                       "insecure_no_auth.")
    insecure_no_auth: bool = Field(default=False,
                                   description="Serve /v1 with no token at all: anyone who "
                                   "reaches the port can run jobs. Tests on loopback only.")
    max_body_bytes: int = Field(default=1 << 20, ge=1024, le=64 << 20,
                                description="Largest request body accepted (413 above).")

    @model_validator(mode="after")
    def _auth_is_on(self) -> "ApiSettings":
        if not self.token and not self.insecure_no_auth:
            raise ValueError("token: no API token; set REFLOW_API_TOKEN_FILE (a mounted Secret) "
                             "or REFLOW_API_TOKEN, or start with --insecure-no-auth to serve "
                             "/v1 unauthenticated on a private loopback")
        if self.token and len(self.token) < MIN_TOKEN_CHARS:
            raise ValueError(f"token: {len(self.token)} characters; use at least "
                             f"{MIN_TOKEN_CHARS} random characters")
        return self

    @classmethod
    def from_env(cls, insecure_no_auth: bool = False) -> "ApiSettings":
        """REFLOW_API_TOKEN_FILE (a mounted Secret) wins over REFLOW_API_TOKEN."""
        token = os.environ.get("REFLOW_API_TOKEN", "")
        token_file = os.environ.get("REFLOW_API_TOKEN_FILE")
        if token_file:
            token = Path(token_file).read_text().strip()
        raw_limit = os.environ.get("REFLOW_API_MAX_BODY_BYTES")
        # pydantic parses the string, so a bad value is reported as max_body_bytes.
        return cls(token=token, insecure_no_auth=insecure_no_auth,
                   **({"max_body_bytes": raw_limit} if raw_limit else {}))


class JobSubmission(JobSpec):
    """A JobSpec plus an optional client-chosen id. Resubmitting the same spec under
    the same submission_id returns the existing job (200) instead of starting a
    second one; a different spec under it is 409."""

    submission_id: str | None = Field(
        default=None, pattern=SUBMISSION_ID_PATTERN, max_length=63,
        description="Idempotency key and job id: 1-63 lowercase letters, digits, '-'.")


class JobStatus(BaseModel):
    job_id: str
    name: str
    phase: str = Field(description="PENDING | RUNNING | SUCCEEDED | FAILED | STOPPED")
    reason: str
    step: int
    num_steps: int
    policy_version: int
    reward_mean: float
    trainer_tokens_per_s: float
    created_at: float = Field(description="Unix seconds.")
    started_at: float = Field(description="Unix seconds; 0 before the job starts.")
    finished_at: float = Field(description="Unix seconds; 0 until the job ends.")
    workers: dict[str, list[str]] = Field(
        default_factory=dict, description="The job's workers by role (trainer, rollout); an "
        "elastic job's change as roles flip.")


class FlipRequest(BaseModel):
    """Move one worker of an elastic job to a role, at the next sync boundary."""

    model_config = ConfigDict(extra="forbid")

    worker: int = Field(ge=1, le=4095, description="Worker index (worker-N); 0 holds trainer "
                        "rank 0 and keeps it.")
    role: Literal["rollout", "trainer"]


class FlipAccepted(BaseModel):
    job_id: str
    worker: int
    role: str
    queued_before: int = Field(description="Flips queued ahead of this one.")


class JobPage(BaseModel):
    jobs: list[JobStatus]
    next_page_token: str = Field(description="Pass as page_token for the next page; "
                                 "empty on the last page.")


class JobMetrics(BaseModel):
    job_id: str
    records: list[dict[str, Any]] = Field(description="One record per training step, in order.")
    next_since_step: int = Field(description="Pass as since_step to get the steps after these.")


class FieldError(BaseModel):
    field: str = Field(description="Dotted path of the offending field, e.g. trainer.batch_size.")
    message: str


class ApiError(BaseModel):
    """Every error response: a message that names the field and the fix."""

    detail: str
    errors: list[FieldError] = Field(default_factory=list, description="Per-field detail (422).")


_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ApiError, "description": "Missing or wrong bearer token."},
    413: {"model": ApiError, "description": "Request body over the size limit."},
    415: {"model": ApiError, "description": "Request body not sent as application/json."},
    422: {"model": ApiError, "description": "Invalid request; the message names the field."},
    429: {"model": ApiError, "description": "Too many active jobs (an operator ceiling); "
          "retry after Retry-After seconds."},
    503: {"model": ApiError, "description": "Scheduler unreachable; retry."},
}
_NOT_FOUND: dict[int | str, dict[str, Any]] = {404: {"model": ApiError, "description": "No such job."}}


def _status(r: JobRecord) -> JobStatus:
    return JobStatus(
        job_id=r.job_id, name=r.name, phase=r.phase, reason=r.reason, step=r.step,
        num_steps=r.num_steps, policy_version=r.policy_version, reward_mean=r.reward_mean,
        trainer_tokens_per_s=r.trainer_tokens_per_s, created_at=r.created_at,
        started_at=r.started_at, finished_at=r.finished_at, workers=r.workers,
    )


def _field_errors(err: RequestValidationError) -> list[dict[str, Any]]:
    out = []
    for e in err.errors():
        loc = [str(p) for p in e.get("loc", ()) if p != "body"]
        msg = e.get("msg", "")
        field = ".".join(loc) or "(body)"
        if e.get("type") == "json_invalid":
            # Its location is a character offset into the body, not a field.
            field = "(body)"
            msg = f"not valid JSON ({e.get('ctx', {}).get('error', msg)}) at character {loc[0]}" \
                if loc else "not valid JSON"
        elif e.get("type") == "missing" and field == "(body)":
            msg = "empty; send a JSON object"
        elif field == "(body)" and e.get("type") in ("model_attributes_type", "dict_type"):
            msg = "not a JSON object; send one" \
                if e.get("input") is not None else "empty; send a JSON object"
        elif e.get("type") == "extra_forbidden":
            msg = "unknown field; remove it or check its spelling"
        elif e.get("type") == "value_error":
            # Our validators name the exact field first ("replay.sampler: ...").
            msg = msg.removeprefix("Value error, ")
            named, sep, rest = msg.partition(": ")
            if sep and named.startswith(field + ".") and " " not in named:
                field, msg = named, rest
        out.append({"field": field, "message": msg})
    return out


def _call(fn, *args):
    """Scheduler errors to HTTP statuses."""
    try:
        return fn(*args)
    except NotFound as err:
        raise HTTPException(404, str(err)) from None
    except (Conflict, FailedPrecondition) as err:
        raise HTTPException(409, str(err)) from None
    except (InvalidArgument, ValueError) as err:
        raise HTTPException(422, str(err)) from None
    except ResourceExhausted as err:
        raise HTTPException(429, str(err), headers={"Retry-After": "30"}) from None
    except Unavailable as err:
        raise HTTPException(503, str(err), headers={"Retry-After": "5"}) from None


def _auth_dependency(token: str):
    bearer = HTTPBearer(auto_error=False, description="The API token (REFLOW_API_TOKEN).")

    def require_token(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if not token:  # insecure_no_auth, refused by ApiSettings otherwise
            return
        if credentials is None or credentials.scheme.lower() != "bearer":
            raise HTTPException(401, "missing bearer token; send 'Authorization: Bearer <token>'",
                                headers={"WWW-Authenticate": 'Bearer realm="reflow"'})
        if not hmac.compare_digest(credentials.credentials.encode(), token.encode()):
            raise HTTPException(401, "invalid bearer token",
                                headers={"WWW-Authenticate": 'Bearer realm="reflow", '
                                                             'error="invalid_token"'})

    return require_token


def create_app(scheduler, settings: ApiSettings,
               registry: CollectorRegistry | None = None) -> FastAPI:
    """`scheduler` is a scheduler client (gRPC, or the in-process Scheduler core:
    both have the same methods). `settings` carry the token (or the explicit
    insecure_no_auth)."""
    if settings.insecure_no_auth and not settings.token:
        for line in ("*" * 72,
                     "INSECURE: the API serves /v1 with NO AUTHENTICATION (--insecure-no-auth).",
                     "Anyone who reaches this port can submit and stop jobs. Use this on a",
                     "private loopback only; set REFLOW_API_TOKEN_FILE everywhere else.",
                     "*" * 72):
            logger.critical(line)
    app = FastAPI(title="ReFlow", version="0.1.0",
                  description="Submit and watch replay-driven RL post-training jobs.")
    # The last added runs first: metrics see every request, then the token is
    # checked before the body is read (401 before 413, 415 or 422), then its size,
    # then that it is JSON.
    app.add_middleware(JsonBody)
    app.add_middleware(BodySizeLimit, max_body_bytes=settings.max_body_bytes)
    app.add_middleware(BearerAuth, token=settings.token)
    app.add_middleware(RequestMetrics, registry=registry or CollectorRegistry(),
                       router=app.router)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        errors = _field_errors(err)
        message = "invalid request: " + "; ".join(f"{e['field']}: {e['message']}" for e in errors)
        return JSONResponse(status_code=422, content={"detail": message, "errors": errors})

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_auth_dependency(settings.token))],
                   responses=_ERRORS)

    @v1.post("/jobs", status_code=201, response_model=JobStatus,
             responses={200: {"model": JobStatus, "description": "Same submission_id and spec "
                              "as an existing job: that job."},
                        409: {"model": ApiError,
                              "description": "submission_id taken by a different spec."}})
    def submit(submission: JobSubmission, response: Response) -> JobStatus:
        spec_json = submission.model_dump_json(exclude={"submission_id"})
        record, created = _call(scheduler.submit, spec_json, submission.submission_id or "")
        if not created:
            response.status_code = 200
        return _status(record)

    @v1.get("/jobs", response_model=JobPage)
    def list_jobs(limit: int = Query(100, ge=1, le=1000),
                  page_token: str = Query("", max_length=32)) -> JobPage:
        records, token = _call(scheduler.list, limit, page_token)
        return JobPage(jobs=[_status(r) for r in records], next_page_token=token)

    @v1.get("/jobs/{job_id}", response_model=JobStatus, responses=_NOT_FOUND)
    def get_job(job_id: str) -> JobStatus:
        return _status(_call(scheduler.get, job_id))

    @v1.post("/jobs/{job_id}/stop", response_model=JobStatus, responses=_NOT_FOUND)
    def stop_job(job_id: str) -> JobStatus:
        return _status(_call(scheduler.stop, job_id))

    @v1.post("/jobs/{job_id}/resume", response_model=JobStatus,
             responses={**_NOT_FOUND, 409: {"model": ApiError, "description": "The job is "
                                             "active or succeeded, or has no committed "
                                             "checkpoint to resume from."}})
    def resume_job(job_id: str) -> JobStatus:
        return _status(_call(scheduler.resume, job_id))

    @v1.post("/jobs/{job_id}/flips", status_code=202, response_model=FlipAccepted,
             responses={**_NOT_FOUND, 409: {"model": ApiError, "description": "The job is not "
                                             "running elastic, or the flip is not possible now "
                                             "(the worker has that role already, or no rollout "
                                             "worker would be left)."}})
    def request_flip(job_id: str, flip: FlipRequest) -> FlipAccepted:
        queued = _call(scheduler.request_flip, job_id, flip.worker, flip.role)
        return FlipAccepted(job_id=job_id, worker=flip.worker, role=flip.role,
                            queued_before=queued)

    @v1.get("/jobs/{job_id}/logs", response_class=Response,
            responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                             "description": "The log tail(s), as text."}, **_NOT_FOUND})
    def job_logs(job_id: str,
                 service: str = Query("", description=f"one of {', '.join(LOG_SERVICES)}; all if empty"),
                 tail_bytes: int = Query(65536, ge=1, le=8 << 20)) -> PlainTextResponse:
        logs = _call(scheduler.logs, job_id, service, tail_bytes)
        if service:
            return PlainTextResponse(logs[0].text if logs else "")
        return PlainTextResponse("".join(f"==> {l.service} <==\n{l.text}\n" for l in logs))

    @v1.get("/jobs/{job_id}/metrics", response_model=JobMetrics, responses=_NOT_FOUND)
    def job_metrics(job_id: str, since_step: int = Query(0, ge=0, le=2**62),
                    limit: int = Query(1000, ge=1, le=10_000)) -> JobMetrics:
        records = _call(scheduler.metrics, job_id, since_step, limit)
        last = int(records[-1]["step"]) if records else since_step
        return JobMetrics(job_id=job_id, records=records, next_since_step=last)

    app.include_router(v1)
    return app
