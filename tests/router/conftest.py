"""Fixtures for router tests: one background event loop, and per test the stubs and routers it starts."""

from __future__ import annotations

import pytest

from tests.router.helpers import Cluster, LoopThread


@pytest.fixture(scope="session")
def loop():
    thread = LoopThread()
    yield thread
    thread.close()


@pytest.fixture
def cluster(loop):
    started = Cluster(loop)
    yield started
    started.close()
