"""The prefill leg a decode engine sends itself behind a gateway (pdserve/server/gateway_prefill.py), against a real
HTTP server on 127.0.0.1 standing in for the prefill engine: params used, a failed leg computed here, a prefill's
4xx passed on, the picker's signature checked. (Real engines behind Envoy: tests/router/test_epp_engines.py.)"""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from pdserve.api.auth import ROUTER_AUTH_HEADER, RouterSigner, RouterVerifier
from pdserve.api.keys import load_router_public, load_router_signing, new_bundle, write_bundle
from pdserve.api.prefill_leg import PREFILL_AUTH_HEADER, PREFILL_VIA_HEADER, encoded_leg
from pdserve.api.protocol import ProtocolError
from pdserve.launcher import free_port
from pdserve.server.gateway_prefill import GatewayPrefill
from pdserve.server.metrics import EngineMetrics

BODY = json.dumps({"model": "demo", "prompt": "hello", "max_tokens": 4, "stream": True}).encode()
PARAMS = {"do_remote_prefill": True, "remote_engine_id": "p1", "remote_block_ids": [1]}


async def _prefill(status: int, answer: dict, seen: list) -> tuple[web.AppRunner, str]:
    async def leg(request: web.Request) -> web.Response:
        seen.append((await request.read(), dict(request.headers)))
        return web.json_response(answer, status=status)

    app = web.Application()
    app.router.add_post("/v1/completions", leg)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


def _request(headers: dict[str, str]) -> web.Request:
    return make_mocked_request("POST", "/v1/completions", headers=headers)


def _outcomes(metrics: EngineMetrics) -> dict[str, float]:
    return {
        outcome: metrics.gateway_prefill.labels(outcome)._value.get() for outcome in ("disagg", "fallback", "rejected")
    }


def test_the_answer_params_are_used_a_failed_leg_is_computed_here_and_a_4xx_is_the_clients():
    async def scenario():
        metrics = EngineMetrics(lambda: None, {})
        gateway = GatewayPrefill(metrics, None)
        seen: list = []
        runner, url = await _prefill(200, {"choices": [], "kv_transfer_params": PARAMS}, seen)
        try:
            picked = {PREFILL_VIA_HEADER: url, "X-PDServe-Tenant": "alpha", "X-PDServe-Ahead": "1", "X-Other": "no"}
            raw, own = await gateway.run(_request(picked), BODY, chat=False)
            assert own and json.loads(raw)["kv_transfer_params"] == PARAMS
            assert seen[0][0] == encoded_leg(BODY, chat=False)  # the bytes the picker would have signed
            passed = seen[0][1]  # the picker's tenant and fairness mark, nothing else of the request's
            assert passed["X-PDServe-Tenant"] == "alpha" and passed["X-PDServe-Ahead"] == "1"
            assert "X-Other" not in passed
            raw, own = await gateway.run(_request({}), BODY, chat=False)  # no picker: as it is
            assert (raw, own) == (BODY, False)
        finally:
            await runner.cleanup()
        raw, own = await gateway.run(_request({PREFILL_VIA_HEADER: url}), BODY, chat=False)  # nothing listens now
        assert (raw, own) == (BODY, False)
        runner, url = await _prefill(400, {"error": {"message": "max_tokens is too large", "code": 400}}, [])
        try:
            with pytest.raises(ProtocolError) as refused:
                await gateway.run(_request({PREFILL_VIA_HEADER: url}), BODY, chat=False)
            assert refused.value.status == 400 and "max_tokens" in refused.value.message
        finally:
            await runner.cleanup()
            await gateway.close()
        assert _outcomes(metrics) == {"disagg": 1.0, "fallback": 1.0, "rejected": 1.0}

    asyncio.run(scenario())


def test_with_keys_only_a_leg_the_router_signed_is_sent(tmp_path):
    write_bundle(str(tmp_path), new_bundle())
    signer = RouterSigner(load_router_signing(str(tmp_path)))
    verifier = RouterVerifier(load_router_public(str(tmp_path)), "decode-engine")

    async def scenario():
        gateway = GatewayPrefill(EngineMetrics(lambda: None, {}), verifier)
        seen: list = []
        runner, url = await _prefill(200, {"kv_transfer_params": PARAMS}, seen)
        try:
            for auth in (None, "1 2 3 00", signer.header("POST", "/v1/completions", b"other bytes", "prefill-1")):
                headers = {PREFILL_VIA_HEADER: url, **({PREFILL_AUTH_HEADER: auth} if auth else {})}
                with pytest.raises(ProtocolError) as refused:
                    await gateway.run(_request(headers), BODY, chat=False)
                assert refused.value.status == 403
            assert seen == []  # nothing was sent anywhere
            signed = signer.header("POST", "/v1/completions", encoded_leg(BODY, chat=False), "prefill-1")
            _, own = await gateway.run(_request({PREFILL_VIA_HEADER: url, PREFILL_AUTH_HEADER: signed}), BODY, False)
            assert own and seen[0][1][ROUTER_AUTH_HEADER] == signed  # the prefill checks it as every router leg
        finally:
            await runner.cleanup()
            await gateway.close()

    asyncio.run(scenario())
