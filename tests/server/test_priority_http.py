"""An engine server scheduling by priority, through HTTP: the router's fairness mark (``X-PDServe-Ahead``) puts a
request before the others of its priority, preempting the running one, while an unmarked one of the same priority
waits its turn. One seat (``max_num_seqs`` 1), so the order of the answers is the order of the scheduling."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import time
import urllib.request

import pytest

from tests.server.helpers import ServerThread, demo_engine_args


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    args = demo_engine_args(tmp_path_factory.mktemp("cache"), max_model_len=512)
    thread = ServerThread(dataclasses.replace(args, scheduling_policy="priority", max_num_seqs=1))
    yield thread
    thread.close()


def _complete(url: str, max_tokens: int, headers: dict[str, str]) -> float:
    """Send a greedy completion; when its answer came (monotonic)."""
    body = {"prompt": "one two three", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    request = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json", **headers}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        assert json.load(response)["usage"]["completion_tokens"] == max_tokens
    return time.monotonic()


def _running(url: str, count: int) -> bool:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    return any(
        line.startswith("vllm:num_requests_running") and line.endswith(f" {count}.0") for line in text.splitlines()
    )


def test_a_request_marked_ahead_preempts_its_priority_and_an_unmarked_one_waits(server):
    url = server.running.url
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        long = pool.submit(_complete, url, 400, {})
        deadline = time.monotonic() + 60
        while not _running(url, 1):
            assert time.monotonic() < deadline and not long.done()
            time.sleep(0.02)
        plain = pool.submit(_complete, url, 4, {})
        time.sleep(0.2)  # queued behind the long one
        marked = pool.submit(_complete, url, 4, {"X-PDServe-Ahead": "1"})
        assert not long.done()
        finished = {"long": long.result(), "plain": plain.result(), "marked": marked.result()}
    assert sorted(finished, key=finished.__getitem__) == ["marked", "long", "plain"]
