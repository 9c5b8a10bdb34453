"""A compromised ReFlow process, for test_security_grpc_auth: started with exactly
the environment a service of its role gets (`rpcauth.role_env`), it listens like a
rollout worker and records every call the scheduler makes to it (metadata and
request bytes), then uses everything it holds against the cluster.

    python -m tests.integration.hostile_process DIR

It writes DIR/port once listening; when DIR/targets.json appears
({"addresses": {service: address}, "job": id, "other_job": id}) it attacks, and
writes DIR/attempts.json: one row per call, {what, method, code}, plus what it
found in its environment.
"""

from __future__ import annotations

import json
import os
import sys
import time
from concurrent import futures
from pathlib import Path

import grpc
from google.protobuf import message_factory

from reflow import capabilities
from reflow.v1 import (common_pb2, replay_pb2, rollout_pb2, scheduler_pb2, trainer_pb2,
                       worker_pb2)

PROTO_MODULES = (common_pb2, replay_pb2, rollout_pb2, scheduler_pb2, trainer_pb2, worker_pb2)
CREDENTIAL_KEY, CAPABILITY_KEY, TOKEN_KEY = ("x-reflow-credential", "x-reflow-capability",
                                             "x-reflow-job-token")


def every_rpc():
    for module in PROTO_MODULES:
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                yield service.full_name, method


class Recorder(grpc.GenericRpcHandler):
    """Answers every call with an empty message and keeps what came with it."""

    def __init__(self) -> None:
        self.seen: list[dict] = []

    def service(self, details):
        metadata = dict(details.invocation_metadata or ())
        method = details.method

        def answer(raw: bytes, _context) -> bytes:
            self.seen.append({"method": method, "metadata": metadata, "body": raw})
            return b""

        return grpc.unary_unary_rpc_method_handler(answer)


def _request(method, job_id: str):
    cls = message_factory.GetMessageClass(method.input_type)
    fields = {f.name for f in method.input_type.fields}
    return cls(job_id=job_id) if "job_id" in fields else cls()


def _call(address: str, name: str, body: bytes, metadata: list) -> str:
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(name, request_serializer=None, response_deserializer=None)
        try:
            call(body, metadata=metadata, timeout=10)
        except grpc.RpcError as err:
            return err.code().name
    return "OK"


def attack(targets: dict, seen: list[dict]) -> list[dict]:
    credential = os.environ.get("REFLOW_GRPC_CREDENTIAL", "")
    captured = [s for s in seen if CAPABILITY_KEY in s["metadata"]]
    tokens = {s["metadata"][TOKEN_KEY] for s in seen if TOKEN_KEY in s["metadata"]}
    token = next(iter(tokens), "")
    own_keys = {}  # a signing key this process was given, if any (the API's)
    for role in ("api", "scheduler"):
        pem = os.environ.get(f"REFLOW_{role.upper()}_SIGNING_KEY", "")
        if pem:
            own_keys[role] = capabilities.load_private_key(pem, role)
    made_up = capabilities.new_private_key()
    from reflow import rpcauth

    callers = rpcauth.job_callers(rpcauth.SERVICES)
    held_role = capabilities.read_pass(token, rpcauth.credentials().trusted["scheduler"]).role \
        if token else ""
    attempts = []

    def attempt(what: str, address: str, name: str, body: bytes, metadata: list) -> None:
        attempts.append({"what": what, "method": name, "address": address,
                         "code": _call(address, name, body, [(CREDENTIAL_KEY, credential),
                                                             *metadata])})

    for service, method in every_rpc():
        address = targets["addresses"][service]
        name = f"/{service}/{method.name}"
        if service == "reflow.v1.Scheduler" and "api" in own_keys:
            continue  # the API administers jobs: that is its role
        own = _request(method, targets["job"]).SerializeToString()
        other = _request(method, targets["other_job"]).SerializeToString()
        nameless = _request(method, "").SerializeToString()
        token_md = [(TOKEN_KEY, token)] if token else []
        # The other job, with the token this process holds.
        if other != nameless:
            attempt("another job with its own token", address, name, other, token_md)
        # Job A with its own pass, on what the pass's role may not call (the buffer's
        # Configure and PublishVersion, a weight update, a trainer group's join).
        if own != nameless and name in callers and held_role not in callers[name]:
            attempt(f"job A as a {held_role}", address, name, own, token_md)
        # A call naming no job: the scheduler's only.
        attempt("no job named", address, name, nameless, token_md)
        # Every capability it received, sent on: as it came (same body), and on this call.
        for n, got in enumerate(captured):
            md = [(CAPABILITY_KEY, got["metadata"][CAPABILITY_KEY]), *token_md]
            if got["method"] == name:
                attempt(f"received capability {n} replayed elsewhere", address, name,
                        got["body"], md)
            attempt(f"received capability {n} on {method.name}", address, name, own, md)
        # Capabilities it signs itself: with a key it made up, and with any it holds.
        for role in ("scheduler", "api"):
            forged = capabilities.mint(made_up, role, name, address, targets["job"], own)
            attempt(f"made-up key as {role}", address, name, own,
                    [(CAPABILITY_KEY, forged), *token_md])
            for own_role, key in own_keys.items():
                signed = capabilities.mint(key, role, name, address, targets["job"], own)
                attempt(f"its {own_role} key claiming {role}", address, name, own,
                        [(CAPABILITY_KEY, signed), *token_md])
                signed = capabilities.mint(key, own_role, name, address, targets["job"], own)
                attempt(f"its {own_role} key as itself", address, name, own,
                        [(CAPABILITY_KEY, signed), *token_md])
    return attempts


def main() -> int:
    out = Path(sys.argv[1])
    recorder = Recorder()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), handlers=[recorder])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    (out / "port.tmp").write_text(str(port))
    (out / "port.tmp").rename(out / "port")
    deadline = time.monotonic() + 300
    while not (out / "targets.json").exists():
        if time.monotonic() > deadline:
            return 2
        time.sleep(0.1)
    targets = json.loads((out / "targets.json").read_text())
    environ = Path("/proc/self/environ").read_bytes()
    attempts = attack(targets, recorder.seen)
    report = {
        "attempts": attempts,
        "received": [{"method": s["method"], "keys": sorted(s["metadata"])}
                     for s in recorder.seen],
        "private_key_in_environment": b"PRIVATE KEY" in environ
        or any("PRIVATE KEY" in v for v in os.environ.values()),
        "signing_keys": sorted(k for k in os.environ if k.endswith("_SIGNING_KEY")
                               and os.environ[k]),
    }
    (out / "attempts.tmp").write_text(json.dumps(report))
    (out / "attempts.tmp").rename(out / "attempts.json")
    server.stop(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
