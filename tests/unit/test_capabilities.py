"""Signed capabilities (reflow.capabilities) and what each process is given of the
keys (reflow.rpcauth): every way a capability can fail to grant a call, the
nonce book, the audiences a server answers to, and that the docs' table is the
one the Authorizer enforces."""

from __future__ import annotations

import time

import pytest

from reflow import capabilities as caps
from reflow import rpcauth

METHOD = "/reflow.v1.Trainer/StartJob"
HERE = "10.0.0.5:50051"


@pytest.fixture(scope="module")
def keys():
    scheduler, api = caps.new_private_key(), caps.new_private_key()
    return scheduler, api, {"scheduler": scheduler.public_key(), "api": api.public_key()}


def _grant(token, trusted, method=METHOD, audiences=frozenset({HERE}), body=b"req", now=None):
    claims = caps.read(token, trusted)
    caps.check(claims, method, audiences, body, now=now)
    return claims


def test_a_capability_grants_its_call_and_names_its_role(keys):
    scheduler, _, trusted = keys
    token = caps.mint(scheduler, "scheduler", METHOD, HERE, "job-1", b"req")
    claims = _grant(token, trusted)
    assert (claims.role, claims.job_id, claims.audience) == ("scheduler", "job-1", HERE)
    assert claims.expires_at - claims.issued_at == caps.LIFETIME_S


@pytest.mark.parametrize("what", ["key", "role", "method", "audience", "body", "expired",
                                  "future", "tampered", "garbage", "too long"])
def test_each_way_a_capability_does_not_grant_the_call(keys, what):
    scheduler, api, trusted = keys
    now = time.time()
    token = caps.mint(scheduler, "scheduler", METHOD, HERE, "job-1", b"req")
    kwargs = {}
    if what == "key":  # signed by a key nobody trusts
        token = caps.mint(caps.new_private_key(), "scheduler", METHOD, HERE, "", b"req")
    elif what == "role":  # the API's key claiming the scheduler's role
        token = caps.mint(api, "scheduler", METHOD, HERE, "", b"req")
    elif what == "method":
        kwargs["method"] = "/reflow.v1.Worker/SetRole"
    elif what == "audience":
        kwargs["audiences"] = frozenset({"10.0.0.6:50051"})
    elif what == "body":
        kwargs["body"] = b"another request"
    elif what == "expired":
        kwargs["now"] = now + caps.LIFETIME_S + caps.CLOCK_SKEW_S + 1
    elif what == "future":
        token = caps.mint(scheduler, "scheduler", METHOD, HERE, "", b"req", now=now + 600)
    elif what == "tampered":  # the payload changed after signing (another job)
        head, payload, sig = token.split(".")
        forged = caps.mint(scheduler, "scheduler", METHOD, HERE, "job-2", b"req").split(".")[1]
        token = ".".join((head, forged, sig))
        assert payload != forged
    elif what == "garbage":
        token = "v1.bm90IGpzb24.AAAA"
    elif what == "too long":
        token = "v1." + "A" * caps.MAX_TOKEN_CHARS
    with pytest.raises(caps.CapabilityError):
        _grant(token, trusted, **kwargs)


def test_a_nonce_is_spent_once_and_a_released_one_can_be_retried():
    book = caps.NonceBook()
    expires = time.time() + 60
    assert book.claim("n1", expires)
    assert not book.claim("n1", expires)  # a replayed call
    book.release("n1")  # its call failed UNAVAILABLE before changing anything
    assert book.claim("n1", expires)
    # Expired nonces are forgotten once the book grows: it stays bounded.
    for i in range(1100):
        book.claim(f"old{i}", time.time() - 3600)
    assert book.claim("fresh", expires) and len(book._seen) < 1100


def test_a_server_answers_to_its_own_addresses_only(monkeypatch):
    assert rpcauth.own_audiences("127.0.0.11", 7000) == frozenset({"127.0.0.11:7000"})
    monkeypatch.setenv(rpcauth.POD_IP_ENV, "10.1.2.3")
    monkeypatch.setenv(rpcauth.ADVERTISE_HOSTS_ENV, "rl-reflow-replay, rl-reflow-replay.ml")
    wildcard = rpcauth.own_audiences("0.0.0.0", 50052)  # nosec B104 # a name, not a bind
    assert {"10.1.2.3:50052", "rl-reflow-replay:50052", "rl-reflow-replay.ml:50052",
            "localhost:50052"} <= wildcard
    assert "10.1.2.4:50052" not in wildcard and "10.1.2.3:50051" not in wildcard
    assert caps.normal_address("dns:///RL-Reflow-Replay:50052") == "rl-reflow-replay:50052"
    # A worker bound to its pod IP answers to its DNS name too, once advertised; the
    # caller's DNS server (the authority of its target) is no part of the address.
    monkeypatch.setenv(rpcauth.ADVERTISE_HOSTS_ENV, "rl-worker-0.rl-worker.ml.svc.cluster.local")
    assert rpcauth.own_audiences("10.1.2.3", 50060) == frozenset({
        "10.1.2.3:50060", "rl-worker-0.rl-worker.ml.svc.cluster.local:50060"})
    assert caps.normal_address("dns://10.96.0.10:53/RL-Worker-0.rl-worker.ml.svc.cluster.local"
                               ":50060") == "rl-worker-0.rl-worker.ml.svc.cluster.local:50060"


def test_each_process_gets_only_its_own_roles_private_key(monkeypatch):
    for env in (*rpcauth.SIGNING_KEY_ENVS.values(), *rpcauth.PUBLIC_KEY_ENVS.values()):
        monkeypatch.delenv(env, raising=False)
    rpcauth.ensure_local_credentials()
    try:
        scheduler_env = rpcauth.role_env("scheduler")
        service_env = rpcauth.service_env()
        assert scheduler_env["REFLOW_API_SIGNING_KEY"] == ""
        assert "REFLOW_SCHEDULER_SIGNING_KEY" not in scheduler_env  # inherited as it is
        assert rpcauth.role_env("api")["REFLOW_SCHEDULER_SIGNING_KEY"] == ""
        for env in rpcauth.SIGNING_KEY_ENVS.values():
            assert service_env[env] == service_env[f"{env}_FILE"] == ""
        for role, env in rpcauth.PUBLIC_KEY_ENVS.items():
            public = caps.load_public_key(service_env[env], env)
            assert caps.public_pem(public) == caps.public_pem(
                rpcauth.credentials().signing[role])
            assert "PRIVATE" not in service_env[env]
    finally:
        rpcauth.reset_credentials()


def test_the_docs_table_is_the_one_enforced():
    from reflow.docgen import authz as docs

    page = docs.rpc_page()
    assert rpcauth.authorization_markdown() in page
    rows = rpcauth.authorization_rows()
    for method, who, _ in rows:  # every method the Authorizer knows, as it decides
        assert f"| `{method}` | {who} |" in page
    assert len(rows) >= 33
    assert ("Worker.SetRole", "the scheduler (capability)",
            "flips a worker between trainer and rollout") in rows
