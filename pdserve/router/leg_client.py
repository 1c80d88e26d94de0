"""The router's HTTP/1.1 client for legs and releases: keep-alive connections to each engine, a POST written in
one call, the answer parsed by llhttp (``httptools``) as it comes: by Content-Length, chunks, or the connection's
end.

Why not aiohttp's client: per leg it costs ~90 us of CPU on this path (request and response objects, timers,
payload registries, cookie and redirect handling) - about a third of the router's cost per P/D request
(``bench/router.py``); asyncio's streams, which this client used before, cost another ~20 us a leg in readers,
waiters and the chunk framing done in Python. Engines speak plain HTTP/1.1; this client knows exactly that and
nothing more (no redirects, no cookies, no proxies, no compression). Health probes, model lists and OpenAPI
documents stay on aiohttp: they are not per request.

A connection goes back to its pool only when its answer was read to the end and the engine did not ask to
close; one idle longer than ``IDLE_S`` is dropped (the engine may close it first: aiohttp servers keep an idle
connection 75 s), so a leg is never written into a connection the engine is closing.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import AsyncIterator, Mapping
from types import TracebackType
from typing import cast
from urllib.parse import urlsplit

import httptools
from multidict import CIMultiDict

IDLE_S = 15.0  # aiohttp's client keeps idle connections as long, under the servers' 75 s
MAX_HEAD_BYTES = 64 << 10  # of an answer's status line and headers
_BUFFERED_BYTES = 1 << 20  # of an answer's body not yet taken, before reading from the engine pauses
_OWN_HEADERS = frozenset(("host", "content-length", "transfer-encoding", "connection"))  # this client's to write


class LegError(Exception):
    """A leg that got no whole answer: the connection failed, broke, or the answer was not HTTP/1.1."""


class LegConnectError(LegError):
    """Nothing answered the connection (refused, unreachable, timed out): nothing listens there."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection to an engine; the answer to its current leg as llhttp parses it."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.idle_since = 0.0
        self.error: LegError | None = None  # why the connection can carry nothing more
        self._waiter: asyncio.Future[None] | None = None
        self._reading_paused = False
        # The current answer.
        self.expecting = False  # a leg was written and its answer has not ended
        self.head_done = False
        self.complete = False
        self.keep_alive = False  # the engine keeps the connection open after this answer
        self.headers: list[tuple[str, str]] = []
        self.body: list[bytes] = []
        self._body_bytes = 0
        self._head_bytes = 0
        self._until_close = False  # the body ends with the connection (neither length nor chunks)

    def start(self) -> None:
        """A new leg is written: its answer comes next."""
        self.expecting = True
        self.head_done = self.complete = self.keep_alive = False
        self.headers = []
        self.body = []
        self._body_bytes = self._head_bytes = 0
        self._until_close = False

    def usable(self, now: float) -> bool:
        return (
            self.transport is not None
            and not self.transport.is_closing()
            and self.error is None
            and now - self.idle_since < IDLE_S
        )

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def more(self) -> asyncio.Future[None]:
        """Done once more of the answer came or the connection failed (then ``check``). A future, not a coroutine:
        awaited directly, a wake-up passes through one frame less."""
        if self.error is not None:
            raise self.error
        waiter = self._waiter = self.loop.create_future()
        return waiter

    def check(self) -> None:
        """After ``more``: LegError if the connection failed before what was waited for came (it is closed: the
        engine aborts the request)."""
        if self.error is not None and not (self.complete or self.body):
            self.close()
            raise self.error

    def take_body(self) -> bytes:
        """The body's bytes that came since the last take."""
        body = self.body
        data = body[0] if len(body) == 1 else b"".join(body)
        self.body = []
        self._body_bytes = 0
        if self._reading_paused and self.transport is not None:
            self._reading_paused = False
            self.transport.resume_reading()
        return data

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    # ----- asyncio.Protocol -----

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's: a Transport's methods, not its class

    def data_received(self, data: bytes) -> None:
        if not self.expecting:  # bytes nobody asked for: the connection is out of step
            self.error = LegError("the engine sent bytes outside an answer")
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as error:
            self.error = error.__context__ if isinstance(error.__context__, LegError) else LegError(repr(error))
            self.close()
        except httptools.HttpParserError as error:
            self.error = LegError(f"malformed answer: {error!r}")
            self.close()
        self._wake()

    def connection_lost(self, error: Exception | None) -> None:
        self.transport = None
        if self.expecting and self.head_done and self._until_close:
            self.complete = True  # the connection's end was the body's
            self.expecting = False
        elif self.error is None:
            cause = f": {error!r}" if error is not None else ""
            what = "before the answer's end" if self.expecting else "while idle"
            self.error = LegError(f"connection closed {what}{cause}")
        self._wake()

    # ----- httptools callbacks -----

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value)
        if self._head_bytes > MAX_HEAD_BYTES:
            raise LegError(f"an answer's headers over {MAX_HEAD_BYTES} bytes")
        if not name and self.headers:  # a header cut across reads continues the last
            last_name, last_value = self.headers[-1]
            self.headers[-1] = (last_name, last_value + value.decode("latin-1"))
            return
        self.headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        self.head_done = True
        framing = {name.lower() for name, _ in self.headers} & {"content-length", "transfer-encoding"}
        status = self.parser.get_status_code()
        self._until_close = not framing and status >= 200 and status not in (204, 304)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        self._body_bytes += len(body)
        if self._body_bytes > _BUFFERED_BYTES and not self._reading_paused and self.transport is not None:
            self._reading_paused = True  # the client reads slower than the engine writes
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        self.complete = True
        self.expecting = False
        self.keep_alive = self.parser.should_keep_alive()  # llhttp forgets it once the message is over


class LegAnswer:
    """An engine's answer: status and headers read, the body to read (``read``) or to take as it comes
    (``iter_any``). ``release`` returns the connection for reuse if the body was read to its end, else closes
    it (the engine then aborts the request); ``close`` always closes it."""

    def __init__(self, client: LegClient, key: str, connection: _Connection, status: int, headers: CIMultiDict) -> None:
        self.status = status
        self.headers = headers
        self._client = client
        self._key = key
        self._connection: _Connection | None = connection

    async def read(self) -> bytes:
        """The whole body."""
        connection = self._connection
        if connection is None:
            return b""
        parts = []
        while True:
            if connection.body:  # taken as it comes: a paused read (over _BUFFERED_BYTES) resumes
                parts.append(connection.take_body())
            if connection.complete:
                return parts[0] if len(parts) == 1 else b"".join(parts)
            await connection.more()
            connection.check()

    async def iter_any(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive (what came together, chunk framing taken off, in one piece)."""
        connection = self._connection
        if connection is None:
            return
        while True:
            if connection.body:
                yield connection.take_body()
                continue
            if connection.complete:
                return
            await connection.more()
            connection.check()

    def release(self) -> None:
        connection, self._connection = self._connection, None
        if connection is None:
            return
        if connection.complete and not connection.body and connection.keep_alive:
            self._client.put_back(self._key, connection)
        else:
            connection.close()

    def close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.close()

    async def __aenter__(self) -> LegAnswer:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.release()


class LegClient:
    """Keep-alive HTTP/1.1 connections to engines, pooled per scheme, host and port; no limit on their number
    (each engine's admission control is the limit, not the router's)."""

    def __init__(self, connect_timeout: float) -> None:
        self.connect_timeout = connect_timeout
        self._idle: dict[str, list[_Connection]] = {}
        self._tls: ssl.SSLContext | None = None

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> LegAnswer:
        """POST ``body`` (JSON) to ``url``; the answer once its status and headers are in."""
        base, _, path = url.partition("://")[2].partition("/")
        key = url[: url.index("://") + 3] + base
        head = [f"POST /{path} HTTP/1.1\r\nHost: {base}\r\n"]
        content_type = "Content-Type: application/json\r\n"
        for name, value in headers.items():
            lower = name.lower()
            if lower == "content-type":
                content_type = ""
            elif lower in _OWN_HEADERS:
                continue
            head.append(f"{name}: {value}\r\n")
        lines = len(head)
        head.append(content_type)
        head.append(f"Content-Length: {len(body)}\r\n\r\n")
        text = "".join(head)
        # A line break inside a name or value would add lines of the caller's making (one scan, not one per header).
        end = len(text) - len(head[-1]) - len(content_type)
        if text.count("\n", 0, end) != lines + 1 or text.count("\r", 0, end) != lines + 1:
            bad = next(name for name, value in headers.items() if "\r" in name + value or "\n" in name + value)
            raise ValueError(f"header {bad!r} has a line break")
        request = text.encode("latin-1") + body
        connection = self._pooled(key)
        reused = connection is not None
        if connection is None:
            connection = await self._connect(key)
        while True:  # written and awaited here, not in a helper: every wake-up crosses one frame less
            assert connection.transport is not None
            connection.start()
            connection.transport.write(request)
            try:
                while not connection.head_done:
                    await connection.more()
                    connection.check()
            except LegError as error:
                connection.close()
                if reused:  # an idle connection the engine closed as this leg was written: once more on a new one
                    reused = False
                    connection = await self._connect(key)
                    continue
                raise LegError(f"no answer from {key}: {error}") from error
            except BaseException:  # cancelled mid-answer: the connection's state is unknown
                connection.close()
                raise
            return LegAnswer(
                self, key, connection, connection.parser.get_status_code(), CIMultiDict(connection.headers)
            )

    def put_back(self, key: str, connection: _Connection) -> None:
        connection.idle_since = time.monotonic()
        self._idle.setdefault(key, []).append(connection)

    def close(self) -> None:
        """Close every idle connection (those in use close with their answers)."""
        for connections in self._idle.values():
            for connection in connections:
                connection.close()
        self._idle.clear()

    def _pooled(self, key: str) -> _Connection | None:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            connection = idle.pop()
            if connection.usable(now):
                return connection
            connection.close()
        return None

    async def _connect(self, key: str) -> _Connection:
        parts = urlsplit(key)
        tls = parts.scheme == "https"
        if tls and self._tls is None:
            self._tls = ssl.create_default_context()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, connection = await asyncio.get_running_loop().create_connection(
                    _Connection,
                    parts.hostname or "",
                    parts.port or (443 if tls else 80),
                    ssl=self._tls if tls else None,
                )
        except (OSError, TimeoutError) as error:
            raise LegConnectError(f"cannot connect to {key}: {error!r}") from error
        return connection
