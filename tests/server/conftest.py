"""Fixtures for server tests: one colocated engine server per module."""

from __future__ import annotations

import pytest

from tests.server.helpers import ServerThread, demo_engine_args


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cache_dir = tmp_path_factory.mktemp("cache")
    thread = ServerThread(demo_engine_args(cache_dir, kv_cache_memory=64 << 20, max_model_len=512))
    thread.cache_dir = cache_dir
    yield thread
    thread.close()
