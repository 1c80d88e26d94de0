"""The P→D path of one generation request: validation, the prefill leg, the decode leg streamed back byte for
byte, and the choice between the three paths (shared/DESIGN.md §2; notes/pd-protocol-edge-cases.md 11, 12):

- ``disagg``: prefill answered ``kv_transfer_params``; decode gets the client's body plus those params.
- ``decode_only``: no prefill leg is possible or useful (no prefill pods, several choices or prompts, prompt
  logprobs) or prefill answered without params; decode prefills locally.
- ``fallback``: the prefill leg failed (unreachable, timeout, 5xx, unreadable answer) or no prefill pod is up;
  decode prefills locally.

Leaving any leg early (client gone, deadline) closes its upstream connection, which makes the engine abort
the request and free its KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from pdserve.api.protocol import ChatCompletionRequest, CompletionRequest, ProtocolError, decode_request
from pdserve.router.config import RouterConfig
from pdserve.router.metrics import RouterMetrics
from pdserve.router.pods import Pod, PodSet

logger = logging.getLogger(__name__)

REQUEST_ID = "X-Request-Id"
REQUEST_ID_KEY = web.RequestKey("request_id", str)  # where the error middleware finds it for error answers
_PREFILL_DROPPED = frozenset(("stream_options", "min_tokens", "n"))
_REMOTE_DECODE = {"do_remote_decode": True}


class _PrefillAnswer(msgspec.Struct):
    # Only the params are read; the dict keeps every field, known or not, to pass on unchanged.
    kv_transfer_params: dict[str, Any] | None = None


@dataclass
class _PrefillResult:
    params: dict[str, Any] | None = None
    failed: bool = False
    rejection: web.Response | None = None  # a prefill 4xx, returned to the client as is


@dataclass
class _Exchange:
    """One client request as it goes through the router."""

    request: web.Request
    headers: dict[str, str]  # sent on both legs
    request_id: str
    response: web.StreamResponse | None = None  # set once the answer to the client has started


class Proxy:
    def __init__(self, config: RouterConfig, prefill: PodSet, decode: PodSet, metrics: RouterMetrics) -> None:
        self.config = config
        self.prefill = prefill
        self.decode = decode
        self.metrics = metrics
        self.session: aiohttp.ClientSession | None = None  # set on startup: it needs the running loop

    def eject(self, podset: PodSet, pod: Pod, reason: str) -> None:
        if podset.mark(pod, False, reason):
            self.metrics.ejections.inc()

    async def forward(self, request: web.Request, chat: bool) -> web.StreamResponse:
        """Serve one /v1/completions (or, with ``chat``, /v1/chat/completions) request."""
        started = time.perf_counter()
        try:
            raw = await request.read()
            parsed = decode_request(raw, ChatCompletionRequest if chat else CompletionRequest)
            request_id = request.headers.get(REQUEST_ID) or uuid.uuid4().hex
            request[REQUEST_ID_KEY] = request_id
            headers = {"Content-Type": "application/json", REQUEST_ID: request_id}
            authorization = request.headers.get("Authorization")
            if authorization is not None:
                headers["Authorization"] = authorization
            exchange = _Exchange(request, headers, request_id)
            try:
                async with asyncio.timeout(self.config.request_timeout):
                    return await self._serve(exchange, raw, parsed, chat)
            except TimeoutError:
                self.metrics.errors["timeout"].inc()
                if exchange.response is None:
                    raise ProtocolError(f"the request took longer than {self.config.request_timeout:g} s", 504,
                                        error_type="timeout") from None
                _cut(exchange)
                return exchange.response
        except asyncio.CancelledError:
            self.metrics.errors["client_disconnect"].inc()  # aiohttp cancels the handler when the client goes
            raise
        finally:
            self.metrics.latency.observe(time.perf_counter() - started)

    async def _serve(self, exchange: _Exchange, raw: bytes, parsed: Any, chat: bool) -> web.StreamResponse:
        if not self.prefill or _needs_local_prefill(parsed, chat):
            self.metrics.paths["decode_only"].inc()
            return await self._decode_leg(exchange, raw)  # the client's bytes, unchanged
        body = msgspec.json.decode(raw)  # the client's object, unknown fields included
        result = await self._prefill_leg(exchange, body, chat)
        if result.rejection is not None:
            return result.rejection
        if result.failed:
            self.metrics.paths["fallback"].inc()
            return await self._decode_leg(exchange, raw)
        if result.params is None:
            self.metrics.paths["decode_only"].inc()
            return await self._decode_leg(exchange, raw)
        self.metrics.paths["disagg"].inc()
        body["kv_transfer_params"] = result.params
        return await self._decode_leg(exchange, msgspec.json.encode(body))

    async def _prefill_leg(self, exchange: _Exchange, body: dict[str, Any], chat: bool) -> _PrefillResult:
        # No healthy prefill pod: decode can prefill at once, which beats waiting on a pod known to be down.
        pod = self.prefill.choose(healthy_only=True)
        if pod is None:
            self.metrics.errors["no_prefill"].inc()
            return _PrefillResult(failed=True)
        leg = {key: value for key, value in body.items() if key not in _PREFILL_DROPPED}
        leg["max_tokens"] = 1
        if chat:
            leg["max_completion_tokens"] = 1
        leg["stream"] = False
        leg["kv_transfer_params"] = _REMOTE_DECODE
        pod.in_flight += 1
        try:
            async with self.session.post(pod.url + exchange.request.path, data=msgspec.json.encode(leg),
                                         headers=exchange.headers) as answer:
                payload = await answer.read()
                status = answer.status
                content_type = answer.headers.get("Content-Type", "application/json")
        except (aiohttp.ClientError, TimeoutError) as error:
            logger.debug("request %s: prefill pod %s failed (%r); decode prefills", exchange.request_id, pod.url,
                         error)
            self.metrics.errors["prefill_unreachable"].inc()
            if isinstance(error, aiohttp.ClientConnectorError):
                self.eject(self.prefill, pod, f"connection failed: {error}")
            return _PrefillResult(failed=True)
        finally:
            pod.in_flight -= 1
        if 400 <= status < 500:
            return _PrefillResult(rejection=web.Response(
                body=payload, status=status, headers={"Content-Type": content_type, REQUEST_ID: exchange.request_id}))
        if status != 200:
            self.metrics.errors["prefill_5xx"].inc()
            return _PrefillResult(failed=True)
        try:
            return _PrefillResult(params=msgspec.json.decode(payload, type=_PrefillAnswer).kv_transfer_params)
        except msgspec.MsgspecError:
            self.metrics.errors["prefill_bad_answer"].inc()
            return _PrefillResult(failed=True)

    async def _decode_leg(self, exchange: _Exchange, body: bytes) -> web.StreamResponse:
        failed: Pod | None = None
        for _ in range(2):  # a second pod only when the first answered nothing at all
            pod = self.decode.choose(exclude=failed)
            if pod is None:
                break
            pod.in_flight += 1
            try:
                try:
                    answer = await self.session.post(pod.url + exchange.request.path, data=body,
                                                     headers=exchange.headers)
                except aiohttp.ClientConnectionError as error:
                    self.metrics.errors["decode_unreachable"].inc()
                    if isinstance(error, aiohttp.ClientConnectorError):
                        self.eject(self.decode, pod, f"connection failed: {error}")
                    failed = pod
                    continue
                if answer.status == 503 and len(self.decode) > 1 and failed is None:
                    # Overloaded or draining: nothing was generated, so another pod may take it.
                    self.metrics.errors["decode_unavailable"].inc()
                    answer.release()
                    failed = pod
                    continue
                try:
                    return await self._relay(exchange, answer)
                finally:
                    # Unread content makes release() close the connection: the engine then aborts the request.
                    answer.release()
            finally:
                pod.in_flight -= 1
        self.metrics.errors["no_decode"].inc()
        raise ProtocolError("no decode pod is reachable", 503, error_type="service_unavailable")

    async def _relay(self, exchange: _Exchange, answer: aiohttp.ClientResponse) -> web.StreamResponse:
        """The decode pod's answer to the client: status, content type and bytes as they come."""
        content_type = answer.headers.get("Content-Type", "application/json")
        if not content_type.startswith("text/event-stream"):
            try:
                payload = await answer.read()
            except aiohttp.ClientError as error:
                self.metrics.errors["decode_broken"].inc()
                raise ProtocolError(f"the decode pod failed mid-answer: {type(error).__name__}", 502,
                                    error_type="bad_gateway") from error
            headers = {"Content-Type": content_type, REQUEST_ID: exchange.request_id}
            if "Retry-After" in answer.headers:  # an overloaded or draining pod's hint, for the client
                headers["Retry-After"] = answer.headers["Retry-After"]
            return web.Response(body=payload, status=answer.status, headers=headers)
        response = web.StreamResponse(status=answer.status, headers={
            "Content-Type": content_type, "Cache-Control": "no-cache", REQUEST_ID: exchange.request_id})
        exchange.response = response
        await response.prepare(exchange.request)
        chunks = answer.content.iter_any()
        while True:
            try:
                chunk = await chunks.__anext__()
            except StopAsyncIteration:
                break
            except aiohttp.ClientError:
                # The client must not mistake a cut answer for a whole one: end its connection, not the stream.
                self.metrics.errors["decode_broken"].inc()
                _cut(exchange)
                return response
            try:
                await response.write(chunk)
            except ConnectionResetError:
                self.metrics.errors["client_disconnect"].inc()
                return response  # the caller's release() closes the decode connection
        await response.write_eof()
        return response


def _needs_local_prefill(parsed: Any, chat: bool) -> bool:
    """Requests one prefill leg cannot serve: one ``kv_transfer_params`` carries one prompt's blocks for one
    sequence, and pulled KV has no prompt logprobs."""
    if parsed.n is not None and parsed.n > 1:
        return True
    if chat:
        return False
    if parsed.echo and parsed.logprobs is not None:
        return True
    prompt = parsed.prompt
    return isinstance(prompt, list) and len(prompt) > 1 and not isinstance(prompt[0], int)


def _cut(exchange: _Exchange) -> None:
    transport = exchange.request.transport
    if transport is not None:
        transport.close()
