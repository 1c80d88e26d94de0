"""Engine-server behaviour that needs a server of its own: API keys, and a core process that dies."""

from __future__ import annotations

import os
import signal
import time
import urllib.error
import urllib.request

import openai
import pytest

from pdserve.engine.engine_args import EngineArgs
from pdserve.models.demo import ensure_demo_model
from tests.server.helpers import ServerThread


@pytest.fixture
def args(tmp_path_factory) -> EngineArgs:
    return EngineArgs(model=str(ensure_demo_model(tmp_path_factory.mktemp("cache"))), kv_cache_memory=32 << 20,
                      max_model_len=256, device="cpu")


def test_api_key_guards_v1_but_not_health_or_metrics(args):
    server = ServerThread(args, api_key="sekrit")
    try:
        url = server.running.url
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=url + "/v1", api_key="sekrit", max_retries=0)
        assert good.completions.create(model="demo", prompt="hi", max_tokens=2).choices
        for path in ("/health", "/metrics"):
            with urllib.request.urlopen(url + path) as response:
                assert response.status == 200
    finally:
        server.close()


def test_killing_the_core_makes_health_fail_and_requests_503(args):
    server = ServerThread(args)
    try:
        url = server.running.url
        os.kill(server.running.server.client.process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(url + "/health")
            except urllib.error.HTTPError as error:
                assert error.code == 503
                break
            time.sleep(0.05)
        else:
            raise AssertionError("/health kept answering 200 after the core died")
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=10)
        started = time.monotonic()
        with pytest.raises(openai.InternalServerError) as caught:
            client.completions.create(model="demo", prompt="anyone there?", max_tokens=2)
        assert caught.value.status_code == 503 and time.monotonic() - started < 10
    finally:
        server.close()
