"""100 requests through router + 1P1D whose clients leave at random moments — during the prefill
leg, while decode waits for or pulls the KV, mid-stream — and some that stay: afterwards nothing
is held on prefill and nothing is used on decode, within the lease."""

from __future__ import annotations

import asyncio
import random

import aiohttp
import pytest

from pdserve.testing.metrics import scrape
from tests.pd.cluster import Cluster, wait_for

pytestmark = pytest.mark.timeout(600)

LEASE_S = 5


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = Cluster.start(tmp_path_factory.mktemp("disconnects"), prefill_flags=("--kv-lease-seconds", str(LEASE_S)))
    yield cluster
    cluster.stop()


async def _client(session: aiohttp.ClientSession, url: str, rng: random.Random, outcomes: list[str]) -> None:
    stream = rng.random() < 0.5
    body = {
        "model": "demo",
        "prompt": "word " * rng.randrange(3, 100),
        "max_tokens": rng.randrange(1, 150),
        "stream": stream,
        "ignore_eos": True,
    }
    leave_after = rng.uniform(0.0, 0.4) if rng.random() < 0.8 else None

    async def call() -> str:
        async with session.post(url + "/v1/completions", json=body) as response:
            assert response.status == 200, await response.text()
            data = await response.read()
            assert (b"[DONE]" in data) if stream else (b'"finish_reason":"length"' in data)
            return "completed"

    try:
        outcomes.append(await asyncio.wait_for(call(), leave_after))
    except TimeoutError:
        outcomes.append("left")  # wait_for cancelled the request: the connection is closed


async def _run(url: str) -> list[str]:
    rng = random.Random(7)
    outcomes: list[str] = []
    limit = asyncio.Semaphore(12)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:

        async def one() -> None:
            async with limit:
                await _client(session, url, rng, outcomes)

        await asyncio.gather(*(one() for _ in range(100)))
    return outcomes


def test_clients_leaving_at_any_stage_leak_nothing(cluster):
    outcomes = asyncio.run(_run(cluster.router.url))
    assert len(outcomes) == 100 and outcomes.count("left") > 30 and outcomes.count("completed") > 10

    def drained() -> bool:
        prefill, decode = scrape(cluster.prefills[0].url), scrape(cluster.decodes[0].url)
        return (
            prefill["pdserve_kv_blocks_held_for_remote"] == 0
            and prefill["pdserve_kv_cache_usage_ratio"] == 0
            and decode["pdserve_kv_cache_usage_ratio"] == 0
            and decode["pdserve_num_requests_running"] == 0
            and decode["pdserve_num_requests_waiting"] == 0
        )

    wait_for(drained, LEASE_S + 10, "blocks or requests left behind after the clients went away")
    router = scrape(cluster.router.url)
    assert router['pdserve_router_requests_total{path="disagg"}'] > 0
