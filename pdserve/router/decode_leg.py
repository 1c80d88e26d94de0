"""The decode leg of a request: sent to the decode pod the request holds and, while nothing has reached the
client, to another (at most ``MAX_DECODE_ATTEMPTS`` pods) when that one cannot be reached, answers 503, leaves
rotation (hung) or breaks before its first byte; its answer is relayed to the client as it comes, byte for byte
(a stream's report comment taken out). Its answer also settles whether a request sent with a prefill leg's
params counts as disaggregated: the engine says in a header when it could not use them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from pdserve.api.protocol import KV_PARAMS_REJECTED_HEADER, ProtocolError
from pdserve.api.report import REPORT_HEADER, Report, from_header, take_comment
from pdserve.router.exchange import REQUEST_ID, Exchange
from pdserve.router.metrics import RouterMetrics
from pdserve.router.pods import Pod, PodSet
from pdserve.router.policy import Choice, Chooser
from pdserve.router.upstream import Upstream, Usage, UsageAnswer

MAX_DECODE_ATTEMPTS = 3
_TAIL_CHUNKS = 3  # a stream's last chunks kept to find its usage event (about 300 bytes; chunks are events)


class _NothingSent(Exception):
    """The decode pod's stream broke before its first byte: another pod may still serve the request."""


class _LeftRotation(Exception):
    """The decode pod left rotation (its health probe failed) before its first byte: it may be hung."""


async def _unless_left_rotation(awaitable: Any, left_rotation: asyncio.Event | None) -> Any:
    """``awaitable``'s result, unless ``left_rotation`` is set first (then it is cancelled and
    :class:`_LeftRotation` raised). None: no race (the pod was out of rotation when chosen)."""
    if left_rotation is None:
        return await awaitable
    work = asyncio.ensure_future(awaitable)
    if not left_rotation.is_set():
        watch = asyncio.ensure_future(left_rotation.wait())
        try:
            await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
    if work.done():
        return work.result()
    work.cancel()
    with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
        result = await work  # finished meanwhile after all: release what it holds
        if isinstance(result, aiohttp.ClientResponse):
            result.release()
    raise _LeftRotation()


class DecodeLegs:
    def __init__(self, upstream: Upstream, pods: PodSet, chooser: Chooser, metrics: RouterMetrics) -> None:
        self.upstream = upstream
        self.pods = pods
        self.chooser = chooser
        self.metrics = metrics

    async def send(self, exchange: Exchange, body: bytes) -> web.StreamResponse:
        """The client's answer: the first decode pod's that takes ``body``; 503 if none does."""
        tried: list[Pod] = []
        attempts = min(MAX_DECODE_ATTEMPTS, len(self.pods))
        while exchange.decode is not None:
            choice = exchange.decode
            pod = choice.pod
            self.metrics.chose("decode", pod.url, choice.policy)
            last = len(tried) + 1 >= attempts
            # Until its first byte the request may go elsewhere if the pod leaves rotation (hung: its health
            # probe times out) - unless it was out of rotation already when chosen (nothing better was left).
            left_rotation = pod.left_rotation if pod.healthy else None
            exchange.decode_sent = time.perf_counter()
            try:
                answer = await _unless_left_rotation(
                    self.upstream.post(pod, exchange.request.path, body, exchange.headers), left_rotation
                )
            except _LeftRotation:
                self.metrics.errors["decode_hung"].inc()
            except aiohttp.ClientConnectionError as error:
                self.metrics.errors["decode_unreachable"].inc()
                if isinstance(error, aiohttp.ClientConnectorError):  # nothing listens there: out at once
                    self.upstream.eject(self.pods, pod, f"connection failed: {error}")
                else:
                    self.upstream.failed(self.pods, pod, f"{type(error).__name__}: {error}")
            else:
                try:
                    if answer.status == 503 and not last:
                        # Overloaded or draining: nothing was generated, so another pod may take it.
                        self.metrics.errors["decode_unavailable"].inc()
                    else:
                        return await self._relay(exchange, choice, answer, left_rotation)
                except _NothingSent as error:
                    self.metrics.errors["decode_unreachable"].inc()
                    self.upstream.failed(self.pods, pod, f"stream broke before its first byte: {error.__cause__!r}")
                except _LeftRotation:
                    self.metrics.errors["decode_hung"].inc()
                finally:
                    # Unread content makes release() close the connection: the engine then aborts the request.
                    answer.release()
            tried.append(pod)
            if last:
                break
            exchange.hold(self.chooser.choose(self.pods, exchange.prompt, exchange.session, exclude=tried))
            if exchange.decode is not None:
                self.metrics.retries.inc()
        self.metrics.errors["no_decode"].inc()
        self._count_disagg(exchange, None)
        raise ProtocolError("no decode pod is reachable", 503, error_type="service_unavailable")

    def _count_disagg(self, exchange: Exchange, rejected: str | None) -> None:
        """The path of a request sent with P/D params, now that decode said whether it used them."""
        if exchange.disagg_pending:
            exchange.disagg_pending = False
            if rejected is None:
                self.metrics.paths["disagg"].inc()
            else:  # decode computed the prompt itself (another model's KV, another prompt's)
                self.metrics.errors["decode_rejected_params"].inc()
                self.metrics.paths["fallback"].inc()

    async def _relay(
        self,
        exchange: Exchange,
        choice: Choice,
        answer: aiohttp.ClientResponse,
        left_rotation: asyncio.Event | None = None,
    ) -> web.StreamResponse:
        """The decode pod's answer to the client: status, content type and bytes as they come. Until the
        first byte reaches the client, ``left_rotation`` being set abandons it (:class:`_LeftRotation`)."""
        pod = choice.pod
        exchange.decode_answered = True
        self._count_disagg(exchange, answer.headers.get(KV_PARAMS_REJECTED_HEADER))
        content_type = answer.headers.get("Content-Type", "application/json")
        if not content_type.startswith("text/event-stream"):
            try:
                payload = await _unless_left_rotation(answer.read(), left_rotation)
            except aiohttp.ClientError as error:
                self.metrics.errors["decode_broken"].inc()
                self.upstream.failed(self.pods, pod, f"answer broken: {type(error).__name__}")
                raise ProtocolError(
                    f"the decode pod failed mid-answer: {type(error).__name__}", 502, error_type="bad_gateway"
                ) from error
            self._answered(pod, answer.status)
            if answer.status == 200:
                self._reported(exchange, from_header(answer.headers.get(REPORT_HEADER)))
            if answer.status == 200 and choice.block_size:
                with contextlib.suppress(msgspec.MsgspecError):  # no usage to learn from: nothing to count
                    self.upstream.observe("decode", choice, msgspec.json.decode(payload, type=UsageAnswer).usage)
            headers = {"Content-Type": content_type, REQUEST_ID: exchange.request_id}
            if "Retry-After" in answer.headers:  # an overloaded or draining pod's hint, for the client
                headers["Retry-After"] = answer.headers["Retry-After"]
            return web.Response(body=payload, status=answer.status, headers=headers)
        chunks = answer.content.iter_any()
        # The client's answer starts with the first byte from decode, so until then another pod can take over.
        try:
            first = await _unless_left_rotation(chunks.__anext__(), left_rotation)
        except StopAsyncIteration:
            first = b""
        except aiohttp.ClientError as error:
            raise _NothingSent() from error
        response = web.StreamResponse(
            status=answer.status,
            headers={"Content-Type": content_type, "Cache-Control": "no-cache", REQUEST_ID: exchange.request_id},
        )
        exchange.response = response
        await response.prepare(exchange.request)
        tail: deque[bytes] | None = deque((first,), _TAIL_CHUNKS) if exchange.stream_usage else None
        chunk, report = take_comment(first)
        while True:
            try:
                await response.write(chunk)
            except ConnectionResetError:
                self.metrics.errors["client_disconnect"].inc()
                return response  # the caller's release() closes the decode connection
            try:
                chunk = await chunks.__anext__()
            except StopAsyncIteration:
                break
            except aiohttp.ClientError as error:
                # The client must not mistake a cut answer for a whole one: end its connection, not the stream.
                self.metrics.errors["decode_broken"].inc()
                self.upstream.failed(self.pods, pod, f"stream broken: {type(error).__name__}")
                exchange.cut()
                return response
            if tail is not None:
                tail.append(chunk)
            if report is None:
                chunk, report = take_comment(chunk)
        await response.write_eof()
        self._answered(pod, answer.status)
        if answer.status == 200:
            self._reported(exchange, report)
        if tail is not None and answer.status == 200:
            self.upstream.observe("decode", choice, _stream_usage(b"".join(tail)))
        return response

    def _reported(self, exchange: Exchange, report: Report | None) -> None:
        if report is not None:
            self.metrics.observe_report(report, exchange.decode_sent - exchange.started)

    def _answered(self, pod: Pod, status: int) -> None:
        if status < 500:
            pod.failures = 0
        elif status != 503:
            self.upstream.failed(self.pods, pod, f"answered {status}")


def _stream_usage(tail: bytes) -> Usage | None:
    """The usage in a stream's last data event before ``[DONE]`` (``include_usage``), read from its tail only."""
    end = tail.rfind(b"data: [DONE]")
    start = tail.rfind(b"data: {", 0, end if end >= 0 else len(tail))
    if start < 0:
        return None
    try:
        return msgspec.json.decode(tail[start + 6 : end if end > start else len(tail)].strip(), type=UsageAnswer).usage
    except msgspec.MsgspecError:
        return None
