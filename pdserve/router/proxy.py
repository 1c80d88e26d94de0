"""The P→D path of one generation request: validation, pod choice (pdserve/router/policy.py), the prefill leg,
the decode leg streamed back byte for byte, and the choice between the three paths (docs/contracts.md,
"kv_transfer_params"; every path is counted, so a silent fall back to decode-only shows in the metrics):

- ``disagg``: prefill answered ``kv_transfer_params``; decode gets the client's body plus those params.
- ``decode_only``: no prefill leg is possible or useful (no prefill pods, several choices or prompts, prompt
  logprobs; or the chosen decode pod has all but ``pd_min_prefill_tokens`` of the prompt cached) or prefill
  answered without params; decode prefills locally.
- ``fallback``: the prefill leg failed (unreachable, timeout, 5xx, unreadable answer) or no prefill pod is up;
  decode prefills locally.

The decode pod is chosen first (the P/D decider needs its cached prefix) and counts the request in flight from
then on. A decode pod that cannot be reached, or whose answer breaks before its first byte, is replaced by
another (the client has seen nothing yet). Leaving any leg early (client gone, deadline) closes its upstream
connection, which makes the engine abort the request and free its KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from pdserve.api.auth import ENGINE_ID_HEADER, ROUTER_AUTH_HEADER, RouterSigner
from pdserve.api.keys import load_router_signing
from pdserve.api.protocol import (
    KV_PARAMS_REJECTED_HEADER,
    ChatCompletionRequest,
    CompletionRequest,
    ProtocolError,
    decode_request,
)
from pdserve.api.report import REPORT_HEADER, Report, from_header, take_comment
from pdserve.router.config import RouterConfig
from pdserve.router.metrics import RouterMetrics
from pdserve.router.pods import Pod, PodSet
from pdserve.router.policy import Choice, Chooser, uncached_tokens
from pdserve.router.prompt import Prompt, PromptReader

logger = logging.getLogger(__name__)

REQUEST_ID = "X-Request-Id"
SESSION_ID = "X-Session-Id"
REQUEST_ID_KEY = web.RequestKey("request_id", str)  # where the error middleware finds it for error answers
MAX_DECODE_ATTEMPTS = 3
_PREFILL_DROPPED = frozenset(("stream_options", "min_tokens", "n"))
_REMOTE_DECODE = {"do_remote_decode": True}
_TAIL_CHUNKS = 3  # a stream's last chunks kept to find its usage event (about 300 bytes; chunks are events)


# The prefill-leg timeout without --prefill-timeout: floor + margin x (prompt tokens / pod speed).
PREFILL_TIMEOUT_FLOOR_S = 2.0
PREFILL_TIMEOUT_MARGIN = 4.0
ASSUMED_PREFILL_TOKENS_PER_S = 500.0  # until a pod's legs have been measured (a slow CPU engine's order)
# Where a prefill engine frees a leg's held blocks that no decode will pull (pdserve/server/app.py).
RELEASE_PATH = "/v1/kv_transfer/release"
RELEASE_TIMEOUT_S = 5.0


def prefill_timeout(config: RouterConfig, pod: Pod, prompt_tokens: int) -> float:
    """How long a prefill leg may take on ``pod``: ``--prefill-timeout``, else a floor plus a margin
    over what the pod's measured speed says the prompt needs (an assumed speed until measured), so a
    short prompt on a hung pod costs a few seconds, not the request timeout."""
    if config.prefill_timeout is not None:
        return config.prefill_timeout
    speed = pod.prefill_speed or ASSUMED_PREFILL_TOKENS_PER_S
    return min(PREFILL_TIMEOUT_FLOOR_S + PREFILL_TIMEOUT_MARGIN * prompt_tokens / speed, config.request_timeout)


class _Details(msgspec.Struct):
    cached_tokens: int = 0


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    prompt_tokens_details: _Details | None = None


class _UsageAnswer(msgspec.Struct):
    usage: _Usage | None = None


class _PrefillAnswer(msgspec.Struct):
    # Only the params are read; the dict keeps every field, known or not, to pass on unchanged.
    kv_transfer_params: dict[str, Any] | None = None
    usage: _Usage | None = None


@dataclass
class _PrefillResult:
    params: dict[str, Any] | None = None
    pod: Pod | None = None  # the prefill pod holding the blocks the params name
    failed: bool = False
    rejection: web.Response | None = None  # a prefill 4xx, returned to the client as is


@dataclass
class _Exchange:
    """One client request as it goes through the router."""

    request: web.Request
    headers: dict[str, str]  # sent on both legs
    request_id: str
    response: web.StreamResponse | None = None  # set once the answer to the client has started
    prompt: Prompt | None = None  # known when pod choice or the decider uses it
    session: str | None = None  # session affinity key
    decode: Choice | None = None  # the decode pod holding the request (counted in its in_flight)
    stream_usage: bool = False  # the decode stream ends with a usage event worth reading
    # Sent with a prefill leg's params: counted "disagg" once decode's answer shows it used them.
    disagg_pending: bool = False
    decode_answered: bool = False  # a decode pod has answered (so it has the request, and its params)
    started: float = 0.0  # time.perf_counter() at its arrival
    decode_sent: float = 0.0  # ... when the decode leg that answered was sent


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


class Proxy:
    def __init__(
        self,
        config: RouterConfig,
        prefill: PodSet,
        decode: PodSet,
        metrics: RouterMetrics,
        chooser: Chooser,
        prompts: PromptReader | None = None,
    ) -> None:
        self.config = config
        self.prefill = prefill
        self.decode = decode
        self.metrics = metrics
        self.chooser = chooser
        self.prompts = prompts  # None: prompts are not tokenized (no tokenizer, or nothing would use them)
        self._session: aiohttp.ClientSession | None = None  # set on startup: it needs the running loop
        self._background: set[asyncio.Task[None]] = set()  # releases sent after their request ended
        # Engines take P/D params and releases only from the router: it signs every leg it sends, for its engine.
        self._signer = RouterSigner(load_router_signing(config.keys_dir)) if config.keys_dir else None

    @property
    def session(self) -> aiohttp.ClientSession:
        """The client session of every leg (made at start-up: it needs the running loop)."""
        if self._session is None:
            raise RuntimeError("the router has not started")
        return self._session

    @session.setter
    def session(self, session: aiohttp.ClientSession) -> None:
        self._session = session

    async def _post(
        self, pod: Pod, path: str, body: bytes, headers: dict[str, str], **options: Any
    ) -> aiohttp.ClientResponse:
        """POST one leg (or release) to an engine, signed for that engine (its id from /health) when the router
        has keys. An engine that refuses it as signed for another (it restarted: a new id) says its id; the leg
        is signed for that one and sent again, once."""
        for attempt in range(2):
            signed = headers
            if self._signer is not None:
                signed = {**headers, ROUTER_AUTH_HEADER: self._signer.header("POST", path, body, pod.engine_id or "")}
            answer = await self.session.post(pod.url + path, data=body, headers=signed, **options)
            engine_id = answer.headers.get(ENGINE_ID_HEADER)
            if answer.status != 403 or not engine_id or engine_id == pod.engine_id or attempt or self._signer is None:
                return answer
            pod.engine_id = engine_id
            answer.release()
        raise AssertionError("unreachable")

    def eject(self, podset: PodSet, pod: Pod, reason: str) -> None:
        if podset.mark(pod, False, reason):
            self.metrics.ejections.inc()

    def _failed(self, podset: PodSet, pod: Pod, reason: str) -> None:
        if podset.failed(pod, reason, self.config.failure_threshold):
            self.metrics.ejections.inc()

    async def forward(self, request: web.Request, chat: bool) -> web.StreamResponse:
        """Serve one /v1/completions (or, with ``chat``, /v1/chat/completions) request."""
        started = time.perf_counter()
        exchange: _Exchange | None = None
        try:
            raw = await request.read()
            parsed = decode_request(raw, ChatCompletionRequest if chat else CompletionRequest)
            self.metrics.received.inc()
            request_id = request.headers.get(REQUEST_ID) or uuid.uuid4().hex
            request[REQUEST_ID_KEY] = request_id
            # The report (pdserve/api/report.py) feeds the length and latency histograms.
            headers = {"Content-Type": "application/json", REQUEST_ID: request_id, REPORT_HEADER: "1"}
            authorization = request.headers.get("Authorization")
            if authorization is not None:
                headers["Authorization"] = authorization
            exchange = _Exchange(request, headers, request_id, started=started)
            try:
                async with asyncio.timeout(self.config.request_timeout):
                    return await self._serve(exchange, raw, parsed, chat)
            except TimeoutError:
                self.metrics.errors["timeout"].inc()
                if exchange.response is None:
                    raise ProtocolError(
                        f"the request took longer than {self.config.request_timeout:g} s", 504, error_type="timeout"
                    ) from None
                _cut(exchange)
                return exchange.response
        except asyncio.CancelledError:
            self.metrics.errors["client_disconnect"].inc()  # aiohttp cancels the handler when the client goes
            raise
        finally:
            if exchange is not None and exchange.decode is not None:
                exchange.decode.pod.in_flight -= 1
            self.metrics.latency.observe(time.perf_counter() - started)

    async def _serve(self, exchange: _Exchange, raw: bytes, parsed: Any, chat: bool) -> web.StreamResponse:
        if parsed.kv_transfer_params is not None:
            # The P/D protocol is the router's to speak: a client's own params could make an engine hold
            # blocks for a decode that never comes, or pull from a host of the client's choosing.
            body = msgspec.json.decode(raw)
            del body["kv_transfer_params"]
            raw = msgspec.json.encode(body)
        local = not self.prefill or _needs_local_prefill(parsed, chat)
        # The prompt is read for prefix routing, or for the decider when there is a prefill leg to skip.
        if (
            self.prompts is not None
            and (self.chooser.prefix_aware or not local)
            and (chat or not _several_prompts(parsed.prompt))
        ):
            exchange.prompt = await self.prompts.read(parsed, chat)
        if self.config.session_affinity:
            exchange.session = exchange.request.headers.get(SESSION_ID) or parsed.user
        self._hold(exchange, self.chooser.choose(self.decode, exchange.prompt, exchange.session))
        decode = exchange.decode
        if decode is None:  # no decode pod known at all (discovery found none)
            self.metrics.errors["no_decode"].inc()
            raise ProtocolError("no decode pod is reachable", 503, error_type="service_unavailable")
        if decode.block_size:
            options = parsed.stream_options
            exchange.stream_usage = options is not None and bool(options.include_usage)
        if local:
            self.metrics.paths["decode_only"].inc()
            return await self._decode_leg(exchange, raw)  # the client's bytes (its kv_transfer_params aside)
        threshold = self.config.pd_min_prefill_tokens
        if threshold and exchange.prompt is not None and uncached_tokens(exchange.prompt, decode) < threshold:
            # So little to compute that a prefill leg and a KV pull would cost more than decode computing it.
            self.metrics.prefill_skipped.inc()
            self.metrics.paths["decode_only"].inc()
            return await self._decode_leg(exchange, raw)
        body = msgspec.json.decode(raw)  # the client's object, unknown fields included
        # Shielded: a client that leaves mid-leg must not cut the leg off after the prefill engine has
        # answered (its blocks then held under an id only the answer names); the leg finishes in the
        # background and its blocks are released.
        leg = asyncio.ensure_future(self._prefill_leg(exchange, body, chat))
        try:
            result = await asyncio.shield(leg)
        except asyncio.CancelledError:
            leg.add_done_callback(lambda done: self._release_abandoned_leg(done, exchange.headers))
            raise
        if result.rejection is not None:
            return result.rejection
        if result.failed:
            self.metrics.paths["fallback"].inc()
            return await self._decode_leg(exchange, raw)
        if result.params is None:
            self.metrics.paths["decode_only"].inc()
            return await self._decode_leg(exchange, raw)
        exchange.disagg_pending = True
        body["kv_transfer_params"] = result.params
        try:
            return await self._decode_leg(exchange, msgspec.json.encode(body))
        except asyncio.CancelledError:
            # The client left between the legs, or before a decode pod answered: decode may never
            # have had the params, and only it would tell prefill to free. Release from here (a
            # second release, if decode sends one too, is harmless).
            if not exchange.decode_answered and result.pod is not None:
                self._release_later(result.pod, result.params, exchange.headers)
            raise

    def _release_abandoned_leg(self, leg: asyncio.Future[_PrefillResult], headers: dict[str, str]) -> None:
        """A prefill leg whose client left before it ended: free what it holds, if anything."""
        if leg.cancelled() or leg.exception() is not None:
            return
        result = leg.result()
        if result.params is not None and result.pod is not None:
            self._release_later(result.pod, result.params, headers)

    def _release_later(self, pod: Pod, params: dict[str, Any], headers: dict[str, str]) -> None:
        task = asyncio.get_running_loop().create_task(self._release(pod, params, headers))
        self._background.add(task)  # referenced until done: the loop keeps only weak references
        task.add_done_callback(self._background.discard)

    async def _release(self, pod: Pod, params: dict[str, Any], headers: dict[str, str]) -> None:
        """Tell a prefill pod to free a leg's held blocks, best effort (the lease frees them otherwise)."""
        try:
            async with await self._post(
                pod,
                RELEASE_PATH,
                msgspec.json.encode({"kv_transfer_params": params}),
                headers,
                timeout=aiohttp.ClientTimeout(total=RELEASE_TIMEOUT_S),
            ) as answer:
                await answer.read()
                released = answer.status == 200
        except (aiohttp.ClientError, TimeoutError, RuntimeError):  # RuntimeError: the router is closing
            released = False
        self.metrics.prefill_releases.labels("sent" if released else "failed").inc()

    def _hold(self, exchange: _Exchange, choice: Choice | None) -> None:
        """Make ``choice`` the request's decode pod (counted in flight there), instead of any previous one."""
        if exchange.decode is not None:
            exchange.decode.pod.in_flight -= 1
        exchange.decode = choice
        if choice is not None:
            choice.pod.in_flight += 1

    def _observe(self, role: str, choice: Choice, payload_usage: _Usage | None) -> None:
        """Predicted against realised prefix hit of a leg whose answer reported usage."""
        if payload_usage is None or payload_usage.prompt_tokens_details is None or not choice.block_size:
            return
        self.metrics.predicted[role].inc(choice.matched)
        self.metrics.realised[role].inc(payload_usage.prompt_tokens_details.cached_tokens // choice.block_size)

    async def _prefill_leg(self, exchange: _Exchange, body: dict[str, Any], chat: bool) -> _PrefillResult:
        # No healthy prefill pod: decode can prefill at once, which beats waiting on a pod known to be down.
        # Only a prefill engine whose KV the chosen decode engine can use: same compatibility hash.
        decode_hash = exchange.decode.pod.compat_hash if exchange.decode is not None else None
        incompatible = [pod for pod in self.prefill.pods if pod.compat_hash != decode_hash]
        choice = self.chooser.choose(
            self.prefill, exchange.prompt, exchange.session, exclude=incompatible, healthy_only=True
        )
        if choice is None and len(incompatible) == len(self.prefill.pods):
            # Nothing failed: no prefill engine runs this decode engine's model (mid-rollout, say).
            self.metrics.errors["no_compatible_prefill"].inc()
            return _PrefillResult()
        if choice is None:
            self.metrics.errors["no_prefill"].inc()
            return _PrefillResult(failed=True)
        pod = choice.pod
        self.metrics.chose("prefill", pod.url, choice.policy)
        leg = {key: value for key, value in body.items() if key not in _PREFILL_DROPPED}
        leg["max_tokens"] = 1
        if chat:
            leg["max_completion_tokens"] = 1
        leg["stream"] = False
        leg["kv_transfer_params"] = _REMOTE_DECODE
        encoded = msgspec.json.encode(leg)
        # Without the tokens (no tokenizer), the body's size bounds the prompt's token count from above.
        prompt_tokens = len(exchange.prompt.token_ids) if exchange.prompt is not None else len(encoded) // 2
        timeout = prefill_timeout(self.config, pod, prompt_tokens)
        started = time.perf_counter()
        pod.in_flight += 1
        try:
            async with asyncio.timeout(timeout):
                async with await self._post(pod, exchange.request.path, encoded, exchange.headers) as answer:
                    payload = await answer.read()
                    status = answer.status
                    content_type = answer.headers.get("Content-Type", "application/json")
        except TimeoutError:
            # A hung pod (stopped, wedged) answers nothing: decode computes the prompt, and the pod
            # stays out of rotation until its health probe answers again. Leaving the leg closes its
            # connection, so the engine (if it ever runs again) aborts it and frees its blocks.
            logger.warning(
                "request %s: prefill pod %s took over %.1f s; decode prefills", exchange.request_id, pod.url, timeout
            )
            self.metrics.errors["prefill_timeout"].inc()
            self.eject(self.prefill, pod, f"a prefill leg took over {timeout:.1f} s")
            return _PrefillResult(failed=True)
        except aiohttp.ClientError as error:
            logger.debug("request %s: prefill pod %s failed (%r); decode prefills", exchange.request_id, pod.url, error)
            self.metrics.errors["prefill_unreachable"].inc()
            if isinstance(error, aiohttp.ClientConnectorError):  # nothing listens there: out at once
                self.eject(self.prefill, pod, f"connection failed: {error}")
            else:
                self._failed(self.prefill, pod, f"{type(error).__name__}: {error}")
            return _PrefillResult(failed=True)
        finally:
            pod.in_flight -= 1
        if 400 <= status < 500:
            pod.failures = 0
            return _PrefillResult(
                rejection=web.Response(
                    body=payload, status=status, headers={"Content-Type": content_type, REQUEST_ID: exchange.request_id}
                )
            )
        if status != 200:
            self.metrics.errors["prefill_5xx"].inc()
            if status != 503:  # 503: busy or draining, which its health check tells
                self._failed(self.prefill, pod, f"answered {status}")
            return _PrefillResult(failed=True)
        pod.failures = 0
        try:
            answer_body = msgspec.json.decode(payload, type=_PrefillAnswer)
        except msgspec.MsgspecError:
            self.metrics.errors["prefill_bad_answer"].inc()
            return _PrefillResult(failed=True)
        self._observe("prefill", choice, answer_body.usage)
        result = _PrefillResult(params=answer_body.kv_transfer_params, pod=pod)
        usage = answer_body.usage
        if usage is not None and usage.prompt_tokens:
            computed = usage.prompt_tokens - (
                usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
            )
            speed = max(computed, 1) / max(time.perf_counter() - started, 1e-3)
            pod.prefill_speed = speed if pod.prefill_speed is None else 0.8 * pod.prefill_speed + 0.2 * speed
        return result

    async def _decode_leg(self, exchange: _Exchange, body: bytes) -> web.StreamResponse:
        tried: list[Pod] = []
        attempts = min(MAX_DECODE_ATTEMPTS, len(self.decode))
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
                    self._post(pod, exchange.request.path, body, exchange.headers), left_rotation
                )
            except _LeftRotation:
                self.metrics.errors["decode_hung"].inc()
            except aiohttp.ClientConnectionError as error:
                self.metrics.errors["decode_unreachable"].inc()
                if isinstance(error, aiohttp.ClientConnectorError):  # nothing listens there: out at once
                    self.eject(self.decode, pod, f"connection failed: {error}")
                else:
                    self._failed(self.decode, pod, f"{type(error).__name__}: {error}")
            else:
                try:
                    if answer.status == 503 and not last:
                        # Overloaded or draining: nothing was generated, so another pod may take it.
                        self.metrics.errors["decode_unavailable"].inc()
                    else:
                        return await self._relay(exchange, choice, answer, left_rotation)
                except _NothingSent as error:
                    self.metrics.errors["decode_unreachable"].inc()
                    self._failed(self.decode, pod, f"stream broke before its first byte: {error.__cause__!r}")
                except _LeftRotation:
                    self.metrics.errors["decode_hung"].inc()
                finally:
                    # Unread content makes release() close the connection: the engine then aborts the request.
                    answer.release()
            tried.append(pod)
            if last:
                break
            self._hold(exchange, self.chooser.choose(self.decode, exchange.prompt, exchange.session, exclude=tried))
            if exchange.decode is not None:
                self.metrics.retries.inc()
        self.metrics.errors["no_decode"].inc()
        self._count_disagg(exchange, None)
        raise ProtocolError("no decode pod is reachable", 503, error_type="service_unavailable")

    def _count_disagg(self, exchange: _Exchange, rejected: str | None) -> None:
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
        exchange: _Exchange,
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
                self._failed(self.decode, pod, f"answer broken: {type(error).__name__}")
                raise ProtocolError(
                    f"the decode pod failed mid-answer: {type(error).__name__}", 502, error_type="bad_gateway"
                ) from error
            self._answered(pod, answer.status)
            if answer.status == 200:
                self._reported(exchange, from_header(answer.headers.get(REPORT_HEADER)))
            if answer.status == 200 and choice.block_size:
                with contextlib.suppress(msgspec.MsgspecError):  # no usage to learn from: nothing to count
                    self._observe("decode", choice, msgspec.json.decode(payload, type=_UsageAnswer).usage)
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
                self._failed(self.decode, pod, f"stream broken: {type(error).__name__}")
                _cut(exchange)
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
            self._observe("decode", choice, _stream_usage(b"".join(tail)))
        return response

    def _reported(self, exchange: _Exchange, report: Report | None) -> None:
        if report is not None:
            self.metrics.observe_report(report, exchange.decode_sent - exchange.started)

    def _answered(self, pod: Pod, status: int) -> None:
        if status < 500:
            pod.failures = 0
        elif status != 503:
            self._failed(self.decode, pod, f"answered {status}")


def _stream_usage(tail: bytes) -> _Usage | None:
    """The usage in a stream's last data event before ``[DONE]`` (``include_usage``), read from its tail only."""
    end = tail.rfind(b"data: [DONE]")
    start = tail.rfind(b"data: {", 0, end if end >= 0 else len(tail))
    if start < 0:
        return None
    try:
        return msgspec.json.decode(tail[start + 6 : end if end > start else len(tail)].strip(), type=_UsageAnswer).usage
    except msgspec.MsgspecError:
        return None


def _several_prompts(prompt: Any) -> bool:
    return isinstance(prompt, list) and len(prompt) > 1 and not isinstance(prompt[0], int)


def _needs_local_prefill(parsed: Any, chat: bool) -> bool:
    """Requests one prefill leg cannot serve: one ``kv_transfer_params`` carries one prompt's blocks for one
    sequence, and pulled KV has no prompt logprobs."""
    if parsed.n is not None and parsed.n > 1:
        return True
    if chat:
        return False
    if parsed.echo and parsed.logprobs is not None:
        return True
    return _several_prompts(parsed.prompt)


def _cut(exchange: _Exchange) -> None:
    transport = exchange.request.transport
    if transport is not None:
        transport.close()
