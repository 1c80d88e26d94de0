"""Streams that survive their decode pod (docs/faults.md, "Streams that survive a decode pod"): real router,
prefill and decode processes on 127.0.0.1. A decode pod killed (SIGKILL), stalled (SIGSTOP, past the router's
token deadline) or told to stop (SIGTERM, with --drain-handoff 0: it hands its streams back at once) mid-stream:
the router continues the stream on another decode pod from the tokens the client has, and the client's stream is
whole: one id, no token twice or missing, the text of an uninterrupted run, one usage over the whole generation.
The stalled pod, once it runs again, holds nothing of the abandoned stream. A whole (not streamed) answer broken
by a kill is answered whole by another pod. A killed router: its client gets a connection error, and the engines
free what its legs held."""

from __future__ import annotations

import http.client
import signal
import threading
import time
import urllib.request

import pytest

from pdserve.testing.metrics import idle, metric, scrape
from tests.pd.cluster import Cluster, post, wait_for
from tests.pd.streams import LiveStream

pytestmark = [pytest.mark.timeout(300)]

MAX_TOKENS = 200  # long enough that the test finds the stream running after its first events


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = Cluster.start(
        tmp_path_factory.mktemp("migration"),
        "tcp",
        # One for each kill and drain, the stalled one, and one untouched for the router's last request (a pod
        # stalled past its leases and run again has been seen to end that request's stream at once: the note).
        num_decode=6,
        decode_flags=("--drain-handoff", "0"),
        router_flags=("--token-deadline", "3"),
    )
    yield cluster
    for decode in cluster.decodes:  # a stopped pod must run again to take its SIGTERM
        if decode.process is not None and decode.process.poll() is None:
            decode.process.send_signal(signal.SIGCONT)
    cluster.stop()


def _body(seed: int | None) -> dict:
    sampling = {"temperature": 0.0} if seed is None else {"temperature": 0.8, "top_p": 0.95, "seed": seed}
    return {
        "model": "demo",
        "prompt": "The story of the router and the decode pod that went away:",
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **sampling,
    }


def _router_healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as answer:
            return answer.status == 200
    except OSError:  # 503 (no decode pod up) included
        return False


def _serving_decode(cluster: Cluster):
    """The decode pod running the one request in flight."""
    return wait_for(
        lambda: next((d for d in _alive(cluster) if metric(scrape(d.url), "pdserve_num_requests_running") > 0), None),
        30,
        "no decode pod runs the request",
    )


def _alive(cluster: Cluster):
    return [d for d in cluster.decodes if d.process is not None and d.process.poll() is None]


def _migrations(cluster: Cluster, cause: str) -> float:
    assert cluster.router is not None
    return metric(scrape(cluster.router.url), "pdserve_router_migrations_total", cause=cause)


def _uninterrupted(cluster: Cluster, seed: int | None) -> LiveStream:
    assert cluster.router is not None
    stream = LiveStream(cluster.router.url, _body(seed))
    stream.read_all()
    return stream


def _mid_stream(cluster: Cluster, seed: int | None, cause: str):
    """An uninterrupted run of the request, then the same request through the router, 10 events in; the
    migrations counted so far for ``cause``; and the decode pod running it."""
    assert cluster.router is not None
    reference = _uninterrupted(cluster, seed)
    before = _migrations(cluster, cause)
    stream = LiveStream(cluster.router.url, _body(seed))
    for _ in range(10):
        assert stream.read_event() is not None
    return reference, before, stream, _serving_decode(cluster)


def _assert_whole_like(stream: LiveStream, reference: LiveStream) -> None:
    assert stream.done
    assert len({chunk["id"] for chunk in stream.chunks}) == 1, "one id across the splice"
    assert len({chunk["created"] for chunk in stream.chunks}) == 1
    assert stream.usage["completion_tokens"] == MAX_TOKENS
    assert stream.usage["prompt_tokens"] == reference.usage["prompt_tokens"]
    finishes = [c["finish_reason"] for chunk in stream.chunks for c in chunk["choices"] if c["finish_reason"]]
    assert finishes == ["length"]
    assert stream.text == reference.text


@pytest.mark.parametrize("seed", [None, 7], ids=["greedy", "seeded"])
def test_a_decode_pod_killed_mid_stream_is_not_noticed(cluster, seed):
    reference, before, stream, victim = _mid_stream(cluster, seed, "broken")
    victim.kill()
    stream.read_all()
    _assert_whole_like(stream, reference)
    assert _migrations(cluster, "broken") == before + 1
    for decode in _alive(cluster):
        wait_for(lambda d=decode: idle(scrape(d.url)), 30, f"{decode.name} still holds KV after the migrated stream")


def test_a_whole_answer_broken_by_a_kill_is_answered_by_another_pod(cluster):
    assert cluster.router is not None
    body = {**_body(None), "stream": False, "max_tokens": 700}
    del body["stream_options"]
    status, reference = post(cluster.router.url + "/v1/completions", body)
    assert status == 200, reference
    answer: list = []
    worker = threading.Thread(target=lambda: answer.extend(post(cluster.router.url + "/v1/completions", body)))
    worker.start()
    victim = _serving_decode(cluster)
    victim.kill()
    worker.join(120)
    status, whole = answer
    assert status == 200, whole
    assert whole["choices"][0]["text"] == reference["choices"][0]["text"]
    assert whole["usage"]["completion_tokens"] == 700


def test_a_stalled_decode_pod_is_left_and_frees_the_stream_once_it_runs(cluster):
    reference, before, stream, victim = _mid_stream(cluster, 11, "stall")
    assert victim.process is not None
    victim.process.send_signal(signal.SIGSTOP)
    started = time.monotonic()
    try:
        stream.read_all()
    finally:
        victim.process.send_signal(signal.SIGCONT)
    _assert_whole_like(stream, reference)
    assert time.monotonic() - started < 60
    assert _migrations(cluster, "stall") == before + 1
    # The router closed the stalled leg's connection: once the pod runs again, it aborts the request.
    wait_for(lambda: idle(scrape(victim.url)), 60, "the stalled pod still holds the abandoned stream's KV")


def test_a_draining_decode_pod_hands_its_stream_over_and_exits(cluster):
    reference, before, stream, victim = _mid_stream(cluster, 12, "drain")
    assert victim.process is not None
    victim.process.send_signal(signal.SIGTERM)
    stream.read_all()
    _assert_whole_like(stream, reference)
    assert _migrations(cluster, "drain") == before + 1
    # Its stream gone elsewhere, it has nothing left to wait for: it exits long before its drain timeout.
    assert victim.process.wait(30) == 0


def test_a_killed_router_is_a_connection_error_and_its_legs_are_freed(cluster):
    """The last of the module: the router goes (and comes back for nothing else)."""
    assert cluster.router is not None
    # The decode pods left (the untouched one, the stalled one once its health probe brings it back).
    wait_for(lambda: _router_healthy(cluster.router.url), 30, "no decode pod back in the router's rotation")
    stream = LiveStream(cluster.router.url, _body(None))
    for _ in range(10):
        assert stream.read_event() is not None
    cluster.router.kill()
    with pytest.raises((http.client.IncompleteRead, ConnectionError, AssertionError)):
        stream.read_all()  # never a stream that ends as if whole
    assert not stream.done
    # Its upstream connections closed with it: the engines abort the legs and free their KV.
    for decode in _alive(cluster):
        wait_for(lambda d=decode: idle(scrape(d.url)), 30, f"{decode.name} still holds the orphaned leg's KV")
