"""Chaos: a prefill engine that stops answering (SIGSTOP on its processes: sockets open, nothing
read) under load stalls nobody. Real router, prefill and decode processes; the prefill holds
blocks for 8 s, decode bounds each handshake and transfer by 3 s.

16 requests are in flight when the prefill stops and 16 more arrive: each ends within 60 s with
200 or a JSON error, at least 24 succeed (decode computes them), the router's and decode's /health
answer within 5 s throughout, and after SIGCONT the disaggregated path is used again within one
lease. Once things settle, no engine owns a KV block, waits for remote KV or holds blocks."""

from __future__ import annotations

import threading
import time
import urllib.request

import pytest

from pdserve.testing.metrics import idle, metric, scrape
from tests.chaos.load import request, two_waves_around_a_stop
from tests.pd.cluster import Cluster, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

LEASE_S = 8


def _health_latency(url: str) -> float:
    started = time.monotonic()
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5):
            pass
    except OSError:
        return 5.0  # no answer within the bound (or an error status, which is an answer: see below)
    return time.monotonic() - started


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = Cluster.start(
        tmp_path_factory.mktemp("chaos"),
        prefill_flags=("--kv-lease-seconds", str(LEASE_S)),
        decode_flags=("--kv-transfer-timeout", "3"),
    )
    yield cluster
    cluster.stop()


def test_a_stopped_prefill_stalls_nobody_and_is_used_again_after_it_resumes(cluster):
    router, decode, prefill = cluster.router.url, cluster.decodes[0].url, cluster.prefills[0]
    assert _health_latency(router) < 5
    worst_health = [0.0]
    watching = threading.Event()

    def watch_health() -> None:
        while not watching.is_set():
            worst_health[0] = max(worst_health[0], _health_latency(router), _health_latency(decode))
            time.sleep(0.5)

    watcher = threading.Thread(target=watch_health)
    watcher.start()
    try:
        results = two_waves_around_a_stop(router, prefill.process.pid)
    finally:
        watching.set()
        watcher.join()
    succeeded = sum(status == 200 for _, status, _ in results.values())
    slowest = max(seconds for seconds, _, _ in results.values())
    print(f"prefill stopped: {succeeded}/32 succeeded, slowest {slowest:.1f} s, worst /health {worst_health[0]:.2f} s")
    assert succeeded >= 24
    assert worst_health[0] < 5, f"/health took {worst_health[0]:.1f} s"

    # Resumed: within one lease the router sends prefill legs there again (its health probe brings it back).
    disagg = metric(scrape(router), "pdserve_router_requests_total", path="disagg")
    deadline = time.monotonic() + LEASE_S + 5
    number = 100
    while metric(scrape(router), "pdserve_router_requests_total", path="disagg") == disagg:
        assert time.monotonic() < deadline, "the disaggregated path was not used again within a lease"
        request(router, number, results)
        number += 1
        time.sleep(0.5)

    # Settled: nothing owned, waiting or held anywhere once a lease has passed.
    for engine in (cluster.decodes[0].url, prefill.url):
        wait_for(lambda engine=engine: idle(scrape(engine)), LEASE_S + 20, f"{engine} did not settle")
        assert metric(scrape(engine), "pdserve_kv_blocks_quarantined") == 0
