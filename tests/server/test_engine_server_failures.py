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
from tests.server.helpers import ServerThread, demo_engine_args


@pytest.fixture
def args(tmp_path_factory) -> EngineArgs:
    return demo_engine_args(tmp_path_factory.mktemp("cache"))


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


def _open_stream(url: str, max_tokens: int = 200):
    """A streaming completion whose first bytes have arrived (the request is running)."""
    import http.client
    import json
    from urllib.parse import urlparse

    parts = urlparse(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    connection.request(
        "POST",
        "/v1/completions",
        json.dumps(
            {"model": "demo", "prompt": "tell me more", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        ),
        {"Content-Type": "application/json"},
    )
    response = connection.getresponse()
    assert response.status == 200
    response.read1(16)
    return connection, response


def _completion(url: str, **body) -> tuple[int, dict[str, str], dict]:
    import json

    payload = json.dumps({"model": "demo", "prompt": "hi", "max_tokens": 2, **body}).encode()
    request = urllib.request.Request(
        url + "/v1/completions", headers={"Content-Type": "application/json"}, data=payload
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), json.loads(error.read())


def test_overload_is_refused_with_503_and_retry_after(args):
    from pdserve.server.app import ServerLimits

    server = ServerThread(args, limits=ServerLimits(max_in_flight=2, retry_after=3))
    try:
        url = server.running.url
        streams = [_open_stream(url) for _ in range(2)]
        status, headers, body = _completion(url)
        assert status == 503 and headers["Retry-After"] == "3" and "overloaded" in body["error"]["message"]
        for connection, _ in streams:
            connection.close()  # the two leave: their requests are aborted, room comes back
        deadline = time.monotonic() + 20
        while _completion(url)[0] != 200:
            assert time.monotonic() < deadline, "the server never took requests again"
            time.sleep(0.1)
    finally:
        server.close()


def test_a_request_past_its_timeout_is_aborted_with_504(args):
    from pdserve.server.app import ServerLimits

    # 250 tokens take several times 0.05 s on any CPU (0.3 s against 200 was beaten once the threads spun).
    server = ServerThread(args, limits=ServerLimits(request_timeout=0.05))
    try:
        url = server.running.url
        started = time.monotonic()
        status, _, body = _completion(url, max_tokens=250, ignore_eos=True)
        assert status == 504 and body["error"]["type"] == "timeout" and time.monotonic() - started < 10
        deadline = time.monotonic() + 10
        client = server.running.server.client
        # Stats come with the core's outputs or once a second: none may have come in the request's 0.05 s.
        while client.num_in_flight or client.stats is None or client.stats.kv_cache_usage:
            assert time.monotonic() < deadline, "the timed-out request kept running"
            time.sleep(0.1)
    finally:
        server.close()


def test_drain_refuses_new_work_and_lets_running_streams_finish(args):
    import asyncio
    import threading

    server = ServerThread(args)
    try:
        url = server.running.url
        connection, response = _open_stream(url, max_tokens=150)
        received: list[bytes] = []
        reader = threading.Thread(target=lambda: received.append(response.read()))
        reader.start()
        future = asyncio.run_coroutine_threadsafe(server.running.drain(30), server.loop)
        time.sleep(0.2)
        status, headers, body = _completion(url)
        assert status == 503 and "shutting down" in body["error"]["message"] and headers["Retry-After"] == "1"
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(url + "/health")
        assert caught.value.code == 503
        assert future.result(30) is True
        reader.join(30)
        assert received and received[0].rstrip().endswith(b"data: [DONE]")  # the stream ran to its end
        connection.close()
    finally:
        server.close()


def test_a_client_that_stops_reading_holds_up_nobody(args):
    """A stream whose reader never reads (a tiny receive buffer, full at once) must not stall the event
    loop: other requests and /health answer as usual meanwhile."""
    import json
    import socket
    from urllib.parse import urlparse

    server = ServerThread(args)
    url = urlparse(server.running.url)
    stalled = socket.create_connection((url.hostname, url.port))
    try:
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        body = json.dumps(
            {"model": "demo", "prompt": "go on", "max_tokens": 200, "ignore_eos": True, "stream": True, "n": 4}
        ).encode()
        stalled.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        for _ in range(5):
            started = time.monotonic()
            status, _, answer = _completion(server.running.url, max_tokens=8)
            assert status == 200 and time.monotonic() - started < 10, answer
            with urllib.request.urlopen(server.running.url + "/health", timeout=5) as response:
                assert response.status == 200
    finally:
        stalled.close()  # the stalled request is aborted with its connection
        server.close()
