"""Fixtures for server tests: one colocated engine server per module."""

from __future__ import annotations

import pytest

from pdserve.engine.engine_args import EngineArgs
from pdserve.models.demo import ensure_demo_model
from tests.server.helpers import ServerThread


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cache_dir = tmp_path_factory.mktemp("cache")
    model = str(ensure_demo_model(cache_dir))
    thread = ServerThread(EngineArgs(model=model, kv_cache_memory=64 << 20, max_model_len=512, device="cpu"))
    thread.cache_dir = cache_dir
    yield thread
    thread.close()
