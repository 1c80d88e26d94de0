"""The router's leg client against a real HTTP/1.1 server on 127.0.0.1 (plain asyncio, so each test says
exactly what the engine does on the wire): answers by length and by chunks, keep-alive reuse, a connection the
engine closed while idle, an answer left unread (the engine sees the connection close: it aborts the request),
and the failures a leg can meet."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from pdserve.router import leg_client
from pdserve.router.leg_client import LegClient, LegConnectError, LegError

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, bytes], Awaitable[bool]]


class Engine:
    """Reads requests on keep-alive connections; ``handler`` answers each and says whether to keep going."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []
        self.closed_by_client = asyncio.Event()
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.lower().split(b"\r\n")
                length = next(int(line.split(b":")[1]) for line in lines if line.startswith(b"content-length"))
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                if not await self.handler(reader, writer, body):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed_by_client.set()
        writer.close()


def _whole(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n%s" % (len(body), extra, body)


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes) -> bool:
    writer.write(_whole(body, b"Content-Type: application/json\r\nX-Engine-Id: e1\r\n"))
    await writer.drain()
    return True


def test_answers_by_length_reuse_one_connection_and_send_the_headers_given():
    async def run() -> None:
        engine = Engine(_echo)
        async with engine as url:
            client = LegClient(connect_timeout=2)
            for body in (b'{"a": 1}', b'{"b": 2}'):
                async with await client.post(url + "/v1/completions", body, {"Authorization": "Bearer k"}) as answer:
                    assert answer.status == 200
                    assert answer.headers.get("content-type") == "application/json"
                    assert answer.headers["X-ENGINE-ID"] == "e1"
                    assert await answer.read() == body
            client.close()
        assert engine.connections == 1
        head = engine.requests[0].split(b"\r\n\r\n")[0].split(b"\r\n")
        assert head[0] == b"POST /v1/completions HTTP/1.1"
        assert b"Authorization: Bearer k" in head and b"Content-Type: application/json" in head

    asyncio.run(run())


def test_chunks_come_as_the_engine_writes_them():
    async def run() -> None:
        gate = asyncio.Event()

        async def stream(reader, writer, body) -> bool:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
            writer.write(b"7\r\ndata: 1\r\n")
            await writer.drain()
            await gate.wait()  # the second chunk only once the client has the first
            writer.write(b"7;ext=1\r\ndata: 2\r\n0\r\nTrailer: x\r\n\r\n")
            await writer.drain()
            return True

        engine = Engine(stream)
        async with engine as url:
            client = LegClient(connect_timeout=2)
            answer = await client.post(url + "/v1/completions", b"{}", {})
            chunks = answer.iter_any()
            assert await chunks.__anext__() == b"data: 1"
            gate.set()
            assert [chunk async for chunk in chunks] == [b"data: 2"]
            answer.release()
            gate.clear()
            async with await client.post(url + "/v1/completions", b"{}", {}) as again:
                gate.set()
                assert await again.read() == b"data: 1data: 2"
            client.close()
        assert engine.connections == 1  # read to its end: the connection was reused

    asyncio.run(run())


def test_an_answer_left_unread_closes_its_connection_so_the_engine_aborts():
    async def run() -> None:
        async def endless(reader, writer, body) -> bool:
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            while True:
                writer.write(b"2\r\nok\r\n")
                await writer.drain()
                await asyncio.sleep(0.01)

        engine = Engine(endless)
        async with engine as url:
            client = LegClient(connect_timeout=2)
            answer = await client.post(url + "/v1/completions", b"{}", {})
            assert await answer.iter_any().__anext__() == b"ok"
            answer.release()
            await asyncio.wait_for(engine.closed_by_client.wait(), 5)
            client.close()

    asyncio.run(run())


def test_a_connection_the_engine_closed_while_idle_is_not_used_again():
    async def run() -> None:
        async def answer_then_close(reader, writer, body) -> bool:
            await _echo(reader, writer, body)
            return False  # as a server whose keep-alive timeout passed

        engine = Engine(answer_then_close)
        async with engine as url:
            client = LegClient(connect_timeout=2)
            for body in (b"1", b"2", b"3"):
                async with await client.post(url + "/x", body, {}) as answer:
                    assert await answer.read() == body
                await asyncio.sleep(0.05)  # the engine's close reaches the client
            client.close()
        assert engine.connections == 3

    asyncio.run(run())


def test_connections_idle_too_long_are_dropped(monkeypatch):
    monkeypatch.setattr(leg_client, "IDLE_S", 0.05)

    async def run() -> None:
        engine = Engine(_echo)
        async with engine as url:
            client = LegClient(connect_timeout=2)
            for _ in range(2):
                async with await client.post(url + "/x", b"{}", {}) as answer:
                    await answer.read()
                await asyncio.sleep(0.1)
            client.close()
        assert engine.connections == 2

    asyncio.run(run())


def test_connection_close_and_bodies_ended_by_close_are_not_reused():
    async def run() -> None:
        async def no_length(reader, writer, body) -> bool:
            writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it")
            await writer.drain()
            return False

        engine = Engine(no_length)
        async with engine as url:
            client = LegClient(connect_timeout=2)
            for _ in range(2):
                async with await client.post(url + "/x", b"{}", {}) as answer:
                    assert await answer.read() == b"all of it"
            client.close()
        assert engine.connections == 2

    asyncio.run(run())


def test_nothing_listening_is_a_connect_error():
    async def run() -> None:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        with pytest.raises(LegConnectError):
            await LegClient(connect_timeout=2).post(f"http://127.0.0.1:{port}/x", b"{}", {})

    asyncio.run(run())


@pytest.mark.parametrize(
    "wire",
    [
        b"SMTP ready\r\n\r\n",  # not HTTP
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",  # closed before its end
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",  # no chunk size
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab",  # cut inside a chunk
        b"",  # closed with no answer
    ],
)
def test_broken_answers_are_leg_errors(wire):
    async def run() -> None:
        async def broken(reader, writer, body) -> bool:
            writer.write(wire)
            await writer.drain()
            return False

        async with Engine(broken) as url:
            client = LegClient(connect_timeout=2)
            with pytest.raises(LegError):
                async with await client.post(url + "/x", b"{}", {}) as answer:
                    await answer.read()

    asyncio.run(run())


def test_a_header_with_a_line_break_is_refused_before_anything_is_sent():
    async def run() -> None:
        engine = Engine(_echo)
        async with engine as url:
            for headers in ({"X-A": "1\r\nX-Injected: 1"}, {"X-A": "1\rX"}, {"X-A\n": "1"}):
                with pytest.raises(ValueError, match="line break"):
                    await LegClient(connect_timeout=2).post(url + "/x", b"{}", headers)
        assert engine.connections == 0

    asyncio.run(run())


def test_a_reused_connection_closed_as_the_leg_was_written_is_retried_once_on_a_new_one():
    async def run() -> None:
        served = 0

        async def close_the_second(reader, writer, body) -> bool:
            nonlocal served
            served += 1
            if served == 2:
                return False  # closed with no answer, as an idle connection the engine times out meanwhile
            return await _echo(reader, writer, body)

        engine = Engine(close_the_second)
        async with engine as url:
            client = LegClient(connect_timeout=2)
            for body in (b"1", b"2"):
                async with await client.post(url + "/x", body, {}) as answer:
                    assert await answer.read() == body
            client.close()
        assert engine.connections == 2 and served == 3

    asyncio.run(run())


def test_the_callers_content_type_wins_and_framing_headers_are_the_clients_own():
    async def run() -> None:
        engine = Engine(_echo)
        given = {"content-type": "application/json; charset=utf-8", "Content-Length": "999", "Host": "elsewhere"}
        async with engine as url:
            client = LegClient(connect_timeout=2)
            async with await client.post(url + "/x", b"{}", given) as answer:
                assert await answer.read() == b"{}"
            client.close()
        head = engine.requests[0].split(b"\r\n\r\n")[0].lower().split(b"\r\n")
        assert [line for line in head if line.startswith(b"content-type")] == [
            b"content-type: application/json; charset=utf-8"
        ]
        assert b"content-length: 2" in head and not any(b"elsewhere" in line for line in head)

    asyncio.run(run())


def test_chunks_that_arrive_together_come_out_as_one_piece():
    async def run() -> None:
        async def burst(reader, writer, body) -> bool:
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            writer.write(b"3\r\nab1\r\n3\r\nab2\r\n3\r\nab3\r\n0\r\n\r\n")  # an engine's burst of events
            await writer.drain()
            return True

        async with Engine(burst) as url:
            client = LegClient(connect_timeout=2)
            async with await client.post(url + "/x", b"{}", {}) as answer:
                assert [piece async for piece in answer.iter_any()] == [b"ab1ab2ab3"]
            client.close()

    asyncio.run(run())


def test_an_answer_larger_than_the_buffer_is_read_whole():
    async def run() -> None:
        big = b"x" * (3 * leg_client._BUFFERED_BYTES)

        async def large(reader, writer, body) -> bool:
            writer.write(_whole(big))
            await writer.drain()
            return True

        async with Engine(large) as url:
            client = LegClient(connect_timeout=2)
            async with await client.post(url + "/x", b"{}", {}) as answer:
                assert await asyncio.wait_for(answer.read(), 10) == big
            client.close()

    asyncio.run(run())
