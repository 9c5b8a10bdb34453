"""One interceptor (`rpc.ErrorStatus`) answers every error a servicer raises with
its status code, on a real server built by `rpc.make_server`: core errors map to
their codes with their message, a bug is INTERNAL and logged with its traceback,
a status the handler set itself (`context.abort`) stands, and the authorizer's
refusals are its own."""

from __future__ import annotations

import logging

import grpc
import pytest

from reflow import rpc
from reflow.core.errors import FailedPrecondition
from reflow.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from reflow.worker.server import WorkerServicer
from reflow.worker.service import RoleStatus


class Scripted(worker_pb2_grpc.WorkerServicer):
    """GetRole does what its job id says."""

    def __init__(self) -> None:
        self.calls = 0

    def GetRole(self, request, context):
        self.calls += 1
        job = request.job_id
        if job == "bad":
            raise ValueError("drain_timeout_s: must be in (0, 3600], got -1")
        if job == "gone":
            raise KeyError("job 'gone' is not running here")
        if job == "bug":
            raise RuntimeError("boom")
        if job == "late":
            raise FailedPrecondition("job 'late' has finished")
        if job == "denied":
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "not yours")
        if job == "caught":
            try:  # a handler that translates an error itself keeps its translation
                raise KeyError(job)
            except KeyError:
                context.abort(grpc.StatusCode.ABORTED, "try again")
        return worker_pb2.RoleStatus(job_id=job, role="rollout", flips=3)


@pytest.fixture
def scripted():
    servicer = Scripted()
    server, port = rpc.make_server(
        "reflow.v1.Worker", lambda s: worker_pb2_grpc.add_WorkerServicer_to_server(servicer, s),
        "127.0.0.1:0")
    yield servicer, f"127.0.0.1:{port}"
    server.stop(0)


def _get_role(address: str, job_id: str) -> grpc.RpcError:
    with rpc.channel(address) as ch, pytest.raises(grpc.RpcError) as err:
        worker_pb2_grpc.WorkerStub(ch).GetRole(common_pb2.JobRef(job_id=job_id),
                                                timeout=10)
    return err.value


@pytest.mark.parametrize(("job_id", "code", "details"), [
    ("bad", grpc.StatusCode.INVALID_ARGUMENT, "drain_timeout_s: must be in (0, 3600], got -1"),
    ("gone", grpc.StatusCode.NOT_FOUND, "job 'gone' is not running here"),
    ("late", grpc.StatusCode.FAILED_PRECONDITION, "job 'late' has finished"),
    ("bug", grpc.StatusCode.INTERNAL, "RuntimeError: boom"),
])
def test_a_raised_error_is_answered_with_its_code_and_message(scripted, job_id, code, details):
    _, address = scripted
    err = _get_role(address, job_id)
    assert (err.code(), err.details()) == (code, details)


def test_an_internal_error_is_logged_with_its_traceback_and_method(scripted, caplog):
    _, address = scripted
    with caplog.at_level(logging.ERROR, logger="reflow.rpc"):
        _get_role(address, "bug")
    (record,) = [r for r in caplog.records if r.name == "reflow.rpc"]
    assert "/reflow.v1.Worker/GetRole" in record.getMessage()
    assert record.exc_info and isinstance(record.exc_info[1], RuntimeError)


@pytest.mark.parametrize(("job_id", "code", "details"), [
    ("denied", grpc.StatusCode.PERMISSION_DENIED, "not yours"),
    ("caught", grpc.StatusCode.ABORTED, "try again"),
])
def test_a_status_the_handler_set_stands(scripted, job_id, code, details):
    _, address = scripted
    err = _get_role(address, job_id)
    assert (err.code(), err.details()) == (code, details)


def test_a_normal_reply_is_untouched(scripted):
    _, address = scripted
    with rpc.channel(address) as ch:
        call = worker_pb2_grpc.WorkerStub(ch).GetRole.with_call(
            common_pb2.JobRef(job_id="ok"), timeout=10)
    reply, state = call
    assert (reply.job_id, reply.role, reply.flips) == ("ok", "rollout", 3)
    assert state.code() == grpc.StatusCode.OK


def test_a_refused_call_keeps_the_authorizers_code_and_never_reaches_the_handler(scripted):
    servicer, address = scripted
    with grpc.insecure_channel(address) as ch, pytest.raises(grpc.RpcError) as err:
        worker_pb2_grpc.WorkerStub(ch).GetRole(common_pb2.JobRef(job_id="bug"),
                                                timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert servicer.calls == 0


class FakeWorker:
    def set_role(self, job_id, role, drain_timeout_s, hand_back):
        raise ValueError(f"role: {role!r} is not one of rollout, trainer")

    def role(self, job_id):
        return RoleStatus(job_id=job_id, role="trainer", flips=1)


def test_a_real_servicer_raises_and_the_server_maps_it():
    servicer = WorkerServicer(FakeWorker())
    server, port = rpc.make_server(
        "reflow.v1.Worker", lambda s: worker_pb2_grpc.add_WorkerServicer_to_server(servicer, s),
        "127.0.0.1:0")
    try:
        with rpc.channel(f"127.0.0.1:{port}") as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            assert stub.GetRole(common_pb2.JobRef(job_id="j"), timeout=10).role == "trainer"
            with pytest.raises(grpc.RpcError) as err:
                stub.SetRole(worker_pb2.SetRoleRequest(job_id="j", role="judge"), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == "role: 'judge' is not one of rollout, trainer"
    finally:
        server.stop(0)
