"""The P→D path of one generation request: validation, pod choice (pdserve/router/policy.py), and the choice
between three paths, each ending in a decode leg (``decode_leg.py``: sent, retried, relayed), after a prefill
leg (``prefill_leg.py``) or not (docs/contracts.md, "kv_transfer_params"; every path is counted, so a silent
fall back to decode-only shows in the metrics):

- ``disagg``: prefill answered ``kv_transfer_params``; decode gets the client's body plus those params.
- ``decode_only``: no prefill leg is possible or useful (no prefill pods, several choices or prompts, prompt
  logprobs; or the chosen decode pod has all but ``pd_min_prefill_tokens`` of the prompt cached) or prefill
  answered without params; decode prefills locally.
- ``fallback``: the prefill leg failed (unreachable, timeout, 5xx, unreadable answer) or no prefill pod is up;
  decode prefills locally.

A decode leg to a pod that serves peer reads asks it to hold the finished turn (``kv_peer_hold``), and the turn is
remembered once answered: the next turn's prefill leg may read its prefix from there (``peer_holds``).

The decode pod is chosen first (the P/D decider needs its cached prefix) and counts the request in flight from
then on. A decode pod that cannot be reached, or whose answer breaks before its first byte, is replaced by
another (the client has seen nothing yet). Leaving any leg early (client gone, deadline) closes its upstream
connection, which makes the engine abort the request and free its KV blocks.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Mapping
from typing import Any

import msgspec

from pdserve.api.protocol import ChatCompletionRequest, CompletionRequest, ProtocolError, decode_request
from pdserve.api.report import REPORT_HEADER
from pdserve.api.tenancy import AHEAD_HEADER, TENANT_HEADER
from pdserve.router.admission import Admission, Ticket
from pdserve.router.config import RouterConfig
from pdserve.router.deadlines import Deadlines
from pdserve.router.decode_leg import DecodeLegs
from pdserve.router.exchange import REQUEST_ID, REQUEST_ID_KEY, Exchange
from pdserve.router.http_server import Request, Response, StreamResponse
from pdserve.router.metrics import RouterMetrics
from pdserve.router.peer_holds import PeerHolds
from pdserve.router.pods import PodSet, no_decode_pod
from pdserve.router.policy import Chooser, uncached_tokens
from pdserve.router.prefill_leg import PrefillLegs
from pdserve.router.prompt import PromptReader
from pdserve.router.tenants import Tenant, Tenants
from pdserve.router.upstream import Upstream

SESSION_ID = "X-Session-Id"
# Seconds a request accepts to wait for a saturated fleet (the shorter of it and its tenant's queue_timeout).
QUEUE_TIMEOUT_HEADER = "X-PDServe-Queue-Timeout"
# The output a request without max_tokens is expected to cost (flow control's estimate; its real cost replaces it).
_UNBOUNDED_OUTPUT_ESTIMATE = 512


class Proxy:
    def __init__(
        self,
        config: RouterConfig,
        prefill: PodSet,
        decode: PodSet,
        metrics: RouterMetrics,
        chooser: Chooser,
        prompts: PromptReader | None = None,
        tenants: Tenants | None = None,
        admission: Admission | None = None,
    ) -> None:
        """``tenants``, ``admission``: who sends each request and whether it may go now (None: one tenant, no flow
        control)."""
        self.config = config
        self.tenants = tenants or Tenants(None)
        self.admission = admission
        self.prefill = prefill
        self.decode = decode
        self.metrics = metrics
        self.chooser = chooser
        self.prompts = prompts  # None: prompts are not tokenized (no tokenizer, or nothing would use them)
        self.upstream = Upstream(config, metrics)
        # Finished turns held for peer reads need the prompt's hashes to be found again.
        self.peer_holds = PeerHolds(chooser.index) if prompts is not None else None
        self.deadlines = Deadlines()  # every request's timeouts, on one tick
        self.prefill_legs = PrefillLegs(
            self.upstream, config, prefill, chooser, metrics, self.deadlines, self.peer_holds, decode
        )
        self.decode_legs = DecodeLegs(config, self.upstream, decode, chooser, metrics, self.deadlines)

    async def forward(self, request: Request, chat: bool) -> Response | StreamResponse:
        """Serve one /v1/completions (or, with ``chat``, /v1/chat/completions) request."""
        started = time.perf_counter()
        exchange: Exchange | None = None
        ticket: Ticket | None = None
        try:
            tenant = self.tenants.identify(request.headers)
            raw = await request.read()
            parsed = decode_request(raw, ChatCompletionRequest if chat else CompletionRequest)
            self.metrics.received.inc()
            # 128 random bits, as uuid4 has (less 6 fixed ones), at a quarter of its cost.
            request_id = request.headers.get(REQUEST_ID) or os.urandom(16).hex()
            request[REQUEST_ID_KEY] = request_id
            # The report (pdserve/api/report.py) feeds the length and latency histograms.
            headers = {"Content-Type": "application/json", REQUEST_ID: request_id, REPORT_HEADER: "1"}
            headers.update(self.engine_headers(request.headers, tenant))
            priority = tenant.clamp(parsed.priority)
            if priority != (parsed.priority or 0):
                body = msgspec.json.decode(raw)
                body["priority"] = priority
                raw = msgspec.json.encode(body)
            exchange = Exchange(request, headers, request_id, started=started)
            if self.admission is not None:
                entered = self.admission.enter(
                    tenant,
                    priority,
                    len(raw) // 4,
                    output_bound(parsed),
                    queue_timeout(request.headers.get(QUEUE_TIMEOUT_HEADER)),
                )
                if not entered.admitted:
                    await self.admission.wait(entered)  # if it raises, the ticket was never admitted or is done
                ticket = entered
                if ticket.ahead:
                    headers[AHEAD_HEADER] = "1"  # on both legs
            try:
                async with self.deadlines.timeout(self.config.request_timeout):
                    return await self._serve(exchange, raw, parsed, chat)
            except TimeoutError:
                self.metrics.errors["timeout"].inc()
                if exchange.response is None:
                    raise ProtocolError(
                        f"the request took longer than {self.config.request_timeout:g} s", 504, error_type="timeout"
                    ) from None
                exchange.cut()
                return exchange.response
        except asyncio.CancelledError:
            self.metrics.errors["client_disconnect"].inc()  # aiohttp cancels the handler when the client goes
            raise
        finally:
            if exchange is not None and exchange.decode is not None:
                exchange.decode.pod.in_flight -= 1
            if ticket is not None:
                assert self.admission is not None and exchange is not None
                report = exchange.report
                if report is None:
                    self.admission.done(ticket)
                else:
                    self.admission.done(ticket, report.completion_tokens, report.prompt_tokens)
            self.metrics.latency.observe(time.perf_counter() - started)

    def engine_headers(self, client_headers: Mapping[str, str], tenant: Tenant) -> dict[str, str]:
        """What the legs to engines carry of the client's identity. With tenant keys, the router's own key (the
        engines') and the tenant's name, which salts its cached blocks; else the client's key, and the tenant's
        name when a trusted gateway named it."""
        headers: dict[str, str] = {}
        if self.tenants.keyed:
            if self.config.api_key is not None:
                headers["Authorization"] = f"Bearer {self.config.api_key}"
            headers[TENANT_HEADER] = tenant.name
            return headers
        authorization = client_headers.get("Authorization")
        if authorization is not None:
            headers["Authorization"] = authorization
        if self.tenants.header is not None:
            headers[TENANT_HEADER] = tenant.name
        return headers

    async def _serve(self, exchange: Exchange, raw: bytes, parsed: Any, chat: bool) -> Response | StreamResponse:
        if parsed.kv_transfer_params is not None:
            # The P/D protocol is the router's to speak: a client's own params could make an engine hold
            # blocks for a decode that never comes, or pull from a host of the client's choosing.
            body = msgspec.json.decode(raw)
            del body["kv_transfer_params"]
            raw = msgspec.json.encode(body)
        exchange.body = raw
        local = not self.prefill or needs_local_prefill(parsed, chat)
        # The prompt is read for prefix routing, or for the decider when there is a prefill leg to skip.
        if (
            self.prompts is not None
            and (self.chooser.prefix_aware or not local)
            and (chat or not _several_prompts(parsed.prompt))
        ):
            exchange.prompt = await self.prompts.read(
                parsed, chat, exchange.headers.get("Authorization"), exchange.headers.get(TENANT_HEADER)
            )
        if self.config.session_affinity:
            exchange.session = exchange.request.headers.get(SESSION_ID) or parsed.user
        exchange.hold(self.chooser.choose(self.decode, exchange.prompt, exchange.session))
        decode = exchange.decode
        if decode is None:  # no decode pod known at all (discovery found none)
            self.metrics.errors["no_decode"].inc()
            raise no_decode_pod(self.config.health_interval)
        if decode.block_size:
            options = parsed.stream_options
            exchange.stream_usage = options is not None and bool(options.include_usage)
        handle = None
        if self.peer_holds is not None and exchange.prompt is not None and not (parsed.n or 1) > 1:
            handle = self.peer_holds.handle_for(decode.pod)  # one sequence's turn (n > 1 makes several)
        if local:
            self.metrics.paths["decode_only"].inc()
            # The client's bytes (its kv_transfer_params aside).
            return await self._decode(exchange, raw, handle)
        threshold = self.config.pd_min_prefill_tokens
        if threshold and exchange.prompt is not None and uncached_tokens(exchange.prompt, decode) < threshold:
            # So little to compute that a prefill leg and a KV pull would cost more than decode computing it.
            self.metrics.prefill_skipped.inc()
            self.metrics.paths["decode_only"].inc()
            return await self._decode(exchange, raw, handle)
        body = msgspec.json.decode(raw)  # the client's object, unknown fields included
        # A client that leaves mid-leg must not cut the leg off after the prefill engine has answered (its
        # blocks then held under an id only the answer names): the leg ends, then its blocks are released.
        with exchange.request.finish_even_if_client_leaves() as watch:
            result = await self.prefill_legs.run(exchange, body, chat)
        if watch.client_left:
            if result.params is not None and result.pod is not None:
                self.prefill_legs.release_later(result.pod, result.params, exchange.headers)
            raise asyncio.CancelledError
        if result.rejection is not None:
            return result.rejection
        if result.failed:
            self.metrics.paths["fallback"].inc()
            return await self._decode(exchange, raw, handle)
        if result.params is None:
            self.metrics.paths["decode_only"].inc()
            return await self._decode(exchange, raw, handle)
        exchange.disagg_pending = True
        body["kv_transfer_params"] = result.params
        try:
            return await self._decode(exchange, body, handle)
        except asyncio.CancelledError:
            # The client left between the legs, or before a decode pod answered: decode may never
            # have had the params, and only it would tell prefill to free. Release from here (a
            # second release, if decode sends one too, is harmless).
            if not exchange.decode_answered and result.pod is not None:
                self.prefill_legs.release_later(result.pod, result.params, exchange.headers)
            raise

    async def _decode(
        self, exchange: Exchange, body: bytes | dict[str, Any], handle: str | None
    ) -> Response | StreamResponse:
        """Send the decode leg (``body``: bytes as they are, or an object to encode); with a ``handle``, the pod is
        asked to hold the finished turn for peer reads, remembered once it answered."""
        if handle is None:
            return await self.decode_legs.send(exchange, body if isinstance(body, bytes) else msgspec.json.encode(body))
        fields: dict[str, Any] = msgspec.json.decode(body) if isinstance(body, bytes) else body
        fields["kv_transfer_params"] = {**(fields.get("kv_transfer_params") or {}), "kv_peer_hold": handle}
        exchange.peer_hold = handle
        response = await self.decode_legs.send(exchange, msgspec.json.encode(fields))
        # The pod that answered last holds the turn (a stream continued elsewhere is held there, if it can be).
        held = exchange.peer_hold if response.status == 200 else None
        if held is not None and exchange.decode is not None and exchange.prompt is not None:
            assert self.peer_holds is not None
            self.peer_holds.record(exchange.decode.pod, held, exchange.prompt)
            self.metrics.peer_holds.inc()
        return response


def output_bound(parsed: Any) -> int:
    """The most output a request asks for (all its choices), or an estimate when it sets no bound."""
    bound = getattr(parsed, "max_completion_tokens", None) or parsed.max_tokens
    if bound is None:
        bound = _UNBOUNDED_OUTPUT_ESTIMATE if getattr(parsed, "max_completion_tokens", 0) is not None else 16
    return max(bound, 1) * max(parsed.n or 1, 1)


def queue_timeout(text: str | None) -> float | None:
    """The seconds a request's ``X-PDServe-Queue-Timeout`` header gives (None: none); 400 when it is no number."""
    if text is None:
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds < math.inf:
        raise ProtocolError(f"{QUEUE_TIMEOUT_HEADER} must be a number of seconds > 0, got {text[:32]!r}")
    return seconds


def _several_prompts(prompt: Any) -> bool:
    return isinstance(prompt, list) and len(prompt) > 1 and not isinstance(prompt[0], int)


def needs_local_prefill(parsed: Any, chat: bool) -> bool:
    """Requests one prefill leg cannot serve: one ``kv_transfer_params`` carries one prompt's blocks for one
    sequence, and pulled KV has no prompt logprobs."""
    if parsed.n is not None and parsed.n > 1:
        return True
    if chat:
        return False
    if parsed.echo and parsed.logprobs is not None:
        return True
    return _several_prompts(parsed.prompt)
