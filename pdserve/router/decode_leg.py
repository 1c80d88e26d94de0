"""The decode leg of a request: sent to the decode pod the request holds and, while nothing has reached the
client, to another (at most ``MAX_DECODE_ATTEMPTS`` pods) when that one cannot be reached, answers 503, leaves
rotation (hung) or breaks before its first byte (a whole answer: before its end); its answer is relayed to the
client as it comes, a stream as whole events with the router-only comments taken out (``splice.StreamSplice``).
Its answer also settles whether a request sent with a prefill leg's params counts as disaggregated: the engine
says in a header when it could not use them.

A stream that breaks after it started (connection lost, the engine's server error, no event within
``--token-deadline``, or handed back by a draining engine) is continued on another decode pod, at most
``--migration-limit`` times: the leg carries what the client has of each choice (``kv_transfer_params.continue``),
the engine answers only what follows, under the same id, and its events join the client's stream; the broken
leg's connection is closed, which frees its KV. A continuation the engine refuses as the client's error (4xx: the
grammar rejects the history, say) ends the stream with that error event; one that cannot be continued anywhere
ends the client's connection, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import msgspec

from pdserve.api.continuation import CONTINUED_HEADER, TOKENS_HEADER
from pdserve.api.protocol import KV_PARAMS_REJECTED_HEADER, SSE_DONE
from pdserve.api.report import REPORT_HEADER, Report, from_header
from pdserve.router.config import RouterConfig
from pdserve.router.deadlines import Deadlines
from pdserve.router.exchange import REQUEST_ID, Exchange
from pdserve.router.http_server import Response, StreamResponse
from pdserve.router.leg_client import LegAnswer, LegConnectError, LegError
from pdserve.router.metrics import RouterMetrics
from pdserve.router.pods import Pod, PodSet, no_decode_pod
from pdserve.router.policy import Choice, Chooser
from pdserve.router.splice import StreamSplice
from pdserve.router.upstream import Upstream, Usage, UsageAnswer

logger = logging.getLogger(__name__)

MAX_DECODE_ATTEMPTS = 3
_ENDED = ("whole", "client_gone")  # how a relayed leg ends that needs no continuation


class _NothingSent(Exception):
    """The decode pod's stream broke before its first byte: another pod may still serve the request."""


class _LeftRotation(Exception):
    """The decode pod left rotation (its health probe failed) before its first byte: it may be hung."""


def _take_back(task: asyncio.Task[Any], cancelled_it: bool) -> bool:
    """Whether ``task``'s cancellation was a watch's alone (``cancelled_it``, and no one else's: a client that
    left cancels too); if so it is taken back, so the task goes on."""
    if not cancelled_it or task.cancelling() > 1:
        return False
    task.uncancel()
    return True


class _RotationWatch:
    """Ends the current task's wait for a decode pod's first byte if the pod leaves rotation (its health probe
    failed: it may be hung): one callback on the pod, no task per leg. Only a wait for the leg is cancelled (the
    task may itself take the pod out after a failed leg); a pod that left between waits ends the next one."""

    def __init__(self, pod: Pod) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.task = task
        self.pod = pod
        self.left = False
        self.waiting = False
        self._cancelled = False
        pod.on_leave.add(self._leave)

    def _leave(self) -> None:
        self.left = True
        if self.waiting:
            self._cancelled = True
            self.task.cancel()

    def took_back(self) -> bool:
        """Whether the cancellation just raised was this watch's alone (then it is taken back)."""
        return _take_back(self.task, self._cancelled)

    def close(self) -> None:
        self.pod.on_leave.discard(self._leave)


class _UnlessLeftRotation:
    """``with _UnlessLeftRotation(watch): await ...``: the wait, or :class:`_LeftRotation` if ``watch``'s pod left
    rotation before it ended (a context, not a wrapping coroutine: the wait's wake-ups cross no frame of its)."""

    __slots__ = ("watch",)

    def __init__(self, watch: _RotationWatch | None) -> None:
        self.watch = watch

    def __enter__(self) -> None:
        watch = self.watch
        if watch is not None:
            if watch.left:
                raise _LeftRotation()
            watch.waiting = True

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, traceback: object) -> None:
        watch = self.watch
        if watch is None:
            return
        watch.waiting = False
        if kind is asyncio.CancelledError and watch.took_back():
            raise _LeftRotation() from None


class _StallWatch:
    """Ends the current task's wait for a leg's next chunk once ``deadline`` seconds pass without one (it is
    cancelled, and ``stalled()`` says why): kept by the router's deadline tick, not a timer per chunk, so a
    stream's relay stays as cheap as a pass-through. Only a wait for the leg is cancelled, never a write to the
    client."""

    __slots__ = ("_deadlines", "_fired", "deadline", "last", "loop", "reading", "task", "when")

    def __init__(self, deadline: float, deadlines: Deadlines) -> None:
        self.loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        self.task = task
        self.deadline = deadline
        self.last = self.loop.time()
        self.when = self.last + deadline
        self.reading = False
        self._fired = False
        self._deadlines = deadlines
        deadlines.keep(self)

    def fed(self) -> None:
        self.last = self.loop.time()
        self.reading = False

    def stalled(self) -> bool:
        """Whether the cancellation just raised was this watch's alone (then it is taken back)."""
        return _take_back(self.task, self._fired)

    def close(self) -> None:
        self._deadlines.drop(self)

    def due(self, now: float) -> None:
        idle = now - self.last
        if idle < self.deadline or not self.reading:
            self.when = now + max(self.deadline - idle, 0.05)
            return
        self._deadlines.drop(self)
        self._fired = True
        self.task.cancel()


class DecodeLegs:
    def __init__(
        self,
        config: RouterConfig,
        upstream: Upstream,
        pods: PodSet,
        chooser: Chooser,
        metrics: RouterMetrics,
        deadlines: Deadlines,
    ) -> None:
        self.config = config
        self.deadlines = deadlines
        self.upstream = upstream
        self.pods = pods
        self.chooser = chooser
        self.metrics = metrics

    def _headers(self, exchange: Exchange) -> dict[str, str]:
        if self.config.migration_limit > 0:  # a stream that breaks is continued from the tokens it carried
            return {**exchange.headers, TOKENS_HEADER: "1"}
        return exchange.headers

    async def send(self, exchange: Exchange, body: bytes) -> Response | StreamResponse:
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
            watch = _RotationWatch(pod) if pod.healthy else None
            exchange.decode_sent = time.perf_counter()
            try:
                with _UnlessLeftRotation(watch):
                    answer = await self.upstream.post(pod, exchange.request.path, body, self._headers(exchange))
            except _LeftRotation:
                self.metrics.errors["decode_hung"].inc()
            except LegError as error:
                self._unreachable(pod, error)
            else:
                try:
                    if answer.status == 503 and not last:
                        # Overloaded or draining: nothing was generated, so another pod may take it.
                        self.metrics.errors["decode_unavailable"].inc()
                    else:
                        return await self._relay(exchange, choice, answer, watch)
                except _NothingSent as error:
                    self.metrics.errors["decode_unreachable"].inc()
                    self.upstream.failed(self.pods, pod, f"stream broke before its first byte: {error.__cause__!r}")
                except _LeftRotation:
                    self.metrics.errors["decode_hung"].inc()
                finally:
                    # Unread content makes release() close the connection: the engine then aborts the request.
                    answer.release()
            finally:
                if watch is not None:
                    watch.close()
            tried.append(pod)
            if last:
                break
            exchange.hold(self.chooser.choose(self.pods, exchange.prompt, exchange.session, exclude=tried))
            if exchange.decode is not None:
                self.metrics.retries.inc()
        self.metrics.errors["no_decode"].inc()
        self._count_disagg(exchange, None)
        raise no_decode_pod(self.config.health_interval)

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
        answer: LegAnswer,
        watch: _RotationWatch | None = None,
    ) -> Response | StreamResponse:
        """The decode pod's answer to the client: status, content type and bytes as they come. Until the
        first byte reaches the client, its pod leaving rotation abandons it (:class:`_LeftRotation`)."""
        pod = choice.pod
        exchange.decode_answered = True
        self._count_disagg(exchange, answer.headers.get(KV_PARAMS_REJECTED_HEADER))
        content_type = answer.headers.get("Content-Type", "application/json")
        if not content_type.startswith("text/event-stream"):
            try:
                with _UnlessLeftRotation(watch):
                    payload = await answer.read()
            except LegError as error:
                # Nothing reached the client: another pod may answer it whole.
                self.metrics.errors["decode_broken"].inc()
                raise _NothingSent() from error
            self._answered(pod, answer.status)
            if answer.status == 200:
                self._reported(exchange, from_header(answer.headers.get(REPORT_HEADER)))
            if answer.status == 200 and choice.block_size:
                with contextlib.suppress(msgspec.MsgspecError):  # no usage to learn from: nothing to count
                    self.upstream.observe("decode", choice, msgspec.json.decode(payload, type=UsageAnswer).usage)
            headers = {"Content-Type": content_type, REQUEST_ID: exchange.request_id}
            if "Retry-After" in answer.headers:  # an overloaded or draining pod's hint, for the client
                headers["Retry-After"] = answer.headers["Retry-After"]
            return Response(payload, answer.status, headers)
        chunks = answer.iter_any()
        # The client's answer starts with the first byte from decode, so until then another pod can take over.
        try:
            with _UnlessLeftRotation(watch):
                first = await chunks.__anext__()
        except StopAsyncIteration:
            first = b""
        except LegError as error:
            raise _NothingSent() from error
        if watch is not None:
            watch.close()  # the stream is the client's now: leaving rotation no longer abandons it
        response = StreamResponse(
            status=answer.status,
            headers={"Content-Type": content_type, "Cache-Control": "no-cache", REQUEST_ID: exchange.request_id},
        )
        exchange.response = response
        await response.prepare(exchange.request)
        splice = StreamSplice()
        settle = _Settle(self, exchange, choice, answer.status, splice)
        end = await self._relay_events(response, splice, first, chunks, settle)
        if end not in _ENDED:
            settle.migrated = True
            self._broken(pod, end)
            answer.close()  # closed, not released: the engine aborts the request and frees its KV now
            end = await self._continue(exchange, splice, end, [pod], settle)
        if end == "client_gone":
            self.metrics.errors["client_disconnect"].inc()
            return response  # the caller's release() closes the decode connection
        if end != "whole":
            self.metrics.errors["stream_cut"].inc()
            exchange.cut()  # the client must not mistake a cut answer for a whole one
            return response
        settle()
        with contextlib.suppress(ConnectionResetError):  # a client that left once it had [DONE]
            await response.write_eof()
        return response

    def _settle(self, exchange: Exchange, choice: Choice, status: int, splice: StreamSplice, migrated: bool) -> None:
        """The accounts of a stream whose answer is whole (its report, its pod's health, its usage)."""
        if migrated:
            if splice.report is not None:  # its counts are the whole request's; its times the last leg's only
                splice.report.ttft_s = splice.report.tpot_s = None
            self._reported(exchange, splice.report)
            return
        self._answered(choice.pod, status)
        if status == 200:
            self._reported(exchange, splice.report)
        if exchange.stream_usage and status == 200 and splice.last_data:
            self.upstream.observe("decode", choice, _stream_usage(splice.last_data))

    async def _relay_events(
        self, response: StreamResponse, splice: StreamSplice, first: bytes | None, chunks: Any, settle: _Settle
    ) -> str:
        """One leg's events to the client until it ends: ``whole`` ([DONE] passed: the client's answer ended with
        it, and the leg is read to its end so its connection can serve again; or the engine closed a stream it
        answered with an error), ``client_gone``, or why it broke: ``broken`` (connection lost, or closed
        before [DONE]), ``stall`` (nothing within the token deadline), ``engine_error`` (its server error)."""
        watch = _StallWatch(self.config.token_deadline, self.deadlines) if self.config.token_deadline else None
        pending = first
        try:
            while True:
                if pending is not None:
                    chunk, pending = pending, None
                else:
                    try:
                        if watch is not None:
                            watch.reading = True
                        chunk = await chunks.__anext__()
                    except StopAsyncIteration:
                        return "whole" if splice.done else "broken"
                    except asyncio.CancelledError:
                        if watch is None or not watch.stalled():
                            raise
                        return "whole" if splice.done else "stall"
                    except LegError:
                        return "whole" if splice.done else "broken"
                    finally:
                        if watch is not None:
                            watch.fed()
                events = splice.feed(chunk)
                if events and not response.ended:
                    try:
                        if splice.done:  # [DONE]: the client's answer ends with these events, in one write,
                            settle()  # once its accounts are kept (a client may read the metrics at once)
                            await response.write_eof(events)
                        else:
                            await response.write(events)
                    except ConnectionResetError:
                        return "client_gone"
                if splice.failed_engine:
                    return "engine_error"
                if splice.handed_off:
                    return "drain"
        finally:
            if watch is not None:
                watch.close()

    async def _continue(
        self, exchange: Exchange, splice: StreamSplice, cause: str, tried: list[Pod], settle: _Settle
    ) -> str:
        """Continue a broken stream on other decode pods (at most ``migration_limit`` continuations; pods that
        cannot be reached or refuse it for now are tried once each, uncounted); how it ended."""
        migrations = 0
        # Pods of the first leg's model revision (its KV compatibility hash) continue it as the first would have.
        revision = tried[0].compat_hash
        other_revisions = [pod for pod in self.pods.pods if pod.compat_hash != revision] if revision else []
        while migrations < self.config.migration_limit:
            continuation = splice.continuation()
            if continuation is None:  # it broke before its first event: nothing to answer under
                logger.warning("request %s: its stream ended (%s) before its first event", exchange.request_id, cause)
                return cause
            choice = self.chooser.choose(self.pods, exchange.prompt, exchange.session, exclude=tried + other_revisions)
            if choice is None and other_revisions:
                # A rollout left none of its revision: another model's tokens from here on, said in a metric.
                choice = self.chooser.choose(self.pods, exchange.prompt, exchange.session, exclude=tried)
                if choice is not None:
                    self.metrics.migrations_across_revisions.inc()
            exchange.hold(choice)
            if exchange.decode is None:
                logger.warning("request %s: no decode pod left to continue its stream (%s)", exchange.request_id, cause)
                return cause
            pod = exchange.decode.pod
            tried.append(pod)
            if pod.peer_source is None:  # this pod holds no turns for peers: none to remember
                exchange.peer_hold = None
            body = exchange.continuation_body(continuation)
            try:
                answer = await self.upstream.post(pod, exchange.request.path, body, self._headers(exchange))
            except LegError as error:
                self._unreachable(pod, error)
                continue
            try:
                if answer.status != 200 or answer.headers.get(CONTINUED_HEADER) != "1":
                    logger.warning(
                        "request %s: %s did not continue its stream (%d)", exchange.request_id, pod.url, answer.status
                    )
                    if 400 <= answer.status < 500 and answer.status != 429:
                        # The continuation is the client's error (its grammar rejects the history): its answer.
                        return await self._end_with_error(exchange, answer)
                    self._answered(pod, answer.status)
                    continue
                migrations += 1
                self.metrics.migrations[cause].inc()
                logger.info("request %s: its stream (%s) continues on %s", exchange.request_id, cause, pod.url)
                splice.start_leg()
                end = await self._relay_events(exchange.response, splice, None, answer.iter_any(), settle)  # type: ignore[arg-type]
                if end in _ENDED:
                    return end
                self._broken(pod, end)
                cause = end
            finally:
                answer.close()
        return cause

    async def _end_with_error(self, exchange: Exchange, answer: LegAnswer) -> str:
        """End the client's stream with the error event of a refused continuation (its JSON error body)."""
        try:
            payload = await answer.read()
            msgspec.json.decode(payload)
        except (LegError, msgspec.MsgspecError):
            return "broken"
        assert exchange.response is not None
        try:
            await exchange.response.write(b"data: " + payload.strip() + b"\n\n" + SSE_DONE)
        except ConnectionResetError:
            return "client_gone"
        return "whole"

    def _unreachable(self, pod: Pod, error: LegError) -> None:
        self.metrics.errors["decode_unreachable"].inc()
        if isinstance(error, LegConnectError):  # nothing listens there: out at once
            self.upstream.eject(self.pods, pod, f"connection failed: {error}")
        else:
            self.upstream.failed(self.pods, pod, f"{type(error).__name__}: {error}")

    def _broken(self, pod: Pod, cause: str) -> None:
        if cause == "drain":  # not a failure: the pod stops, and its health probe takes it out of rotation
            return
        self.metrics.errors["decode_broken"].inc()
        self.upstream.failed(self.pods, pod, f"stream broken ({cause})")

    def _reported(self, exchange: Exchange, report: Report | None) -> None:
        exchange.report = report
        if report is not None:
            self.metrics.observe_report(report, exchange.decode_sent - exchange.started)

    def _answered(self, pod: Pod, status: int) -> None:
        if status < 500:
            pod.failures = 0
        elif status != 503:
            self.upstream.failed(self.pods, pod, f"answered {status}")


class _Settle:
    """A stream's accounts, kept once, when its answer is whole (``DecodeLegs._settle``)."""

    __slots__ = ("choice", "done", "exchange", "legs", "migrated", "splice", "status")

    def __init__(self, legs: DecodeLegs, exchange: Exchange, choice: Choice, status: int, splice: StreamSplice) -> None:
        self.legs = legs
        self.exchange = exchange
        self.choice = choice
        self.status = status
        self.splice = splice
        self.migrated = False
        self.done = False

    def __call__(self) -> None:
        if not self.done:
            self.done = True
            self.legs._settle(self.exchange, self.choice, self.status, self.splice, self.migrated)


def _stream_usage(event: bytes) -> Usage | None:
    """The usage in a stream's last data event before ``[DONE]`` (``include_usage``)."""
    try:
        return msgspec.json.decode(event.removeprefix(b"data: "), type=UsageAnswer).usage
    except msgspec.MsgspecError:
        return None
