"""P/D races staged with the fault hook (PDSERVE_KV_FAULTS) on real prefill and decode processes.
The test drives both legs itself (as the router would), so each stage can be held and broken.

The decode engine here delays every pull by 5 s, longer than the prefill's 3 s lease: requests
sit in WAITING_FOR_REMOTE_KVS, and only lease renewal keeps their blocks alive.
"""

from __future__ import annotations

import http.client
import json
import signal
import threading
from urllib.parse import urlparse

import pytest

from pdserve.testing.metrics import metric, scrape
from tests.pd.cluster import Cluster, post, wait_for

pytestmark = pytest.mark.timeout(600)

LEASE_S = 3
DELAY_S = 5


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = Cluster.start(
        tmp_path_factory.mktemp("pd-faults"),
        with_router=False,
        prefill_flags=("--kv-lease-seconds", str(LEASE_S)),
        decode_flags=("--kv-transfer-timeout", "3"),
        decode_faults=f"delay_load={DELAY_S}",
    )
    yield cluster
    cluster.stop()


def _body(prompt: str, **extra) -> dict:
    return {"model": "demo", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True} | extra


def _prefill_leg(cluster: Cluster, prompt: str) -> dict:
    status, answer = post(
        cluster.prefills[0].url + "/v1/completions", _body(prompt, kv_transfer_params={"do_remote_decode": True})
    )
    assert status == 200, answer
    params = answer["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_block_ids"]
    return params


def _reference(cluster: Cluster, prompt: str) -> str:
    """The colocated answer: the prefill engine computing the whole request itself."""
    status, answer = post(cluster.prefills[0].url + "/v1/completions", _body(prompt))
    assert status == 200, answer
    return answer["choices"][0]["text"]


def _held(cluster: Cluster) -> float:
    return metric(scrape(cluster.prefills[0].url), "pdserve_kv_blocks_held_for_remote")


def _prompt(tag: str) -> str:
    return f"{tag}: " + " ".join(f"word{i}" for i in range(60))  # well over 8 blocks of 16 tokens


def test_lease_renewal_keeps_blocks_while_the_request_waits_on_decode(cluster):
    prompt = _prompt("renewal")
    expected = _reference(cluster, prompt)
    params = _prefill_leg(cluster, prompt)
    status, answer = post(cluster.decodes[0].url + "/v1/completions", _body(prompt, kv_transfer_params=params))
    assert status == 200 and answer["choices"][0]["text"] == expected
    decode, prefill = scrape(cluster.decodes[0].url), scrape(cluster.prefills[0].url)
    assert decode["pdserve_kv_transfer_failures_total"] == 0, "the blocks outlived the 3 s lease only by renewal"
    assert decode["pdserve_kv_transfer_bytes_total"] > 0
    assert prefill["pdserve_kv_lease_expirations_total"] == 0
    wait_for(lambda: _held(cluster) == 0, 10, "prefill still holds blocks after the pull")


def test_decode_abort_before_the_pull_frees_prefill_by_notification(cluster):
    params = _prefill_leg(cluster, _prompt("abort"))
    wait_for(lambda: _held(cluster) > 0, 10, "prefill does not report its held blocks")
    url = urlparse(cluster.decodes[0].url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    connection.request(
        "POST",
        "/v1/completions",
        json.dumps(_body(_prompt("abort"), stream=True, kv_transfer_params=params)),
        {"Content-Type": "application/json"},
    )
    assert connection.getresponse().status == 200
    wait_for(
        lambda: scrape(cluster.decodes[0].url).get("pdserve_num_requests_waiting_for_remote_kv") == 1,
        10,
        "the decode request never waited for its pull",
    )
    connection.close()  # the client leaves while the pull has not started
    wait_for(lambda: _held(cluster) == 0, DELAY_S, "prefill kept the blocks: no release reached it")
    assert scrape(cluster.prefills[0].url)["pdserve_kv_lease_expirations_total"] == 0, "freed by lease, not release"
    wait_for(
        lambda: scrape(cluster.decodes[0].url)["pdserve_kv_cache_usage_ratio"] == 0,
        10,
        "decode kept the aborted request's blocks",
    )


def test_a_decode_leg_whose_body_does_not_decode_frees_prefill_at_once(cluster):
    # The prefill leg (sent with max_tokens 1, as the router sends it) took the prompt; the decode
    # leg's own body is refused before it is parsed into a request.
    params = _prefill_leg(cluster, _prompt("invalid"))
    wait_for(lambda: _held(cluster) > 0, 10, "prefill does not report its held blocks")
    expirations = scrape(cluster.prefills[0].url)["pdserve_kv_lease_expirations_total"]
    body = _body(_prompt("invalid"), max_tokens="ten", kv_transfer_params=params)
    status, answer = post(cluster.decodes[0].url + "/v1/completions", body)
    assert status == 400 and answer["error"]["param"] == "max_tokens", answer
    wait_for(lambda: _held(cluster) == 0, LEASE_S - 1, "prefill kept the blocks: no release reached it")
    assert scrape(cluster.prefills[0].url)["pdserve_kv_lease_expirations_total"] == expirations, "freed by lease"


@pytest.mark.slow  # 20 s of chaos: make test keeps the budget (the other fault tests stay)
def test_prefill_killed_while_requests_wait_then_restarted(cluster):
    prompts = [_prompt(f"kill {i}") for i in range(3)]
    expected = [_reference(cluster, p) for p in prompts]
    legs = [_prefill_leg(cluster, p) for p in prompts]
    answers: list = [None] * len(prompts)

    def decode_leg(index: int) -> None:
        answers[index] = post(
            cluster.decodes[0].url + "/v1/completions",
            _body(prompts[index], kv_transfer_params=legs[index]),
            timeout=60,
        )

    threads = [threading.Thread(target=decode_leg, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    wait_for(
        lambda: scrape(cluster.decodes[0].url).get("pdserve_num_requests_waiting_for_remote_kv") == len(prompts),
        10,
        "requests did not reach WAITING_FOR_REMOTE_KVS",
    )
    failures_before = scrape(cluster.decodes[0].url)["pdserve_kv_transfer_failures_total"]
    cluster.prefills[0].kill()
    for thread in threads:
        thread.join(60)
        assert not thread.is_alive(), "a decode request hung after its prefill died"
    # Recomputed locally (the default policy): the same answers as if nothing had happened.
    assert [(status, body["choices"][0]["text"]) for status, body in answers] == [(200, e) for e in expected]
    decode = scrape(cluster.decodes[0].url)
    assert decode["pdserve_kv_transfer_failures_total"] == failures_before + len(prompts)
    assert decode["pdserve_kv_cache_usage_ratio"] == 0 or wait_for(
        lambda: scrape(cluster.decodes[0].url)["pdserve_kv_cache_usage_ratio"] == 0, 10, "decode leaked blocks"
    )

    # A restarted prefill (same ports, a new engine) is used again after a fresh handshake.
    cluster.prefills[0].start()
    cluster.prefills[0].wait_healthy()
    prompt = _prompt("after restart")
    expected_after = _reference(cluster, prompt)
    bytes_before = scrape(cluster.decodes[0].url)["pdserve_kv_transfer_bytes_total"]
    status, answer = post(
        cluster.decodes[0].url + "/v1/completions", _body(prompt, kv_transfer_params=_prefill_leg(cluster, prompt))
    )
    assert status == 200 and answer["choices"][0]["text"] == expected_after
    decode = scrape(cluster.decodes[0].url)
    assert decode["pdserve_kv_transfer_bytes_total"] > bytes_before
    assert decode["pdserve_kv_transfer_failures_total"] == failures_before + len(prompts)


def test_a_prefill_leg_with_several_prompts_is_refused(cluster):
    # It would hold every prompt's blocks but hand out the params of one: the rest held, unnamed, until their leases.
    held_before = _held(cluster)
    status, answer = post(
        cluster.prefills[0].url + "/v1/completions",
        _body(["first prompt", "second prompt"], kv_transfer_params={"do_remote_decode": True}),
    )
    assert status == 400 and answer["error"]["param"] == "prompt", answer
    assert _held(cluster) <= held_before  # nothing new held


def test_sigterm_drains_prefill_after_its_held_blocks_are_pulled_and_decode_after_its_streams(cluster):
    """Runs last: it stops both engines. Prefill holds blocks that decode pulls only after 5 s;
    prefill gets SIGTERM at once, refuses new work, serves the pull, then exits. Decode gets
    SIGTERM mid-stream and finishes the stream before exiting."""
    prefill, decode = cluster.prefills[0], cluster.decodes[0]
    prompt = _prompt("drain")
    status, reference = post(prefill.url + "/v1/completions", _body(prompt, max_tokens=150))
    assert status == 200
    params = _prefill_leg(cluster, prompt)
    failures = scrape(decode.url)["pdserve_kv_transfer_failures_total"]
    url = urlparse(decode.url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    connection.request(
        "POST",
        "/v1/completions",
        json.dumps(_body(prompt, stream=True, max_tokens=150, kv_transfer_params=params)),
        {"Content-Type": "application/json"},
    )
    response = connection.getresponse()
    assert response.status == 200
    wait_for(lambda: scrape(decode.url)["pdserve_num_requests_waiting_for_remote_kv"] == 1, 10, "no pending pull")
    prefill.process.send_signal(signal.SIGTERM)
    wait_for(
        lambda: post(prefill.url + "/v1/completions", _body("new work"))[0] == 503,
        10,
        "a draining prefill still takes new requests",
    )
    assert prefill.process.poll() is None, "prefill exited while holding blocks for a pending pull"
    wait_for(
        lambda: scrape(decode.url)["pdserve_num_requests_waiting_for_remote_kv"] == 0,
        DELAY_S + 10,
        "the pull never happened",
    )
    assert scrape(decode.url)["pdserve_kv_transfer_failures_total"] == failures, "pull from a draining prefill failed"
    decode.process.send_signal(signal.SIGTERM)  # mid-stream: the stream must still run to its end
    stream = response.read().decode()
    assert stream.rstrip().endswith("data: [DONE]")
    text = "".join(
        json.loads(line[6:])["choices"][0]["text"] for line in stream.splitlines() if line.startswith("data: {")
    )
    assert text == reference["choices"][0]["text"]
    assert prefill.process.wait(30) == 0 and decode.process.wait(30) == 0
