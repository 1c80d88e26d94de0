"""The router's HTTP/1.1 server on a real socket on 127.0.0.1, driven by raw bytes so each test says exactly what
a client sends: answers whole and streamed, keep-alive and pipelining, HEAD, 404/405, the API-key check, the
limits (431, 413, malformed input), Expect: 100-continue, HTTP/1.0 streams, a client that leaves cancelling its
handler, and a stop that lets requests under way finish."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import pytest

from pdserve.api.http import ApiKeyCheck
from pdserve.api.protocol import ProtocolError
from pdserve.router.http_server import (
    MAX_HEADERS,
    HttpServer,
    Request,
    Response,
    Routes,
    StreamResponse,
    json_response,
)


class App:
    """Routes for the tests: echo, a stream, a slow handler, a failing one."""

    def __init__(self) -> None:
        self.cancelled = asyncio.Event()
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.finished = 0

    def routes(self) -> Routes:
        routes = Routes()
        routes.add("POST", "/v1/echo", self.echo)
        routes.add("GET", "/health", self.health)
        routes.add("POST", "/v1/stream", self.stream)
        routes.add("POST", "/v1/slow", self.slow)
        routes.add("GET", "/v1/boom", self.boom)
        routes.add("GET", "/v1/refuse", self.refuse)
        routes.add("POST", "/v1/shielded", self.shielded)
        return routes

    async def echo(self, request: Request) -> Response:
        return Response(request.body, headers={"X-Path": request.path, "X-Query": request.query.get("q", "")})

    async def health(self, request: Request) -> Response:
        return json_response({"status": "ok"})

    async def stream(self, request: Request) -> StreamResponse:
        response = StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for part in (b"data: 1\n\n", b"data: 2\n\n"):
            await response.write(part)
        await response.write_eof(b"data: [DONE]\n\n")
        return response

    async def slow(self, request: Request) -> Response:
        self.started.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        self.finished += 1
        return Response(b"done")

    async def shielded(self, request: Request) -> Response:
        with request.finish_even_if_client_leaves() as watch:
            self.started.set()
            await self.release.wait()  # the client leaves meanwhile: no cancellation here
        self.finished += 1
        assert watch.client_left
        return Response(b"nobody reads this")

    async def boom(self, request: Request) -> Response:
        raise RuntimeError("a bug")

    async def refuse(self, request: Request) -> Response:
        raise ProtocolError("no", 429, headers={"Retry-After": "1"})


def _serve(test: Callable[[App, HttpServer, int], Awaitable[None]], api_key: str | None = None) -> None:
    async def run() -> None:
        app = App()
        check = ApiKeyCheck(api_key, ("/v1/",)).refusal
        server = HttpServer(app.routes(), max_body=1024, check=check, error_headers=lambda r: {"X-Err": "1"})
        port = await server.start("127.0.0.1", 0)
        try:
            await test(app, server, port)
        finally:
            await server.stop(1.0)

    asyncio.run(run())


async def _read_answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    elif headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            data = await reader.readexactly(size + 2)
            if size == 0:
                break
            body += data[:-2]
    else:
        body = await reader.read()
    return status, headers, body


async def _under_way(app: App, port: int, path: str = "/v1/slow") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection whose request to ``path`` its handler has started (and waits in)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(_post(path, b""))
    await asyncio.wait_for(app.started.wait(), 5)
    return reader, writer


def _post(path: str, body: bytes, extra: bytes = b"") -> bytes:
    return b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n%s\r\n%s" % (path.encode(), len(body), extra, body)


def test_keep_alive_pipelining_and_a_stream_on_one_connection():
    async def test(app: App, server: HttpServer, port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        # Three requests in one write: answered in order on the same connection.
        writer.write(_post("/v1/echo?q=x%20y", b"one") + _post("/v1/stream", b"{}") + b"GET /health HTTP/1.1\r\n\r\n")
        status, headers, body = await _read_answer(reader)
        assert (status, body, headers["x-path"], headers["x-query"]) == (200, b"one", "/v1/echo", "x y")
        assert "date" in headers and "connection" not in headers
        status, headers, body = await _read_answer(reader)
        assert status == 200 and headers["transfer-encoding"] == "chunked"
        assert body == b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n"
        status, headers, body = await _read_answer(reader)
        assert (status, json.loads(body)) == (200, {"status": "ok"})
        writer.close()

    _serve(test)


def test_head_unknown_paths_wrong_methods_errors_and_the_key():
    async def test(app: App, server: HttpServer, port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"HEAD /health HTTP/1.1\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200 ") and b"Content-Length: 15\r\n" in head  # GET's length, no body
        for request, expected in (
            (b"GET /nowhere HTTP/1.1\r\n\r\n", 404),
            (b"GET /v1/echo HTTP/1.1\r\nAuthorization: Bearer k\r\n\r\n", 405),
            (b"GET /v1/boom HTTP/1.1\r\nAuthorization: Bearer k\r\n\r\n", 500),
            (b"GET /v1/refuse HTTP/1.1\r\nAuthorization: Bearer k\r\n\r\n", 429),
            (_post("/v1/echo", b"x", b"Authorization: Bearer wrong\r\n"), 401),
            (_post("/v1/echo", b"x"), 401),
        ):
            writer.write(request)
            status, headers, body = await _read_answer(reader)
            error = json.loads(body)["error"]
            assert status == expected and error["code"] == expected, (request, status, body)
            assert headers["content-type"] == "application/json" and headers["x-err"] == "1"
            if expected == 405:
                assert headers["allow"] == "POST"
            if expected == 429:
                assert headers["retry-after"] == "1"
        writer.write(_post("/v1/echo", b"x", b"Authorization: Bearer k\r\n"))
        assert (await _read_answer(reader))[0] == 200  # the connection survived every error answer
        writer.close()

    _serve(test, api_key="k")


@pytest.mark.parametrize(
    ("wire", "status"),
    [
        (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n", 431),
        (b"GET /health HTTP/1.1\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n", 431),
        (b"GET /health HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(MAX_HEADERS + 1)) + b"\r\n", 431),
        (b"POST /v1/echo HTTP/1.1\r\nContent-Length: 4096\r\n\r\n", 413),
        (b"POST /v1/echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n800\r\n" + b"a" * 2048 + b"\r\n", 413),
        (b"BLAH\x00 / HTTP/1.1\r\n\r\n", 400),
        (b"GET /health HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab", 400),
    ],
    ids=["request-line", "header-line", "header-count", "length", "chunked-body", "not-http", "two-lengths"],
)
def test_input_over_the_limits_or_not_http_gets_a_json_error_and_the_connection_closes(wire, status):
    async def test(app: App, server: HttpServer, port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(wire)
        answered, headers, body = await _read_answer(reader)
        assert answered == status and json.loads(body)["error"]["code"] == status
        assert headers["connection"] == "close"
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed
        writer.close()

    _serve(test)


def test_chunked_request_bodies_and_expect_100_continue():
    async def test(app: App, server: HttpServer, port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
        assert (await _read_answer(reader))[2] == b"abcde"
        writer.write(b"POST /v1/echo HTTP/1.1\r\nContent-Length: 3\r\nExpect: 100-continue\r\n\r\n")
        assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5) == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"xyz")
        assert (await _read_answer(reader))[2] == b"xyz"
        writer.close()

    _serve(test)


def test_http_10_clients_get_a_stream_ended_by_the_connection_and_are_not_kept():
    async def test(app: App, server: HttpServer, port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/stream HTTP/1.0\r\nContent-Length: 2\r\n\r\n{}")
        status, headers, body = await _read_answer(reader)
        assert status == 200 and "transfer-encoding" not in headers and headers["connection"] == "close"
        assert body == b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n"
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /health HTTP/1.0\r\n\r\n")
        status, headers, _ = await _read_answer(reader)
        assert status == 200 and headers["connection"] == "close"
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()

    _serve(test)


def test_a_client_that_leaves_cancels_its_handler():
    async def test(app: App, server: HttpServer, port: int) -> None:
        _reader, writer = await _under_way(app, port)
        writer.close()
        await asyncio.wait_for(app.cancelled.wait(), 5)
        assert not server.connections

    _serve(test)


def test_inside_finish_even_if_client_leaves_a_client_that_leaves_does_not_cancel_the_handler():
    async def test(app: App, server: HttpServer, port: int) -> None:
        _reader, writer = await _under_way(app, port, "/v1/shielded")
        writer.close()
        await asyncio.sleep(0.1)  # the server saw the connection end
        assert not server.connections and not app.cancelled.is_set()
        app.release.set()
        for _ in range(50):
            if app.finished:
                break
            await asyncio.sleep(0.01)
        assert app.finished == 1  # the block ran to its end, and the handler learnt the client had left

    _serve(test)


def test_a_stopping_server_lets_requests_under_way_finish_and_closes_idle_connections():
    async def test(app: App, server: HttpServer, port: int) -> None:
        idle_reader, idle_writer = await asyncio.open_connection("127.0.0.1", port)
        idle_writer.write(b"GET /health HTTP/1.1\r\n\r\n")
        await _read_answer(idle_reader)
        busy_reader, busy_writer = await _under_way(app, port)
        stopping = asyncio.create_task(server.stop(5.0))
        assert await asyncio.wait_for(idle_reader.read(), 5) == b""  # the idle one closes at once
        app.release.set()
        status, headers, body = await _read_answer(busy_reader)
        assert (status, body, headers["connection"]) == (200, b"done", "close")
        await stopping
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", port)
        busy_writer.close()
        idle_writer.close()

    _serve(test)


def test_a_stop_past_its_timeout_cancels_what_is_left():
    async def test(app: App, server: HttpServer, port: int) -> None:
        reader, writer = await _under_way(app, port)
        await server.stop(0.1)
        await asyncio.wait_for(app.cancelled.wait(), 5)
        assert await asyncio.wait_for(reader.read(), 5) == b""  # no half answer
        writer.close()

    _serve(test)
