"""P/D behind a gateway: the prefill leg a decode engine sends itself.

Behind a gateway with the Inference Extension there is no router between the two legs: the endpoint picker
(``pdserve epp``) sends the request to a decode pod and names, in request headers, the prefill pod
(``X-PDServe-Prefill-Via``) and the router's signature of the prefill leg for that pod's engine
(``X-PDServe-Prefill-Auth``), as the GIE ecosystem's P/D shape has it. The decode engine's API process then sends
the leg (the prefill-leg field contract's bytes, ``pdserve.api.prefill_leg.encoded_leg``: the same the picker
signed), reads the prefill engine's ``kv_transfer_params``, and serves the request as a decode leg with them.

Trust stays as with the router: only the router principal makes a prefill engine hold blocks. The prefill engine
checks the picker's signature as it checks the router's (it is one); the decode engine checks it first (signed by
the router, recently, for these bytes), so that a client reaching a decode pod cannot make it call anywhere. The
params it got from its own call need no signature of their own.

A prefill leg that fails (unreachable, timeout, 5xx, an answer without params) leaves the request to be computed
here, as the router's fallback does; a 4xx is the client's answer. Outcomes are counted in
``pdserve_gateway_prefill_total{outcome}``. Blocks a prefill holds for a request whose client left between the
two are freed by their lease.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from pdserve.api.auth import ROUTER_AUTH_HEADER, RouterVerifier
from pdserve.api.prefill_leg import PREFILL_AUTH_HEADER, PREFILL_VIA_HEADER, encoded_leg, prefill_timeout_s
from pdserve.api.protocol import ProtocolError
from pdserve.api.tenancy import AHEAD_HEADER, TENANT_HEADER
from pdserve.server.metrics import EngineMetrics

logger = logging.getLogger(__name__)

# What the prefill leg carries of the request's own headers: its key and tenant (the prefill salts its cached
# blocks with them, as the decode does), the picker's fairness mark (the prefill schedules by it too), and its id
# for the logs.
_PASSED_ON = ("Authorization", TENANT_HEADER, AHEAD_HEADER, "X-Request-Id")


class _PrefillAnswer(msgspec.Struct):
    kv_transfer_params: dict[str, Any] | None = None


class _Error(msgspec.Struct):
    message: str = "the prefill engine refused the request"


class _ErrorAnswer(msgspec.Struct):
    error: _Error


class GatewayPrefill:
    def __init__(self, metrics: EngineMetrics, verifier: RouterVerifier | None) -> None:
        """For a P/D decode engine. ``verifier``: checks the picker's signature (None: an engine without keys sends
        any leg it is asked to: loopback deployments only)."""
        self.metrics = metrics
        self.verifier = verifier
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def run(self, request: web.Request, raw: bytes, chat: bool) -> tuple[bytes, bool]:
        """The body to serve, and whether its ``kv_transfer_params`` come from this engine's own prefill leg (then
        taken without the router's signature). Without the picker's headers, ``raw`` as it is."""
        via = request.headers.get(PREFILL_VIA_HEADER)
        if via is None:
            return raw, False
        try:
            leg = encoded_leg(raw, chat)
        except ValueError:
            return raw, False  # the gate answers the 400
        auth = request.headers.get(PREFILL_AUTH_HEADER)
        if self.verifier is not None:
            problem = self.verifier.made_for_another(auth, request.method, request.path, leg)
            if problem is not None:
                raise ProtocolError(
                    f"{PREFILL_VIA_HEADER} is taken only with the router's signature "
                    f"({PREFILL_AUTH_HEADER}: {problem})",
                    403,
                    error_type="permission_denied",
                )
        if not via.startswith(("http://", "https://")):
            raise ProtocolError(f"{PREFILL_VIA_HEADER} must be an http(s) URL, got {via[:100]!r}")
        headers = {"Content-Type": "application/json"}
        headers.update({name: request.headers[name] for name in _PASSED_ON if name in request.headers})
        if auth is not None:
            headers[ROUTER_AUTH_HEADER] = auth
        params = await self._send(via.rstrip("/") + request.path, leg, headers)
        if params is None:
            return raw, False
        fields = msgspec.json.decode(raw)
        fields["kv_transfer_params"] = params
        return msgspec.json.encode(fields), True

    async def _send(self, url: str, leg: bytes, headers: dict[str, str]) -> dict[str, Any] | None:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        outcome = self.metrics.gateway_prefill
        try:
            # The body's size bounds the prompt's token count from above (no tokenizer pass for it here).
            async with asyncio.timeout(prefill_timeout_s(len(leg) // 2)):
                async with self._session.post(url, data=leg, headers=headers) as answer:
                    payload = await answer.read()
                    status = answer.status
        except (TimeoutError, aiohttp.ClientError) as error:
            logger.warning("prefill leg to %s failed (%s): computing the prompt here", url, type(error).__name__)
            outcome.labels("fallback").inc()
            return None
        if 400 <= status < 500:
            outcome.labels("rejected").inc()
            try:
                message = msgspec.json.decode(payload, type=_ErrorAnswer).error.message
            except msgspec.MsgspecError:
                message = "the prefill engine refused the request"
            raise ProtocolError(message, status)
        try:
            params = msgspec.json.decode(payload, type=_PrefillAnswer).kv_transfer_params if status == 200 else None
        except msgspec.MsgspecError:
            params = None
        outcome.labels("disagg" if params else "fallback").inc()
        return params
