"""Router overhead and cost against instant stub engines, side by side with the Rust vllm-router. About 6 minutes
on 2 cores with the defaults (3 rounds).

Processes: the stubs (a prefill stub answering ``kv_transfer_params`` and a decode stub streaming one SSE
chunk per token, 8 tokens, both plain asyncio so they cost little) and this load generator share one core;
the proxy under test runs alone on the other (taskset), so the load generator never shares its event loop. The
load generator is a minimal keep-alive HTTP/1.1 client, so that client cost does not hide proxy cost.

Measured, for streamed /v1/completions requests, in P/D mode (prefill leg, then decode leg) and plain mode (one
decode pod, no prefill): latency p50/p99 with 1 request in flight, and added p50 against a client making both
legs itself; requests/s with 64 in flight; the proxy process's CPU time (user + system, from /proc) per request
over that window. Proxies: pdserve's router as shipped (legs authenticated with keys: a MAC per leg for the
engine, whose /health gives a leg key as an engine's does; flow control on; streams continued on failure), then
with each of those off and all three off, and with legs signed with Ed25519 instead of MACs (what the router
sends an engine that gives no leg key, and sent every engine before leg MACs); vllm-router (Rust; ``--vllm-router BIN``,
or on PATH: ``pip install -e '.[router-anchors]'``, best in a venv of its own); the FastAPI + httpx proxy that
vLLM's toy P/D proxy is (the bench extra), P/D only. Every proxy once per round, rounds alternating; the median.
The routing policy is round-robin on both sides (pdserve's prefix policies tokenize; vllm-router's round robin
does not).

``--only NAMES`` (name prefixes, comma-separated) and ``--modes`` run a part, e.g. ``--only "pdserve router,vllm-router"
--modes P/D`` (about 2 minutes) while working on the router's hot path. CPU time on a 2-core VM moves ±7% between
runs of one configuration; ``--instructions`` counts user-space instructions per request under callgrind instead
(valgrind; the same to ±0.2% run to run), which shows a 1-2% change of the hot path.

With --plot DIR, writes DIR/router_latency.png and DIR/router_throughput.png (P/D).
Last line: {"bench": "router", "pd_rps", "pd_cpu_us", "pd_rps_vs_vllm_router", "pd_cpu_vs_vllm_router", ...}.
"""

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec
from plots import add_plot_argument, bar_chart

from pdserve.api.continuation import TOKENS_HEADER, StreamTokens, tokens_comment
from pdserve.api.report import REPORT_HEADER, Report
from pdserve.api.report import comment as report_comment
from pdserve.launcher import free_port
from pdserve.router import event_loop

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
_ASKS_TOKENS = re.compile(rb"\r\n%s:\s*1\r\n" % TOKENS_HEADER.encode(), re.IGNORECASE)
_ASKS_REPORT = re.compile(rb"\r\n%s:\s*1\r\n" % REPORT_HEADER.encode(), re.IGNORECASE)


# ----- stub engines (plain asyncio streams: an HTTP/1.1 server that knows just enough) -----------------------


def _sse_events(with_tokens: bool, with_report: bool) -> list[bytes]:
    """A decode engine's stream as it writes it: per token one data event, after its token comment when the leg
    asked for them (``X-PDServe-Tokens``: the router's migration support), then the report comment when asked
    (``X-PDServe-Report``), then [DONE]."""
    events = []
    for i in range(TOKENS):
        finish = "length" if i == TOKENS - 1 else None
        chunk = {
            "id": "cmpl-1",
            "object": "text_completion",
            "created": 1,
            "model": "demo",
            "choices": [{"index": 0, "text": f" t{i}", "finish_reason": finish}],
        }
        event = b"data: " + msgspec.json.encode(chunk) + b"\n\n"
        if with_tokens:
            event = tokens_comment(StreamTokens(0, [100 + i], finish)) + event
        events.append(event)
    if with_report:
        events.append(report_comment(Report(prompt_tokens=8, completion_tokens=TOKENS, ttft_s=0.001, tpot_s=0.0005)))
    return [*events, b"data: [DONE]\n\n"]


def _whole(status: int, payload: bytes) -> bytes:
    return (
        b"HTTP/1.1 %d OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (status, len(payload))
        + payload
    )


async def _stub(role: str, health: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
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
    streams = {
        (tokens, report): [b"%x\r\n%s\r\n" % (len(event), event) for event in _sse_events(tokens, report)]
        for tokens in (False, True)
        for report in (False, True)
    }
    stream_head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = _CONTENT_LENGTH.search(head)
            body = await reader.readexactly(int(length.group(1))) if length else b""
            if head.startswith(b"GET"):
                writer.write(_whole(200, health))
            elif role == "prefill":
                writer.write(prefill_answer)
            elif _STREAM_TRUE.search(body):
                writer.write(stream_head)
                for event in streams[bool(_ASKS_TOKENS.search(head)), bool(_ASKS_REPORT.search(head))]:
                    writer.write(event)  # one chunk per token, as an engine writes them
                writer.write(b"0\r\n\r\n")
            else:
                writer.write(_whole(200, b'{"choices": [{"index": 0, "text": "t"}]}'))
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()


def _stub_health(role: str) -> bytes:
    """An engine's /health in what the router reads of it: its id and leg key (the stubs check no leg)."""
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    leg_key = X25519PrivateKey.generate().public_key().public_bytes_raw().hex()
    return msgspec.json.encode({"status": "ok", "engine_id": f"stub-{role}", "leg_key": leg_key})


async def serve_stubs(prefill_port: int, decode_port: int) -> None:
    servers = []
    for role, port in (("prefill", prefill_port), ("decode", decode_port)):
        health = _stub_health(role)
        server = await asyncio.start_server(
            lambda r, w, role=role, health=health: _stub(role, health, r, w), "127.0.0.1", port
        )
        servers.append(server)
    print("ready", flush=True)
    await asyncio.gather(*(server.serve_forever() for server in servers))


# ----- proxies under test -------------------------------------------------------------------------------------


async def serve_router(port: int, prefill: str | None, decode: str, keyed: str | None, settings: dict) -> None:
    """``keyed``: None (no keys: legs unauthenticated), "mac" (as shipped) or "ed25519" (every leg signed as for
    an engine that gives no leg key)."""
    import tempfile

    from pdserve.api.auth import RouterSigner
    from pdserve.api.keys import ROUTER_FILES, new_bundle, write_bundle
    from pdserve.router import RouterConfig, start_router

    keys_dir = None
    if keyed is not None:  # the router's own key files: it authenticates every leg for its target engine
        keys_dir = tempfile.mkdtemp(prefix="pdserve-bench-keys-")
        write_bundle(keys_dir, new_bundle(), ROUTER_FILES)
    if keyed == "ed25519":  # bench only: as if no engine gave a leg key
        RouterSigner.leg_header = lambda self, method, path, body, target, leg_key, now=None: self.header(
            method, path, body, target, now
        )
    config = RouterConfig([prefill] if prefill else [], [decode], keys_dir=keys_dir, **settings)
    await start_router(config, port=port)
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

    @app.get("/health")
    async def health() -> dict:  # what the bench polls before it measures a proxy
        return {"status": "ok"}

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


async def throughput(make_client, seconds: float, warmup: float = 0.5) -> tuple[float, int]:
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
    return measured / elapsed, measured


# ----- orchestration ------------------------------------------------------------------------------------------


def _ready(process: subprocess.Popen, what: str) -> subprocess.Popen:
    if process.stdout.readline().strip() != "ready":
        process.kill()
        raise RuntimeError(f"{what} did not start")
    return process


def _on_core(core: int | None) -> list[str]:
    """The words that start a command on ``core`` (none: anywhere)."""
    return ["taskset", "-c", str(core)] if core is not None and shutil.which("taskset") else []


def _spawn(args: list[str], launcher: list[str]) -> subprocess.Popen:
    """This script in another role, started under ``launcher`` (``_on_core``, or callgrind)."""
    command = [*launcher, sys.executable, __file__, *args]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    return _ready(subprocess.Popen(command, stdout=subprocess.PIPE, env=env, text=True), args[1])


def _spawn_binary(argv: list[str], launcher: list[str]) -> subprocess.Popen:
    """A proxy that is not ours (vllm-router): it says nothing when ready; its /health is polled."""
    return subprocess.Popen([*launcher, *argv], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU of a process and its reaped children, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(value) for value in fields[11:15]) / os.sysconf("SC_CLK_TCK")


async def _wait_listening(port: int, path: str = "/health") -> None:
    """Until the proxy answers ``path`` with 200 (a router polls its pods first: a bare port is not enough)."""
    for _ in range(600):
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET %s HTTP/1.1\r\nHost: x\r\n\r\n" % path.encode())
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2)
            writer.close()
            if head[9:12] == b"200":
                return
        except (TimeoutError, OSError, asyncio.IncompleteReadError):
            pass
        await asyncio.sleep(0.05)
    raise RuntimeError(f"nothing answers on {port}")


@dataclass
class Proxy:
    """One proxy under test: a name and how to start it on a port over the stubs (``prefill`` None: plain mode)."""

    name: str
    start: Callable[[int, str | None, str, list[str]], subprocess.Popen]  # port, prefill, decode, launcher
    pd_only: bool = False  # it has no plain mode


def _ours(role: str, **settings) -> Callable[[int, str | None, str, list[str]], subprocess.Popen]:
    def start(port: int, prefill: str | None, decode: str, launcher: list[str]) -> subprocess.Popen:
        argv = ["--serve", role, "--port", str(port), "--decode", decode, "--settings", json.dumps(settings)]
        return _spawn([*argv, *(["--prefill", prefill] if prefill else [])], launcher)

    return start


def _vllm_router(binary: str) -> Callable[[int, str | None, str, list[str]], subprocess.Popen]:
    def start(port: int, prefill: str | None, decode: str, launcher: list[str]) -> subprocess.Popen:
        argv = [binary, "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin", "--log-level", "error"]
        if prefill:
            argv += ["--vllm-pd-disaggregation", "--prefill", prefill, "--decode", decode]
        else:
            argv += ["--worker-urls", decode]
        return _spawn_binary(argv, launcher)

    return start


def _baseline(port: int, prefill: str | None, decode: str, launcher: list[str]) -> subprocess.Popen:
    argv = ["--serve", "baseline", "--port", str(port), "--prefill", prefill or "", "--decode", decode]
    return _spawn(argv, launcher)


async def measure_proxy(
    proxy: Proxy, prefill: str | None, decode: str, core: int | None, requests: int, seconds: float
) -> dict:
    port = free_port()
    process = proxy.start(port, prefill, decode, _on_core(core))
    try:
        await _wait_listening(port)
        url = f"http://127.0.0.1:{port}"
        p50, p99 = await latency(lambda: Connection(url), requests)
        before = _cpu_seconds(process.pid)
        rps, done = await throughput(lambda: Connection(url), seconds)
        cpu = _cpu_seconds(process.pid) - before
    finally:
        process.terminate()
        process.wait(10)
    return {"name": proxy.name, "p50_ms": p50, "p99_ms": p99, "rps": rps, "cpu_us": cpu / max(done, 1) * 1e6}


async def _requests(url: str, count: int, concurrency: int = 16) -> int:
    """``count`` P/D requests (rounded down to a multiple of ``concurrency``), that many at a time; how many."""
    body = msgspec.json.encode(BODY)
    each = count // concurrency

    async def worker() -> None:
        client = Connection(url)
        for _ in range(each):
            _check(*await client.post("/v1/completions", body))
        client.close()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return each * concurrency


async def measure_instructions(proxy: Proxy, prefill: str | None, decode: str, requests: int) -> dict:
    """User-space instructions the proxy executes per request, counted by callgrind: unlike CPU time on a shared
    machine, the same from run to run (±0.2%), so a change of 1-2% on the hot path shows. The kernel's share (the
    socket calls) is not counted; the proxy runs uninstrumented until it is warm."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="pdserve-callgrind-") as folder:
        out = f"{folder}/callgrind.out"
        launcher = ["valgrind", "-q", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}"]
        port = free_port()
        process = proxy.start(port, prefill, decode, launcher)
        try:
            await _wait_listening(port)
            url = f"http://127.0.0.1:{port}"
            await _requests(url, 400)
            control = ["callgrind_control"]
            subprocess.run([*control, "--instr=on", str(process.pid)], check=True, capture_output=True)
            await _requests(url, 64)  # the instrumented code's first run
            subprocess.run([*control, "--zero", str(process.pid)], check=True, capture_output=True)
            done = await _requests(url, requests)
            subprocess.run([*control, "--dump", str(process.pid)], check=True, capture_output=True)
            dumps = sorted(Path(folder).glob("callgrind.out.*"), key=lambda path: int(path.name.rsplit(".", 1)[1]))
            summary = next(line for line in dumps[-1].read_text().splitlines() if line.startswith("summary:"))
        finally:
            process.terminate()
            process.wait(60)
    return {"name": proxy.name, "instructions": int(summary.split()[1]) / done}


def _have_baseline() -> bool:
    try:
        import fastapi  # noqa: F401
        import httpx  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        return False
    return True


def _proxies(vllm_router: str | None) -> list[Proxy]:
    """Ours as shipped (legs MACed, flow control on, streams continued on failure), then with each off; the
    anchors that are installed."""
    proxies = [
        Proxy("pdserve router", _ours("router-mac", routing="round-robin")),
        Proxy("  legs signed (Ed25519)", _ours("router-ed25519", routing="round-robin")),
        Proxy("  unsigned legs", _ours("router", routing="round-robin")),
        Proxy("  no flow control", _ours("router-mac", routing="round-robin", flow_control=False)),
        Proxy("  no migration", _ours("router-mac", routing="round-robin", migration_limit=0)),
        Proxy("  all three off", _ours("router", routing="round-robin", flow_control=False, migration_limit=0)),
    ]
    if vllm_router is not None:
        proxies.append(Proxy("vllm-router (Rust)", _vllm_router(vllm_router)))
    if _have_baseline():
        proxies.append(Proxy("FastAPI + httpx proxy", _baseline, pd_only=True))
    else:
        print("FastAPI + httpx skipped: .venv/bin/pip install -e '.[bench]'", file=sys.stderr)
    return proxies


def _find_vllm_router(given: str | None) -> str | None:
    if given:
        return given
    found = shutil.which("vllm-router")
    if found is None:
        print("vllm-router skipped: pip install -e '.[router-anchors]' (or --vllm-router BIN)", file=sys.stderr)
    return found


def _chosen(name: str, only: str | None) -> bool:
    """Whether ``--only`` (comma-separated name prefixes) keeps the proxy named ``name``."""
    return only is None or any(name.strip().startswith(prefix.strip()) for prefix in only.split(","))


def _median_rows(rounds: list[list[dict]]) -> list[dict]:
    rows = []
    for measured in zip(*rounds, strict=True):
        row = {"name": measured[0]["name"]}
        for key in ("p50_ms", "p99_ms", "rps", "cpu_us"):
            row[key] = statistics.median(m[key] for m in measured)
        rows.append(row)
    return rows


async def run(args: argparse.Namespace) -> None:
    cores = sorted(os.sched_getaffinity(0))
    proxy_core, own_core = (cores[0], cores[1]) if len(cores) >= 2 else (None, None)
    if own_core is not None:
        os.sched_setaffinity(0, {own_core})  # the load generator and the stubs share the other core
    prefill_port, decode_port = free_port(), free_port()
    stubs = _spawn(
        ["--serve", "stubs", "--port", str(prefill_port), "--decode-port", str(decode_port)], _on_core(own_core)
    )
    prefill, decode = f"http://127.0.0.1:{prefill_port}", f"http://127.0.0.1:{decode_port}"
    proxies = [proxy for proxy in _proxies(_find_vllm_router(args.vllm_router)) if _chosen(proxy.name, args.only)]
    modes = {mode: leg for mode, leg in {"P/D": prefill, "plain": None}.items() if mode in args.modes}
    tables: dict[str, list[dict]] = {}
    if args.instructions:
        try:
            for mode, leg in modes.items():
                print(f"\n{mode} mode: user-space instructions per request (callgrind, {args.requests} requests)")
                for proxy in proxies:
                    if leg is not None or not proxy.pd_only:
                        row = await measure_instructions(proxy, leg, decode, args.requests)
                        print(f"{row['name']:<26}{row['instructions']:>12,.0f}", flush=True)
        finally:
            stubs.terminate()
            stubs.wait(10)
        return
    try:
        p50, p99 = await latency(lambda: TwoLegClient(prefill, decode), args.requests)
        rps, _ = await throughput(lambda: TwoLegClient(prefill, decode), args.seconds)
        direct = {"name": "client makes both legs", "p50_ms": p50, "p99_ms": p99, "rps": rps, "cpu_us": 0.0}
        for mode, leg in modes.items():
            rounds = []
            for _ in range(args.rounds):  # alternating: every proxy once per round
                measured = []
                for proxy in proxies:
                    if leg is not None or not proxy.pd_only:
                        measured.append(
                            await measure_proxy(proxy, leg, decode, proxy_core, args.requests, args.seconds)
                        )
                rounds.append(measured)
            tables[mode] = _median_rows(rounds)
    finally:
        stubs.terminate()
        stubs.wait(10)

    summary: dict = {"bench": "router", "rounds": args.rounds}
    print(f"streamed /v1/completions, {TOKENS} SSE chunks; latency 1 in flight; req/s, CPU {CONCURRENCY} in flight")
    print(f"median of {args.rounds} alternating rounds; CPU: the proxy process's user + system time per request")
    for mode, rows in tables.items():
        print(f"\n{mode} mode")
        print(f"{'proxy':<26}{'p50 ms':>9}{'p99 ms':>9}{'added p50':>11}{'req/s':>9}{'CPU us/req':>12}")
        if mode == "P/D":
            print(f"{direct['name']:<26}{direct['p50_ms']:>9.3f}{direct['p99_ms']:>9.3f}{'-':>11}{direct['rps']:>9.0f}")
        for row in rows:
            added = row["p50_ms"] - direct["p50_ms"]
            print(
                f"{row['name']:<26}{row['p50_ms']:>9.3f}{row['p99_ms']:>9.3f}{added:>+11.3f}"
                f"{row['rps']:>9.0f}{row['cpu_us']:>12.0f}"
            )
        ours = rows[0]
        key = mode.replace("/", "").lower()
        summary[f"{key}_rps"] = round(ours["rps"], 1)
        summary[f"{key}_cpu_us"] = round(ours["cpu_us"], 1)
        summary[f"{key}_added_p50_ms"] = round(ours["p50_ms"] - direct["p50_ms"], 3)
        anchor = next((row for row in rows if row["name"].startswith("vllm-router")), None)
        if anchor is not None:
            summary[f"{key}_rps_vs_vllm_router"] = round(ours["rps"] / anchor["rps"], 2)
            summary[f"{key}_cpu_vs_vllm_router"] = round(ours["cpu_us"] / anchor["cpu_us"], 2)
        baseline = next((row for row in rows if row["name"].startswith("FastAPI")), None)
        if baseline is not None:
            summary[f"{key}_rps_vs_fastapi"] = round(ours["rps"] / baseline["rps"], 2)
    if args.plot and "P/D" in tables:
        rows = [direct, *tables["P/D"]]
        bar_chart(
            args.plot,
            "router_latency",
            "P/D, streamed: latency with 1 request in flight (ms)",
            "ms",
            {row["name"].strip(): {"p50": row["p50_ms"], "p99": row["p99_ms"]} for row in rows},
        )
        bar_chart(
            args.plot,
            "router_throughput",
            f"P/D: requests/s with {CONCURRENCY} in flight",
            "requests/s",
            {row["name"].strip(): {"req/s": row["rps"]} for row in rows},
            log=True,
        )
    print(json.dumps(summary))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=1000, help="sequential requests per latency measurement")
    parser.add_argument("--seconds", type=float, default=4.0, help="length of each requests/s measurement")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (the median is reported)")
    parser.add_argument("--vllm-router", metavar="BIN", help="the vllm-router binary (default: on PATH)")
    parser.add_argument(
        "--only", metavar="NAMES", help="only the proxies whose names start so (comma-separated; default: all)"
    )
    parser.add_argument("--modes", nargs="+", choices=["P/D", "plain"], default=["P/D", "plain"], help="modes to run")
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="count each proxy's user-space instructions per request with callgrind (valgrind) instead: "
        "deterministic, for A/B work on the router's hot path (--requests of them, default 1000; ~10 s a proxy)",
    )
    add_plot_argument(parser)
    parser.add_argument(
        "--serve", choices=["stubs", "router", "router-mac", "router-ed25519", "baseline"], help=argparse.SUPPRESS
    )
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--decode-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--prefill", help=argparse.SUPPRESS)
    parser.add_argument("--decode", help=argparse.SUPPRESS)
    parser.add_argument("--settings", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve == "stubs":
        asyncio.run(serve_stubs(args.port, args.decode_port))
    elif args.serve in ("router", "router-mac", "router-ed25519"):
        settings = json.loads(args.settings)
        keyed = args.serve.removeprefix("router-") if args.serve != "router" else None
        event_loop.run(serve_router(args.port, args.prefill, args.decode, keyed, settings))
    elif args.serve == "baseline":
        serve_baseline(args.port, args.prefill, args.decode)
    else:
        asyncio.run(run(args))


if __name__ == "__main__":
    main()
