"""The router's HTTP/1.1 server: connections, requests parsed by llhttp (``httptools``), dispatch by method and
path, answers whole (``Response``) or streamed in chunks (``StreamResponse``), keep-alive and pipelining, a
client that leaves cancelling its handler, and a graceful stop.

Why not aiohttp's server: on the router's P/D path it cost ~20% of the CPU per request (protocol, request and
response objects, payload writer, dispatcher, middleware chain; ``bench/router.py``), on a path whose every other
part is already the router's own. This server knows the router's routes and nothing more: no cookies, no
multipart, no compression, no websockets, no HTTP/2. The engines' API servers stay on aiohttp.

Limits, each answered with a JSON error and the connection closed: a request line or header line over 8 KiB,
over 64 KiB of headers or 128 of them (431), a body over ``max_body`` (413), input that is not HTTP/1.x (400).
``Expect: 100-continue`` is answered before the body is read. An idle keep-alive connection is closed after
``KEEPALIVE_S``, as aiohttp does.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from email.utils import formatdate
from typing import Any, cast
from urllib.parse import parse_qsl, unquote

import httptools
import msgspec
from multidict import CIMultiDict, MultiDict

from pdserve.api.protocol import ProtocolError

logger = logging.getLogger(__name__)

KEEPALIVE_S = 75.0  # an idle keep-alive connection's life (aiohttp's default)
MAX_LINE_BYTES = 8190  # of the request line, and of each header line (aiohttp's limits)
MAX_HEAD_BYTES = 64 << 10
MAX_HEADERS = 128
_MAX_PIPELINED = 8  # parsed requests waiting behind the one being answered, before reading pauses

_REASONS = {
    100: "Continue",
    200: "OK",
    204: "No Content",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    409: "Conflict",
    413: "Payload Too Large",
    422: "Unprocessable Entity",
    429: "Too Many Requests",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}
_OWN_HEADERS = frozenset(("content-length", "transfer-encoding", "connection", "date"))  # this server writes them


class Request:
    """One parsed request, its body read whole. ``request[key]`` keeps what handlers note for the error path."""

    __slots__ = ("_connection", "_query", "_state", "body", "headers", "keep_alive", "method", "path", "query_string")

    def __init__(
        self, connection: _Connection, method: str, target: str, headers: CIMultiDict[str], body: bytes, keep: bool
    ) -> None:
        path, _, self.query_string = target.partition("?")
        self.path = unquote(path) if "%" in path else path
        self.method = method
        self.headers = headers
        self.body = body
        self.keep_alive = keep
        self._connection = connection
        self._query: MultiDict[str] | None = None
        self._state: dict[str, Any] = {}

    async def read(self) -> bytes:
        return self.body

    @property
    def query(self) -> MultiDict[str]:
        if self._query is None:
            self._query = MultiDict(parse_qsl(self.query_string, keep_blank_values=True))
        return self._query

    @property
    def transport(self) -> asyncio.Transport | None:
        """The client's connection (None once it closed)."""
        return self._connection.transport

    def finish_even_if_client_leaves(self) -> ClientWatch:
        """``with request.finish_even_if_client_leaves() as watch:`` - a client that leaves inside the block does
        not cancel the handler there (``watch.client_left`` says it did): for work that must end cleanly once
        started, as a task under ``asyncio.shield`` would, without the task. The handler decides what to do after
        (it should stop: nobody reads its answer)."""
        return ClientWatch(self._connection)

    def get(self, key: str, default: Any = None) -> Any:
        return self._state.get(key, default)

    def __getitem__(self, key: str) -> Any:
        return self._state[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self._state[key] = value


class ClientWatch:
    """Whether the client left while its handler was in a ``finish_even_if_client_leaves`` block."""

    __slots__ = ("_connection", "client_left")

    def __init__(self, connection: _Connection) -> None:
        self._connection = connection
        self.client_left = connection.transport is None

    def __enter__(self) -> ClientWatch:
        self._connection.watch = self
        return self

    def __exit__(self, *exc: object) -> None:
        self._connection.watch = None


class Response:
    """A whole answer: status, headers and body, written in one go."""

    __slots__ = ("body", "headers", "status")

    def __init__(
        self,
        body: bytes = b"",
        status: int = 200,
        headers: Mapping[str, str] | None = None,
        content_type: str | None = None,
    ) -> None:
        self.body = body
        self.status = status
        self.headers = dict(headers) if headers else {}
        if content_type is not None:
            self.headers["Content-Type"] = content_type


def json_response(payload: object, status: int = 200, headers: Mapping[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(payload), status, headers, "application/json")


class StreamResponse:
    """An answer sent as it is written: ``prepare``, ``write`` as often as needed, ``write_eof``. Chunked (HTTP/1.0
    clients: the body ends with the connection). Writing to a client that left raises ConnectionResetError."""

    __slots__ = ("_chunked", "_connection", "_head", "ended", "headers", "status")

    def __init__(self, status: int = 200, headers: Mapping[str, str] | None = None) -> None:
        self.status = status
        self.headers = dict(headers) if headers else {}
        self._connection: _Connection | None = None
        self._head: bytes | None = None  # written with the first bytes of the body
        self._chunked = True
        self.ended = False

    @property
    def prepared(self) -> bool:
        return self._connection is not None

    async def prepare(self, request: Request) -> None:
        connection = request._connection
        self._connection = connection
        self._chunked = connection.http11
        if not self._chunked:
            connection.keep_alive = False
        framing = "Transfer-Encoding: chunked\r\n" if self._chunked else ""
        self._head = connection.head(self.status, self.headers, framing)

    async def write(self, data: bytes) -> None:
        if not data:
            return
        frame = b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data
        await self._send(frame)

    async def write_eof(self, data: bytes = b"") -> None:
        if self.ended:
            return
        frame = (b"%x\r\n%b\r\n0\r\n\r\n" % (len(data), data) if data else b"0\r\n\r\n") if self._chunked else data
        self.ended = True
        await self._send(frame)

    async def _send(self, frame: bytes) -> None:
        connection = self._connection
        if connection is None:
            raise RuntimeError("write before prepare")
        transport = connection.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client closed its connection")
        if self._head is not None:
            frame, self._head = self._head + frame, None
        transport.write(frame)
        if connection.paused:
            await connection.drained()


Handler = Callable[[Request], Awaitable["Response | StreamResponse"]]
# Before a route's handler, given the request's path and headers: an error answer (a refusal), or None to go on.
Check = Callable[[str, Mapping[str, str]], "ProtocolError | None"]
# Headers every error answer of a request carries (the router's request id, once known).
ErrorHeaders = Callable[[Request], Mapping[str, str]]


class Routes:
    """Handlers by path and method; GET routes answer HEAD too."""

    def __init__(self) -> None:
        self._by_path: dict[str, dict[str, Handler]] = {}

    def add(self, method: str, path: str, handler: Handler) -> None:
        methods = self._by_path.setdefault(path, {})
        methods[method] = handler
        if method == "GET":
            methods.setdefault("HEAD", handler)

    def find(self, method: str, path: str) -> Handler:
        methods = self._by_path.get(path)
        if methods is None:
            raise ProtocolError("Not Found", 404, error_type="not_found_error")
        handler = methods.get(method)
        if handler is None:
            allowed = ",".join(sorted(methods))
            raise ProtocolError("Method Not Allowed", 405, headers={"Allow": allowed})
        return handler


class _Date:
    """The Date header, formatted once a second."""

    second = 0
    value = b""

    @classmethod
    def header(cls) -> bytes:
        now = int(time.time())
        if now != cls.second:
            cls.second = now
            cls.value = b"Date: " + formatdate(now, usegmt=True).encode() + b"\r\n"
        return cls.value


class _Refused(Exception):
    """Input this server will not read further: answered with ``error``, then the connection closes."""

    def __init__(self, error: ProtocolError) -> None:
        self.error = error


class _Connection(asyncio.Protocol):
    """One client connection: parses requests as bytes come, answers them one at a time in their order."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.loop = server.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.keep_alive = True
        self.http11 = True
        self.paused = False
        self._drain: asyncio.Future[None] | None = None
        self._pending: deque[Request] = deque()
        self._task: asyncio.Task[None] | None = None  # the request being answered
        self.watch: ClientWatch | None = None  # set while the handler must not be cancelled by the client leaving
        self._idle: asyncio.TimerHandle | None = None
        self._reading_paused = False
        # The request being parsed.
        self._url = bytearray()
        self._headers: list[tuple[str, str]] = []
        self._head_bytes = 0
        self._body: list[bytes] = []
        self._body_bytes = 0
        self._closing = False  # answer what is under way, then close (server stopping, or a refusal)
        self._refusal: ProtocolError | None = None  # the refusal to answer after the request under way

    # ----- asyncio.Protocol -----

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports have a Transport's methods without subclassing it; either loop sets TCP_NODELAY.
        self.transport = cast(asyncio.Transport, transport)
        self.server.connections.add(self)
        self._arm_idle()

    def connection_lost(self, error: Exception | None) -> None:
        self.transport = None
        self.server.connections.discard(self)
        if self._idle is not None:
            self._idle.cancel()
        self._pending.clear()
        if self.watch is not None:
            self.watch.client_left = True
        elif self._task is not None and not self._task.done():
            self._task.cancel()  # the client left: what its request started is aborted by the handler's cleanup
        if self._drain is not None and not self._drain.done():
            self._drain.set_exception(ConnectionResetError("the client closed its connection"))

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as error:
            refused = error.__context__
            if isinstance(refused, _Refused):
                self._refuse(refused.error)
            else:
                raise
        except httptools.HttpParserUpgrade:
            self._closing = True  # what follows is not HTTP/1.1: answer what was asked, then close
        except httptools.HttpParserError as error:
            self._refuse(ProtocolError(f"malformed HTTP request: {error}", 400))

    def eof_received(self) -> bool | None:
        # A client that closes its side is gone (as aiohttp's server has it): the transport closes, and
        # connection_lost cancels what it asked for.
        return None

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        self._drain = None

    async def drained(self) -> None:
        if self._drain is None:
            self._drain = self.loop.create_future()
        await self._drain

    # ----- httptools callbacks -----

    def on_message_begin(self) -> None:
        self._url.clear()
        self._headers = []
        self._head_bytes = 0
        self._body = []
        self._body_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > MAX_LINE_BYTES:
            raise _Refused(ProtocolError("the request line is too long", 431))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value)
        if len(name) + len(value) > MAX_LINE_BYTES or self._head_bytes > MAX_HEAD_BYTES:
            raise _Refused(ProtocolError("a request header is too large", 431))
        if len(self._headers) >= MAX_HEADERS:
            raise _Refused(ProtocolError(f"more than {MAX_HEADERS} request headers", 431))
        # llhttp may hand a header over in parts (split across reads): an empty name continues the last.
        if not name and self._headers:
            last_name, last_value = self._headers[-1]
            self._headers[-1] = (last_name, last_value + value.decode("utf-8", "surrogateescape"))
            return
        self._headers.append((name.decode("latin-1"), value.decode("utf-8", "surrogateescape")))

    def on_headers_complete(self) -> None:
        for name, value in self._headers:
            lower = name.lower()
            if lower == "content-length":
                if value.strip().isdigit() and int(value) > self.server.max_body:
                    raise _Refused(_too_large(self.server.max_body))
            elif lower == "expect" and value.strip().lower() == "100-continue":
                assert self.transport is not None
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        if self._body_bytes > self.server.max_body:
            raise _Refused(_too_large(self.server.max_body))
        self._body.append(body)

    def on_message_complete(self) -> None:
        parser = self.parser
        self.http11 = parser.get_http_version() == "1.1"
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        request = Request(
            self,
            parser.get_method().decode("ascii", "replace"),
            self._url.decode("utf-8", "surrogateescape"),
            CIMultiDict(self._headers),
            body,
            parser.should_keep_alive(),
        )
        if self._task is None:
            self._task = self.loop.create_task(self._answer(request))
        else:
            self._pending.append(request)
            if len(self._pending) >= _MAX_PIPELINED and self.transport is not None and not self._reading_paused:
                self._reading_paused = True
                self.transport.pause_reading()

    # ----- answering -----

    def head(self, status: int, headers: Mapping[str, str], framing: str) -> bytes:
        """The status line and headers of an answer; ``framing``: its Content-Length or Transfer-Encoding line."""
        lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}\r\n"]
        for name, value in headers.items():
            if name.lower() not in _OWN_HEADERS:
                lines.append(f"{name}: {value}\r\n")
        lines.append(framing)
        if not self.keep_alive or self._closing:
            lines.append("Connection: close\r\n")
        return "".join(lines).encode("latin-1") + _Date.header() + b"\r\n"

    async def _answer(self, request: Request) -> None:
        self.keep_alive = request.keep_alive and self.keep_alive
        try:
            response = await self.server.dispatch(request)
        except (asyncio.CancelledError, ConnectionResetError):
            # The client left (its connection is gone), or the server stopped: no half answer on a live one.
            self._task = None
            if self.transport is not None:
                self.transport.close()
            raise
        transport = self.transport
        if transport is None:
            self._task = None
            return
        if isinstance(response, StreamResponse):
            if not response.ended or not self.keep_alive:
                # A stream the handler left unfinished (its client gone, or cut on purpose) cannot be reused.
                self._task = None
                transport.close()
                return
        else:
            body = b"" if request.method == "HEAD" else response.body
            head = self.head(response.status, response.headers, f"Content-Length: {len(response.body)}\r\n")
            transport.write(head + body)
        self._next()

    def _next(self) -> None:
        """After an answer: the next pipelined request, or the connection idle, or closed."""
        self._task = None
        if self.transport is None:
            return
        if not self.keep_alive or (self._closing and not self._pending):
            if self._refusal is not None:
                self._write_error(self._refusal)
            self.transport.close()
            return
        if self._pending:
            request = self._pending.popleft()
            if self._reading_paused and len(self._pending) < _MAX_PIPELINED // 2:
                self._reading_paused = False
                self.transport.resume_reading()
            self._task = self.loop.create_task(self._answer(request))
            return
        self._arm_idle()

    def _arm_idle(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
        self._idle = self.loop.call_later(self.server.keepalive_s, self._idle_out)

    def _idle_out(self) -> None:
        self._idle = None
        if self._task is None and self.transport is not None:
            self.transport.close()

    def _refuse(self, error: ProtocolError) -> None:
        """Answer ``error`` once the requests before it are answered, then close."""
        self._closing = True
        self.keep_alive = False
        self._pending.clear()
        if self.transport is None:
            return
        if self._task is None:
            self._write_error(error)
            self.transport.close()
        else:
            self._refusal = error

    def _write_error(self, error: ProtocolError) -> None:
        assert self.transport is not None
        body = msgspec.json.encode(error.to_response())
        headers = {**error.headers, "Content-Type": "application/json"}
        self.transport.write(self.head(error.status, headers, f"Content-Length: {len(body)}\r\n") + body)

    def stop(self) -> None:
        """The server stops: close now if idle, else after the answer under way."""
        self._closing = True
        self.keep_alive = False
        self._pending.clear()
        if self._task is None and self.transport is not None:
            self.transport.close()


def _too_large(limit: int) -> ProtocolError:
    return ProtocolError(f"the request body is larger than {limit} bytes", 413)


class HttpServer:
    """Serves ``routes`` on a listening socket. ``check`` runs before each handler (the API key); every
    ProtocolError a handler or check raises becomes its JSON error answer, any other failure a logged 500."""

    def __init__(
        self,
        routes: Routes,
        max_body: int,
        check: Check | None = None,
        error_headers: ErrorHeaders | None = None,
        keepalive_s: float = KEEPALIVE_S,
    ) -> None:
        self.routes = routes
        self.max_body = max_body
        self.check = check
        self.error_headers = error_headers
        self.keepalive_s = keepalive_s
        self.loop = asyncio.get_running_loop()
        self.connections: set[_Connection] = set()
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0: a free port); the port."""
        self._server = await self.loop.create_server(lambda: _Connection(self), host, port, reuse_address=True)
        return self._server.sockets[0].getsockname()[1]

    async def dispatch(self, request: Request) -> Response | StreamResponse:
        try:
            handler = self.routes.find(request.method, request.path)
            if self.check is not None:
                refusal = self.check(request.path, request.headers)
                if refusal is not None:
                    raise refusal
            return await handler(request)
        except ProtocolError as error:
            return self._error(request, error)
        except (ConnectionResetError, asyncio.CancelledError):
            raise  # the client went away: nobody to answer
        except Exception as error:
            logger.exception("request %s %s failed", request.method, request.path)
            internal = ProtocolError(f"internal error: {type(error).__name__}", 500, error_type="internal_server_error")
            return self._error(request, internal)

    def _error(self, request: Request, error: ProtocolError) -> Response:
        headers = dict(error.headers)
        if self.error_headers is not None:
            headers.update(self.error_headers(request))
        return json_response(error.to_response(), error.status, headers)

    async def stop(self, timeout: float) -> None:
        """Stop listening, close idle connections, let requests under way finish for up to ``timeout`` seconds,
        then cancel what is left."""
        if self._server is not None:
            self._server.close()
        for connection in list(self.connections):
            connection.stop()
        under_way = {connection._task for connection in self.connections if connection._task is not None}
        if under_way:
            await asyncio.wait(under_way, timeout=timeout)
        for connection in list(self.connections):
            if connection._task is not None:
                connection._task.cancel()
            if connection.transport is not None:
                connection.transport.close()
        if self._server is not None:
            await self._server.wait_closed()
