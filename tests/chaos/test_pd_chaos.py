"""Chaos on the P/D path with keys: real router, one prefill and two decode processes (NIXL), the
prefill holding blocks for 8 s, decode bounding each handshake and transfer by 3 s.

- A prefill SIGKILLed while decode engines hand-shake with it (stopped first, so the handshake is sure to be
  pending): every waiting request ends with 200 (decode computes it), and a restarted prefill (a new
  incarnation at the same address) is used again after a fresh handshake.
- A decode SIGSTOPped while its requests pull or generate: the router moves requests that have no answer yet
  to the other decode once the stopped one fails its health probe; each of 32 requests ends within 60 s with
  200 or a JSON error, at least 24 succeed, and after SIGCONT the stopped decode settles.
After each, once a lease has passed, no engine owns a block, waits for remote KV, holds or quarantines blocks."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest

from pdserve.testing.metrics import idle, metric, scrape
from tests.chaos.load import processes_of, request, two_waves_around_a_stop
from tests.fuzz.openapi_fuzz import completion_body, prefill_leg_body
from tests.pd.cluster import Cluster, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

LEASE_S = 8


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = Cluster.start(
        tmp_path_factory.mktemp("pd-chaos"),
        num_decode=2,
        prefill_flags=("--kv-lease-seconds", str(LEASE_S)),
        decode_flags=("--kv-transfer-timeout", "3"),
        keys=True,
    )
    yield cluster
    cluster.stop()


def _signed(cluster: Cluster, url: str, body: dict, timeout: float = 60) -> tuple[int, dict]:
    """POST as the router does (with its signature): the test plays the router's part on one leg."""
    data = json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **cluster.router_header(url, "/v1/completions", data)}
    request = urllib.request.Request(url + "/v1/completions", data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _settled(cluster: Cluster) -> None:
    for process in (*cluster.prefills, *cluster.decodes):
        wait_for(lambda process=process: idle(scrape(process.url)), LEASE_S + 25, f"{process.name} did not settle")


def test_a_prefill_killed_during_the_handshake_then_restarted(cluster):
    prefill, decode = cluster.prefills[0], cluster.decodes[0]
    # ~150 tokens each: the three holds stay well within the prefill's held share of its cache.
    prompts = [f"handshake {i}: " + " ".join(f"h{i}x{j}" for j in range(30)) for i in range(3)]
    legs = []
    for prompt in prompts:
        status, leg = _signed(cluster, prefill.url, prefill_leg_body(prompt))
        assert status == 200 and leg["kv_transfer_params"], leg
        legs.append(leg["kv_transfer_params"])
    stopped = processes_of(prefill.process.pid)
    for pid in stopped:
        os.kill(pid, signal.SIGSTOP)  # the decode's handshake will wait on it
    answers: list = [None] * len(prompts)

    def decode_leg(index: int) -> None:
        body = completion_body(prompts[index], max_tokens=4, kv_transfer_params=legs[index])
        answers[index] = _signed(cluster, decode.url, body)

    threads = [threading.Thread(target=decode_leg, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    wait_for(
        lambda: scrape(decode.url).get("pdserve_num_requests_waiting_for_remote_kv") == len(prompts),
        10,
        f"the requests did not wait for their pull: {answers}",
    )
    time.sleep(0.5)  # the handshake is out, unanswered
    for pid in reversed(stopped):  # SIGKILL reaches stopped processes too: the engine core, then the API process
        os.kill(pid, signal.SIGKILL)
    prefill.kill()  # reaps it
    for thread in threads:
        thread.join(60)
        assert not thread.is_alive(), "a decode request hung after its prefill died mid-handshake"
    assert [status for status, _ in answers] == [200] * len(prompts), answers
    wait_for(lambda: idle(scrape(decode.url)), 15, "decode kept blocks")

    # A new incarnation at the same address: the router's probe brings it back, a fresh handshake pairs them.
    prefill.start()
    prefill.wait_healthy()
    disagg = metric(scrape(cluster.router.url), "pdserve_router_requests_total", path="disagg")
    results: dict = {}
    deadline = time.monotonic() + LEASE_S + 10
    number = 0
    while metric(scrape(cluster.router.url), "pdserve_router_requests_total", path="disagg") == disagg:
        assert time.monotonic() < deadline, "the restarted prefill was not used again"
        request(cluster.router.url, number, results)
        number += 1
        time.sleep(0.3)
    assert all(status == 200 for _, status, _ in results.values()), results
    _settled(cluster)


def test_a_decode_stopped_mid_pull_stalls_nobody(cluster):
    router = cluster.router.url
    results = two_waves_around_a_stop(router, cluster.decodes[1].process.pid)
    succeeded = sum(status == 200 for _, status, _ in results.values())
    slowest = max(seconds for seconds, _, _ in results.values())
    hung = metric(scrape(router), "pdserve_router_errors_total", kind="decode_hung")
    print(f"decode stopped: {succeeded}/32 succeeded, slowest {slowest:.1f} s, {hung:.0f} moved off the stopped pod")
    assert succeeded >= 24
    _settled(cluster)
