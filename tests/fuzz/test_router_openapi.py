"""Schemathesis against a live router in front of a real 1P1D cluster (`pdserve prefill|decode|router`
processes): the same runs and checks as the engine's, through both legs; afterwards every process is healthy, the
router saw no failing leg, and no KV block is left held or owned. Also the P/D findings of the fuzzing and of the
soak (bench/soak.py): regression tests for the fixed ones."""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiohttp
import pytest

from pdserve.testing.metrics import ROUTER_LEG_FAILURES
from pdserve.testing.metrics import scrape as metrics
from tests.fuzz.openapi_fuzz import RUN_IDS, RUNS, completion_body, get_json, load_schemas, run_operation
from tests.pd.cluster import Cluster, post, wait_for

pytestmark = pytest.mark.timeout(600)

# A 64-token context keeps fuzzed requests cheap (later flags win over cluster.py's --max-model-len 512). A short
# lease bounds how long blocks of a prefill leg whose decode leg never came stay held.
LEASE_SECONDS = 5
FLAGS = ("--max-model-len", "64", "--kv-lease-seconds", str(LEASE_SECONDS))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = Cluster.start(tmp_path_factory.mktemp("fuzz-router"), "nixl", prefill_flags=FLAGS, decode_flags=FLAGS)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def schemas(cluster):
    return load_schemas(cluster.router.url)


@pytest.mark.parametrize(("path", "method", "document", "mode", "examples"), RUNS, ids=RUN_IDS)
def test_operation(schemas, path, method, document, mode, examples):
    run_operation(schemas, path, method, document, mode, examples, "cluster")


def _engine_idle(url: str) -> bool:
    values = metrics(url)
    return all(
        values.get(name, 0) == 0
        for name in (
            "pdserve_num_requests_running",
            "pdserve_num_requests_waiting",
            "pdserve_num_requests_waiting_for_remote_kv",
            "pdserve_kv_blocks_held_for_remote",
            "pdserve_kv_cache_usage_ratio",
        )
    )


def test_cluster_healthy_and_idle_after_fuzzing(cluster):
    for process in [cluster.router, *cluster.prefills, *cluster.decodes]:
        assert get_json(f"{process.url}/health")[0] == 200, f"{process.name} unhealthy:\n{process.log()}"
    router = metrics(cluster.router.url)
    print(
        {
            name: value
            for name, value in router.items()
            if name.startswith(("pdserve_router_requests_total", "pdserve_router_errors_total")) and value
        }
    )
    failures = {kind: router.get(f'pdserve_router_errors_total{{kind="{kind}"}}') for kind in ROUTER_LEG_FAILURES}
    assert not any(failures.values()), failures
    assert router['pdserve_router_requests_total{path="disagg"}'] > 0, "no request went through both legs"
    prefill, decode = cluster.prefills[0].url, cluster.decodes[0].url
    # Nothing may outlive the lease (blocks of a leg whose decode leg never came end by lease expiry).
    wait_for(lambda: _engine_idle(prefill), LEASE_SECONDS + 10, f"prefill not idle: {metrics(prefill)}")
    wait_for(lambda: _engine_idle(decode), 10, f"decode not idle: {metrics(decode)}")


def _held(url: str) -> float:
    return metrics(url).get("pdserve_kv_blocks_held_for_remote", 0)


def _expirations(url: str) -> float:
    return metrics(url).get("pdserve_kv_lease_expirations_total", 0)


def _lease_expiries(url: str, action) -> float:
    """Run ``action`` on an engine holding nothing; once whatever it left held is freed, how many holds ended by
    lease expiry rather than by a release (the lease is what frees the blocks of a decode that never comes)."""
    wait_for(lambda: _held(url) == 0, LEASE_SECONDS + 10, "blocks held before the test")
    before = _expirations(url)
    action()
    wait_for(lambda: _held(url) == 0, LEASE_SECONDS + 10, "blocks outlived the lease")
    time.sleep(0.5)  # a lease expiry is counted when the core collects it
    return _expirations(url) - before


def test_refused_decode_leg_releases_prefill_blocks(cluster):
    # The router's prefill leg sends max_tokens 1 and drops n, min_tokens and stream_options, so a request only the
    # decode engine refuses has prefilled blocks held; the decode engine used not to release them (lease expiry).
    refused = ({"max_tokens": 0}, {"n": 0}, {"min_tokens": 30}, {"max_tokens": 60}, {"max_tokens": -1}, {"n": -2})

    def refuse() -> None:
        for extra in refused:
            status, answer = post(
                f"{cluster.router.url}/v1/completions", completion_body(f"a refused request {extra}", **extra)
            )
            assert status == 400, answer

    # Without the decode engine's release every one of these holds would expire.
    assert _lease_expiries(cluster.prefills[0].url, refuse) < len(refused)


async def _leave_after(url: str, body: dict, seconds: float) -> None:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:

        async def read() -> None:
            async with session.post(url, json=body) as answer:
                await answer.read()

        with contextlib.suppress(TimeoutError):  # leaving: the cancelled read closes the connection
            await asyncio.wait_for(read(), seconds)


def test_client_leaving_during_the_prefill_leg_frees_prefill_blocks(cluster):
    # An abort reaching the prefill engine's core just after the leg finished (blocks held for the remote decode)
    # used to be ignored (scheduler.finish_requests skipped finished requests): held until the lease expired. And a
    # client leaving between the legs left them to the lease too (decode never had the params): the router now
    # tells the prefill engine to free them (POST /v1/kv_transfer/release).
    def leave() -> None:
        # Several moments, so that some fall inside the prefill leg however fast this machine is.
        for index, seconds in enumerate((0.002, 0.005, 0.01, 0.02, 0.04, 0.08)):
            body = completion_body(list(range(10 + index, 60 + index)), max_tokens=8)
            asyncio.run(_leave_after(f"{cluster.router.url}/v1/completions", body, seconds))

    assert _lease_expiries(cluster.prefills[0].url, leave) == 0


def test_client_kv_transfer_params_cannot_pin_decode_blocks(cluster):
    # On the decode-only path (echo with logprobs, n > 1, several prompts) the router used to forward the client's
    # kv_transfer_params: any client could make the decode engine act as a prefill and hold KV blocks for a
    # remote decode that never comes, until the lease expired.
    def pin() -> None:
        status, answer = post(
            f"{cluster.router.url}/v1/completions",
            completion_body(
                "pin my blocks " * 3, echo=True, logprobs=0, max_tokens=2, kv_transfer_params={"do_remote_decode": True}
            ),
        )
        assert status in (200, 400), answer

    assert _lease_expiries(cluster.decodes[0].url, pin) == 0
