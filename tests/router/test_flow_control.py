"""Tenants and flow control through the router over real sockets: tenant keys, what the legs carry instead of them,
clamped priorities, per-minute limits (split between replicas), and requests that wait while the pods' own KV-event
load says the fleet is saturated. Stubs stand in for the engines (tests/router/helpers.py); their load is what they
publish. bench/tenants.py drives real engines into saturation."""

from __future__ import annotations

import asyncio
import json

import msgspec

from pdserve.api.kv_events import EngineLoad
from pdserve.testing.metrics import metric
from tests.router.helpers import get, metrics_text, post, settles

TABLE = {
    "tenants": {
        "alpha": {"keys": ["sk-alpha"], "priority": {"default": 1, "min": 0, "max": 3}},
        "beta": {"keys": ["sk-beta"], "requests_per_minute": 4},
    }
}
ALPHA = {"Authorization": "Bearer sk-alpha"}
BETA = {"Authorization": "Bearer sk-beta"}


def _table(tmp_path) -> str:
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps(TABLE))
    return str(path)


def _error(payload: bytes) -> dict:
    return msgspec.json.decode(payload)["error"]


def test_tenant_keys_authenticate_and_the_legs_carry_the_routers_key_and_the_tenant(loop, cluster, tmp_path):
    prefill, decode = cluster.stub("prefill"), cluster.stub("decode")
    router = cluster.router([prefill.url], [decode.url], api_key="sk-engines", tenants=_table(tmp_path))
    url = router.url + "/v1/completions"
    for headers in (None, {"Authorization": "Bearer sk-engines"}, {"Authorization": "Bearer sk-nobody"}):
        status, _, payload = loop.run(post(url, {"prompt": "hi"}, headers))
        assert status == 401 and _error(payload)["type"] == "authentication_error"
    assert decode.seen == []
    spoofed = {**ALPHA, "X-PDServe-Tenant": "beta"}  # a client's copy of the router's header is never passed on
    status, _, _ = loop.run(post(url, {"prompt": "hi", "priority": -(10**9)}, spoofed))
    assert status == 200
    for leg in (prefill.seen[0], decode.seen[0]):
        assert leg.headers["Authorization"] == "Bearer sk-engines" and leg.headers["X-PDServe-Tenant"] == "alpha"
        assert leg.body["priority"] == 0  # clamped into alpha's range
    loop.run(post(url, {"prompt": "hi"}, ALPHA))
    assert decode.seen[1].body["priority"] == 1  # alpha's default
    assert loop.run(get(router.url + "/v1/models", ALPHA))[0] == 200
    assert loop.run(get(router.url + "/v1/models"))[0] == 401
    assert loop.run(get(router.url + "/debug/index", ALPHA))[0] == 401  # the router's own key only
    assert loop.run(get(router.url + "/debug/index", {"Authorization": "Bearer sk-engines"}))[0] == 200
    text = metrics_text(loop, router)
    assert metric(text, "pdserve_router_flow_admitted_total", tenant="alpha", band="0") == 1
    assert metric(text, "pdserve_router_flow_admitted_total", tenant="alpha", band="1") == 1


def test_per_minute_limits_answer_429_with_retry_after_and_are_split_between_replicas(loop, cluster, tmp_path):
    decode = cluster.stub("decode")
    table = _table(tmp_path)
    replicas = [cluster.router([], [decode.url], tenants=table, router_replicas=2) for _ in range(2)]
    for router in replicas:  # 4 a minute for the deployment: 2 in each replica
        url = router.url + "/v1/completions"
        assert [loop.run(post(url, {"prompt": "hi"}, BETA))[0] for _ in range(2)] == [200, 200]
        status, headers, payload = loop.run(post(url, {"prompt": "hi"}, BETA))
        assert status == 429 and 20 <= int(headers["Retry-After"]) <= 30
        assert _error(payload)["type"] == "rate_limit_exceeded"
        assert loop.run(post(url, {"prompt": "hi"}, ALPHA))[0] == 200  # other tenants are not held back
        text = metrics_text(loop, router)
        assert metric(text, "pdserve_router_flow_rejected_total", tenant="beta", band="0", cause="requests_per_minute")
    assert len(decode.seen) == 6


def test_requests_wait_while_the_pods_signals_say_saturated_and_go_when_they_clear(loop, cluster):
    decode = cluster.stub("decode", events=True)
    router = cluster.router([], [decode.url], saturation_queue=4)
    url = router.url + "/v1/completions"
    index = router.router.index
    assert settles(lambda: decode.url in router.router.subscriber.endpoints())

    async def show(waiting: int) -> None:
        """Publish the load until the router has it (a new subscriber misses what was sent before it joined)."""
        for _ in range(100):
            await decode.publish(load=EngineLoad(8, waiting, 0, 0.5, 0))
            await asyncio.sleep(0.05)
            known = index.pods.get(decode.url)
            if known is not None and known.load is not None and known.load.num_waiting == waiting:
                return
        raise AssertionError(f"the router never saw {waiting} waiting")

    async def scenario():
        await show(6)  # 6 waiting: saturated
        waiting = asyncio.ensure_future(post(url, {"prompt": "hi"}))
        expired = await post(url, {"prompt": "hi"}, {"X-PDServe-Queue-Timeout": "0.2"})
        assert expired[0] == 429 and _error(expired[2])["message"].endswith("queue deadline passed")
        assert not waiting.done() and decode.seen == []
        await show(0)  # the queue drained
        status, _, _ = await asyncio.wait_for(waiting, 5)
        assert status == 200

    loop.run(scenario())
    text = metrics_text(loop, router)
    assert metric(text, "pdserve_router_flow_saturated_total", stage="decode") == 1  # the second queued behind it
    assert metric(text, "pdserve_router_flow_rejected_total", tenant="default", band="0", cause="deadline") == 1
    assert metric(text, "pdserve_router_flow_queued_total", tenant="default", band="0") == 2
    status, _, payload = loop.run(post(url, {"prompt": "hi"}, {"X-PDServe-Queue-Timeout": "soon"}))
    assert status == 400 and "X-PDServe-Queue-Timeout" in _error(payload)["message"]


def test_a_tenant_with_nothing_in_flight_is_marked_ahead_on_both_legs(loop, cluster, tmp_path):
    prefill, decode = cluster.stub("prefill"), cluster.stub("decode")
    decode.wait_before_answer = 0.5  # alpha's request stays in flight while beta's comes
    router = cluster.router([prefill.url], [decode.url], tenants=_table(tmp_path))
    url = router.url + "/v1/completions"

    async def scenario():
        spoofed = {**ALPHA, "X-PDServe-Ahead": "1"}  # a client's copy is never passed on
        first = asyncio.ensure_future(post(url, {"prompt": "hi", "priority": 0}, spoofed))  # beta's band
        for _ in range(100):
            if decode.seen:
                break
            await asyncio.sleep(0.01)
        assert (await post(url, {"prompt": "hi"}, BETA))[0] == 200  # alpha has one in flight, beta none
        assert (await first)[0] == 200

    loop.run(scenario())
    for stub in (prefill, decode):
        alpha, beta = stub.seen
        assert "X-PDServe-Ahead" not in alpha.headers and alpha.headers["X-PDServe-Tenant"] == "alpha"
        assert beta.headers["X-PDServe-Ahead"] == "1" and beta.headers["X-PDServe-Tenant"] == "beta"
    text = metrics_text(loop, router)
    assert metric(text, "pdserve_router_flow_ahead_total", tenant="beta", band="0") == 1


def test_a_trusted_gateway_header_names_tenants_and_the_gateway_key_is_checked(loop, cluster, tmp_path):
    decode = cluster.stub("decode")
    router = cluster.router([], [decode.url], api_key="sk-gateway", tenants=_table(tmp_path), tenant_header="X-Tenant")
    url = router.url + "/v1/completions"
    gateway = {"Authorization": "Bearer sk-gateway"}
    assert loop.run(post(url, {"prompt": "hi"}, {"X-Tenant": "alpha"}))[0] == 401  # not through the gateway
    assert loop.run(post(url, {"prompt": "hi"}, gateway))[0] == 401  # no tenant named
    assert loop.run(post(url, {"prompt": "hi"}, {**gateway, "X-Tenant": "stranger"}))[0] == 403
    assert loop.run(post(url, {"prompt": "hi", "priority": 9}, {**gateway, "X-Tenant": "alpha"}))[0] == 200
    leg = decode.seen[0]
    assert leg.headers["X-PDServe-Tenant"] == "alpha" and leg.headers["Authorization"] == "Bearer sk-gateway"
    assert leg.body["priority"] == 3


def test_a_flood_of_tenant_names_adds_no_metric_series(loop, cluster, tmp_path):
    decode = cluster.stub("decode")
    table = tmp_path / "tenants.json"
    table.write_text(json.dumps({**TABLE, "default": {"max_queued": 1}}))
    router = cluster.router([], [decode.url], tenants=str(table), tenant_header="X-Tenant")

    async def flood():
        return await asyncio.gather(
            *(post(router.url + "/v1/completions", {"prompt": "hi"}, {"X-Tenant": f"t{i}"}) for i in range(40))
        )

    assert {status for status, _, _ in loop.run(flood())} == {200}
    text = metrics_text(loop, router)
    tenants = {line.split('tenant="')[1].split('"')[0] for line in text.splitlines() if 'tenant="' in line}
    assert tenants == {"other"}
    assert metric(text, "pdserve_router_flow_admitted_total", tenant="other", band="0") == 40
