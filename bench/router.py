"""Router overhead and throughput against instant stub engines. Runs in about 40 s on 2 cores.

Processes: the stubs (a prefill stub answering ``kv_transfer_params`` and a decode stub streaming one SSE
chunk per token, 8 tokens, both plain asyncio so they cost little) and this load generator share one core;
the proxy under test (our router, then the FastAPI + httpx pass-through that vLLM's toy P/D proxy is) runs
alone on the other (taskset), so the load generator never shares its event loop. The load generator is a
minimal keep-alive HTTP/1.1 client, so that client cost does not hide proxy cost.

Measured, for streamed /v1/completions requests:
(a) a client making both legs itself (prefill, then decode with the returned params): p50, p99 latency;
(b) the same through our router: p50, p99, and added = p50(b) - p50(a);
(c) requests/s through our router with 64 requests in flight, for a few seconds; (b) and (c) again with keys,
    the router signing both legs for their engine with Ed25519 (what production runs: the stubs do not check it);
(d) the same (latency and requests/s) through the FastAPI + httpx baseline, when fastapi/httpx/uvicorn are
    installed (``.venv/bin/pip install fastapi httpx uvicorn``); otherwise skipped with a message.

With --plot DIR, writes DIR/router_latency.png and DIR/router_throughput.png.
Last line: {"bench": "router", "overhead_p50_ms": X, "router_rps": Y, "baseline_rps": Z, "ratio": R}.
"""

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import msgspec
from plots import add_plot_argument, bar_chart

from pdserve.launcher import free_port

TOKENS = 8
CONCURRENCY = 64
BODY = {"model": "demo", "prompt": "Tell me about disaggregated serving.", "max_tokens": TOKENS, "stream": True}
KV_PARAMS = {
    "do_remote_prefill": True,
    "remote_engine_id": "e1",
    "remote_request_id": "r",
    "remote_block_ids": [1, 2, 3, 4],
    "remote_host": "127.0.0.1",
    "remote_port": 5555,
}
_CONTENT_LENGTH = re.compile(rb"content-length:\s*(\d+)", re.IGNORECASE)
_STREAM_TRUE = re.compile(rb'"stream":\s*true')


# ----- stub engines (plain asyncio streams: an HTTP/1.1 server that knows just enough) -----------------------


def _sse_events() -> list[bytes]:
    events = []
    for i in range(TOKENS):
        chunk = {
            "id": "cmpl-1",
            "object": "text_completion",
            "created": 1,
            "model": "demo",
            "choices": [{"index": 0, "text": f" t{i}", "finish_reason": "length" if i == TOKENS - 1 else None}],
        }
        events.append(b"data: " + msgspec.json.encode(chunk) + b"\n\n")
    return [*events, b"data: [DONE]\n\n"]


def _whole(status: int, payload: bytes) -> bytes:
    return (
        b"HTTP/1.1 %d OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (status, len(payload))
        + payload
    )


async def _stub(role: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    prefill_answer = _whole(
        200,
        msgspec.json.encode(
            {
                "id": "cmpl-1",
                "object": "text_completion",
                "created": 1,
                "model": "demo",
                "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                "kv_transfer_params": KV_PARAMS,
            }
        ),
    )
    events = [b"%x\r\n%s\r\n" % (len(event), event) for event in _sse_events()]
    stream_head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = _CONTENT_LENGTH.search(head)
            body = await reader.readexactly(int(length.group(1))) if length else b""
            if head.startswith(b"GET"):
                writer.write(_whole(200, b'{"status":"ok"}'))
            elif role == "prefill":
                writer.write(prefill_answer)
            elif _STREAM_TRUE.search(body):
                writer.write(stream_head)
                for event in events:  # one chunk per token, as an engine writes them
                    writer.write(event)
                writer.write(b"0\r\n\r\n")
            else:
                writer.write(_whole(200, b'{"choices": [{"index": 0, "text": "t"}]}'))
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()


async def serve_stubs(prefill_port: int, decode_port: int) -> None:
    servers = [
        await asyncio.start_server(lambda r, w, role=role: _stub(role, r, w), "127.0.0.1", port)
        for role, port in (("prefill", prefill_port), ("decode", decode_port))
    ]
    print("ready", flush=True)
    await asyncio.gather(*(server.serve_forever() for server in servers))


# ----- proxies under test -------------------------------------------------------------------------------------


async def serve_router(port: int, prefill: str, decode: str, signed: bool = False) -> None:
    import tempfile

    from pdserve.api.keys import ROUTER_FILES, new_bundle, write_bundle
    from pdserve.router import RouterConfig, start_router

    keys_dir = None
    if signed:  # the router's own key files: it signs every leg (Ed25519) for its target engine
        keys_dir = tempfile.mkdtemp(prefix="pdserve-bench-keys-")
        write_bundle(keys_dir, new_bundle(), ROUTER_FILES)
    await start_router(RouterConfig([prefill], [decode], keys_dir=keys_dir), port=port)
    print("ready", flush=True)
    await asyncio.Event().wait()


def serve_baseline(port: int, prefill: str, decode: str) -> None:
    """vLLM's toy P/D proxy, in its essentials: FastAPI, one httpx client per pool, a StreamingResponse."""
    import httpx
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import StreamingResponse

    app = FastAPI()
    prefill_client = httpx.AsyncClient(base_url=prefill, timeout=None)
    decode_client = httpx.AsyncClient(base_url=decode, timeout=None)

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        body = await request.json()
        leg = dict(body, max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
        leg.pop("stream_options", None)
        answer = await prefill_client.post("/v1/completions", json=leg)
        answer.raise_for_status()
        body["kv_transfer_params"] = answer.json().get("kv_transfer_params")

        async def relay():
            async with decode_client.stream("POST", "/v1/completions", json=body) as streamed:
                async for chunk in streamed.aiter_bytes():
                    yield chunk

        return StreamingResponse(relay(), media_type="text/event-stream")

    print("ready", flush=True)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


# ----- load generator -----------------------------------------------------------------------------------------


class Connection:
    """One keep-alive HTTP/1.1 connection: POST, read the whole answer (Content-Length or chunked)."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.host, self.port = host, int(port)
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        self.writer.write(
            b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d"
            b"\r\n\r\n%s" % (path.encode(), self.host.encode(), len(body), body)
        )
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length = _CONTENT_LENGTH.search(head)
        if length:
            return status, await self.reader.readexactly(int(length.group(1)))
        parts = []
        while True:
            size = int((await self.reader.readuntil(b"\r\n"))[:-2].split(b";")[0], 16)
            if size == 0:
                await self.reader.readuntil(b"\r\n")
                return status, b"".join(parts)
            parts.append((await self.reader.readexactly(size + 2))[:-2])

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class TwoLegClient:
    """What a client without a router does: prefill leg, then decode leg with the returned params."""

    def __init__(self, prefill: str, decode: str) -> None:
        self.prefill, self.decode = Connection(prefill), Connection(decode)
        leg = dict(BODY, max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
        self.prefill_body = msgspec.json.encode(leg)

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        status, answer = await self.prefill.post(path, self.prefill_body)
        if status != 200:
            raise RuntimeError(f"prefill answered {status}")
        params = msgspec.json.decode(answer)["kv_transfer_params"]
        return await self.decode.post(path, msgspec.json.encode(dict(BODY, kv_transfer_params=params)))

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()


def _check(status: int, answer: bytes) -> None:
    if status != 200 or not answer.endswith(b"data: [DONE]\n\n") or answer.count(b"data: ") != TOKENS + 1:
        raise RuntimeError(f"unexpected answer {status}: {answer[:200]!r}")


async def latency(make_client, requests: int, warmup: int = 200) -> tuple[float, float]:
    client = make_client()
    body = msgspec.json.encode(BODY)
    times = []
    for i in range(warmup + requests):
        started = time.perf_counter()
        status, answer = await client.post("/v1/completions", body)
        if i >= warmup:
            times.append(time.perf_counter() - started)
        _check(status, answer)
    client.close()
    times.sort()
    return times[len(times) // 2] * 1e3, times[int(len(times) * 0.99)] * 1e3


async def throughput(make_client, seconds: float, warmup: float = 0.5) -> float:
    body = msgspec.json.encode(BODY)
    done = 0
    measuring = False
    stop = False

    async def worker() -> None:
        nonlocal done
        client = make_client()
        while not stop:
            status, answer = await client.post("/v1/completions", body)
            _check(status, answer)
            done += measuring
        client.close()

    workers = [asyncio.create_task(worker()) for _ in range(CONCURRENCY)]
    await asyncio.sleep(warmup)
    measuring, started = True, time.perf_counter()
    await asyncio.sleep(seconds)
    measured, elapsed = done, time.perf_counter() - started
    stop = True
    await asyncio.gather(*workers)
    return measured / elapsed


# ----- orchestration ------------------------------------------------------------------------------------------


def _spawn(args: list[str], core: int | None) -> subprocess.Popen:
    command = [sys.executable, __file__, *args]
    if core is not None and shutil.which("taskset"):
        command = ["taskset", "-c", str(core), *command]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    process = subprocess.Popen(command, stdout=subprocess.PIPE, env=env, text=True)
    if process.stdout.readline().strip() != "ready":
        process.kill()
        raise RuntimeError(f"{args[1]} did not start")
    return process


async def _wait_listening(port: int) -> None:
    for _ in range(200):
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return
        except OSError:
            await asyncio.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port}")


async def measure_proxy(
    name: str, role: str, prefill: str, decode: str, core: int | None, requests: int, seconds: float
) -> dict:
    port = free_port()
    process = _spawn(["--serve", role, "--port", str(port), "--prefill", prefill, "--decode", decode], core)
    try:
        await _wait_listening(port)
        url = f"http://127.0.0.1:{port}"
        p50, p99 = await latency(lambda: Connection(url), requests)
        rps = await throughput(lambda: Connection(url), seconds)
    finally:
        process.terminate()
        process.wait(10)
    return {"name": name, "p50_ms": p50, "p99_ms": p99, "rps": rps}


def _have_baseline() -> bool:
    try:
        import fastapi  # noqa: F401
        import httpx  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        return False
    return True


async def run(requests: int, seconds: float, plot: Path | None) -> None:
    cores = sorted(os.sched_getaffinity(0))
    proxy_core, own_core = (cores[0], cores[1]) if len(cores) >= 2 else (None, None)
    if own_core is not None:
        os.sched_setaffinity(0, {own_core})  # the load generator and the stubs share the other core
    prefill_port, decode_port = free_port(), free_port()
    stubs = _spawn(["--serve", "stubs", "--port", str(prefill_port), "--decode-port", str(decode_port)], own_core)
    prefill, decode = f"http://127.0.0.1:{prefill_port}", f"http://127.0.0.1:{decode_port}"
    rows = []
    try:
        p50, p99 = await latency(lambda: TwoLegClient(prefill, decode), requests)
        rps = await throughput(lambda: TwoLegClient(prefill, decode), seconds)
        rows.append({"name": "client makes both legs", "p50_ms": p50, "p99_ms": p99, "rps": rps})
        rows.append(await measure_proxy("pdserve router", "router", prefill, decode, proxy_core, requests, seconds))
        rows.append(
            await measure_proxy(
                "pdserve router, signed", "router-signed", prefill, decode, proxy_core, requests, seconds
            )
        )
        if _have_baseline():
            rows.append(
                await measure_proxy("FastAPI + httpx proxy", "baseline", prefill, decode, proxy_core, requests, seconds)
            )
        else:
            print(
                "(d) skipped: fastapi/httpx/uvicorn are not installed (.venv/bin/pip install fastapi httpx uvicorn)",
                file=sys.stderr,
            )
    finally:
        stubs.terminate()
        stubs.wait(10)

    direct = rows[0]
    print(f"streamed /v1/completions, {TOKENS} SSE chunks, latency: 1 in flight; req/s: {CONCURRENCY} in flight")
    print(f"{'path':<24}{'p50 ms':>9}{'p99 ms':>9}{'added p50 ms':>14}{'req/s':>9}")
    for row in rows:
        added = row["p50_ms"] - direct["p50_ms"]
        print(
            f"{row['name']:<24}{row['p50_ms']:>9.3f}{row['p99_ms']:>9.3f}"
            f"{'-' if row is direct else f'{added:+.3f}':>14}{row['rps']:>9.0f}"
        )
    router, signed = rows[1], rows[2]
    baseline = rows[3] if len(rows) > 3 else None
    if plot:
        bar_chart(
            plot,
            "router_latency",
            "two legs, streamed: latency with 1 request in flight (ms)",
            "ms",
            {row["name"]: {"p50": row["p50_ms"], "p99": row["p99_ms"]} for row in rows},
        )
        bar_chart(
            plot,
            "router_throughput",
            f"requests/s with {CONCURRENCY} in flight",
            "requests/s",
            {row["name"]: {"req/s": row["rps"]} for row in rows},
            log=True,
        )
    print(
        json.dumps(
            {
                "bench": "router",
                "overhead_p50_ms": round(router["p50_ms"] - direct["p50_ms"], 3),
                "router_rps": round(router["rps"], 1),
                "signed_router_rps": round(signed["rps"], 1),
                "baseline_rps": round(baseline["rps"], 1) if baseline else None,
                "ratio": round(router["rps"] / baseline["rps"], 2) if baseline else None,
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=1000, help="sequential requests per latency measurement")
    parser.add_argument("--seconds", type=float, default=4.0, help="length of each requests/s measurement")
    add_plot_argument(parser)
    parser.add_argument("--serve", choices=["stubs", "router", "router-signed", "baseline"], help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--decode-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--prefill", help=argparse.SUPPRESS)
    parser.add_argument("--decode", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve == "stubs":
        asyncio.run(serve_stubs(args.port, args.decode_port))
    elif args.serve in ("router", "router-signed"):
        asyncio.run(serve_router(args.port, args.prefill, args.decode, signed=args.serve == "router-signed"))
    elif args.serve == "baseline":
        serve_baseline(args.port, args.prefill, args.decode)
    else:
        asyncio.run(run(args.requests, args.seconds, args.plot))


if __name__ == "__main__":
    main()
