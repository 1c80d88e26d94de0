"""A decode engine that refuses a decode leg for now (503: overloaded or draining) leaves the prefill
engine's blocks held: the router retries such a refusal on another decode engine with the same
params, which must still be able to pull them. (Before, the refusal told prefill to free, and the
retry's pull always failed: prefill work lost exactly under overload.)"""

from __future__ import annotations

import threading

import pytest

from pdserve.testing.metrics import metric, scrape
from tests.pd.cluster import Cluster, post, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# Each decode engine takes one request at a time; pulls wait 3 s, so a first request keeps one busy.
DECODE_FLAGS = ("--max-pending-requests", "1")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = Cluster.start(
        tmp_path_factory.mktemp("retry"), "tcp", num_decode=2, decode_flags=DECODE_FLAGS, decode_faults="delay_load=3"
    )
    yield cluster
    cluster.stop()


def _body(prompt: str, **extra) -> dict:
    return {"model": "demo", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, **extra}


def _prefill_leg(cluster: Cluster, prompt: str) -> dict:
    status, leg = post(
        cluster.prefills[0].url + "/v1/completions",
        _body(prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True}),
    )
    assert status == 200, leg
    return leg["kv_transfer_params"]


def test_a_decode_leg_refused_with_503_can_still_pull_elsewhere(cluster):
    busy, spare = cluster.decodes[0].url, cluster.decodes[1].url
    prompt = "refused for now, served elsewhere: " + " ".join(f"word{i}" for i in range(60))
    status, reference = post(cluster.prefills[0].url + "/v1/completions", _body(prompt))  # computed there
    assert status == 200
    busy_prompt = "keeps the first decode engine busy " * 8
    first = _prefill_leg(cluster, busy_prompt)
    thread = threading.Thread(
        target=post, args=(busy + "/v1/completions", _body(busy_prompt, kv_transfer_params=first))
    )
    thread.start()
    try:
        wait_for(
            lambda: metric(scrape(busy), "pdserve_num_requests_waiting_for_remote_kv") == 1, 20, "the first to wait"
        )
        params = _prefill_leg(cluster, prompt)
        status, answer = post(busy + "/v1/completions", _body(prompt, kv_transfer_params=params))
        assert status == 503, answer  # overloaded: one request in flight already
        before = scrape(spare)
        status, answer = post(spare + "/v1/completions", _body(prompt, kv_transfer_params=params))
        assert status == 200 and answer["choices"][0]["text"] == reference["choices"][0]["text"]
        after = scrape(spare)
        failures, moved = "pdserve_kv_transfer_failures_total", "pdserve_kv_transfer_bytes_total"
        assert metric(after, failures) == metric(before, failures)
        assert metric(after, moved) > metric(before, moved)  # pulled, not recomputed
    finally:
        thread.join(60)
