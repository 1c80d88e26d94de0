"""The router's HTTP/1.1 client for legs and releases: keep-alive connections to each engine, a POST written in
one call, the answer read by Content-Length or chunks as they come.

Why not aiohttp's client: per leg it costs ~90 us of CPU on this path (request and response objects, timers,
payload registries, cookie and redirect handling) - about a third of the router's cost per P/D request
(``bench/router.py``). Engines speak plain HTTP/1.1; this client knows exactly that and nothing more (no
redirects, no cookies, no proxies, no compression). Health probes, model lists and OpenAPI documents stay on
aiohttp: they are not per request.

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
from urllib.parse import urlsplit

from multidict import CIMultiDict

IDLE_S = 15.0  # aiohttp's client keeps idle connections as long, under the servers' 75 s
MAX_HEAD_BYTES = 64 << 10  # of an answer's status line and headers
_MAX_SIZE_LINE = 1024  # a chunk's size and extensions
_OWN_HEADERS = frozenset(("host", "content-length", "transfer-encoding", "connection"))  # this client's to write


class LegError(Exception):
    """A leg that got no whole answer: the connection failed, broke, or the answer was not HTTP/1.1."""


class LegConnectError(LegError):
    """Nothing answered the connection (refused, unreachable, timed out): nothing listens there."""


class _Connection:
    __slots__ = ("idle_since", "reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.idle_since = 0.0

    def usable(self, now: float) -> bool:
        return not self.writer.is_closing() and not self.reader.at_eof() and now - self.idle_since < IDLE_S

    def close(self) -> None:
        self.writer.close()


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
        self._chunked = "chunked" in headers.get("Transfer-Encoding", "").lower()
        length = headers.get("Content-Length")
        self._remaining = int(length) if length is not None and not self._chunked else None
        self._reusable = headers.get("Connection", "").lower() != "close" and (self._chunked or length is not None)
        self._done = self._remaining == 0

    async def read(self) -> bytes:
        """The whole body."""
        return b"".join([chunk async for chunk in self.iter_any()])

    async def iter_any(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive (each HTTP chunk's data, or what the socket gave)."""
        connection = self._connection
        if connection is None or self._done:
            return
        reader = connection.reader
        try:
            if self._chunked:
                # Each read's complete chunks at once: an engine's burst of events is one write to the client.
                buffer = bytearray()
                while True:
                    data = await reader.read(1 << 16)
                    if not data:
                        raise LegError("connection closed before the answer's end")
                    buffer += data
                    ready, ended = _take_chunks(buffer)
                    if ready:
                        yield ready
                    if ended:
                        self._reusable = self._reusable and not buffer  # nothing may follow an answer
                        break
            elif self._remaining is not None:
                while self._remaining > 0:
                    data = await reader.read(min(self._remaining, 1 << 16))
                    if not data:
                        raise LegError("connection closed before the answer's end")
                    self._remaining -= len(data)
                    yield data
            else:  # neither length nor chunks: the body ends with the connection
                while data := await reader.read(1 << 16):
                    yield data
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as error:
            self.close()
            raise LegError(f"malformed or cut answer: {error!r}") from error
        except OSError as error:
            self.close()
            raise LegError(f"connection broke: {error!r}") from error
        self._done = True

    def release(self) -> None:
        connection, self._connection = self._connection, None
        if connection is None:
            return
        if self._done and self._reusable:
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


def _take_chunks(buffer: bytearray) -> tuple[bytes, bool]:
    """The data of the complete chunks at the start of ``buffer``, removed from it, and whether the body's end
    (its last chunk, trailers and blank line) was among them. Raises ValueError on a malformed chunk size."""
    taken: list[bytes] = []
    at = 0
    while True:
        line_end = buffer.find(b"\r\n", at)
        if line_end < 0:
            if len(buffer) - at > _MAX_SIZE_LINE:
                raise ValueError("a chunk size line without its end")
            break
        size = int(buffer[at:line_end].split(b";", 1)[0], 16)
        if size == 0:
            end = buffer.find(b"\r\n\r\n", line_end)  # trailers (if any), then the blank line
            if end < 0:
                break
            del buffer[: end + 4]
            return b"".join(taken), True
        data_end = line_end + 2 + size
        if len(buffer) < data_end + 2:
            break
        taken.append(bytes(buffer[line_end + 2 : data_end]))
        at = data_end + 2
    del buffer[:at]
    return b"".join(taken), False


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
            if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
                raise ValueError(f"header {name!r} has a line break")
            lower = name.lower()
            if lower == "content-type":
                content_type = ""
            elif lower in _OWN_HEADERS:
                continue
            head.append(f"{name}: {value}\r\n")
        head.append(content_type)
        head.append(f"Content-Length: {len(body)}\r\n\r\n")
        request = "".join(head).encode("latin-1") + body
        connection = self._pooled(key)
        if connection is not None:
            try:
                return await self._exchange(key, connection, request)
            except LegError:
                # An idle connection the engine closed as this leg was written: once more on a new one.
                pass
        return await self._exchange(key, await self._connect(key), request)

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
                reader, writer = await asyncio.open_connection(
                    parts.hostname,
                    parts.port or (443 if tls else 80),
                    ssl=self._tls if tls else None,
                    limit=MAX_HEAD_BYTES,
                )
        except (OSError, TimeoutError) as error:
            raise LegConnectError(f"cannot connect to {key}: {error!r}") from error
        return _Connection(reader, writer)

    async def _exchange(self, key: str, connection: _Connection, request: bytes) -> LegAnswer:
        try:
            connection.writer.write(request)
            head = await connection.reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError) as error:
            connection.close()
            raise LegError(f"no answer from {key}: {error!r}") from error
        except BaseException:  # cancelled mid-answer: the connection's state is unknown
            connection.close()
            raise
        lines = head[:-4].decode("latin-1").split("\r\n")
        status_line = lines[0].split(" ", 2)
        if len(status_line) < 2 or not status_line[0].startswith("HTTP/1.") or not status_line[1].isdigit():
            connection.close()
            raise LegError(f"not an HTTP/1.1 answer from {key}: {lines[0][:80]!r}")
        headers: CIMultiDict[str] = CIMultiDict()
        for line in lines[1:]:
            name, colon, value = line.partition(":")
            if not colon:
                connection.close()
                raise LegError(f"malformed header from {key}: {line[:80]!r}")
            headers.add(name.strip(), value.strip())
        return LegAnswer(self, key, connection, int(status_line[1]), headers)
