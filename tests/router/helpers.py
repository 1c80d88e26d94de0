"""Stand-ins for engines in router tests: small aiohttp apps on 127.0.0.1 that record what they were sent and
answer like a prefill or decode engine would, and (``events=True``) publish KV-cache event batches on a ZMQ PUB
socket advertised in /health, as engines do (real engines behind the router are covered by the end-to-end P/D
tests and tests/router/test_routing_engines.py). Everything runs on one event loop in a background thread;
tests hand it coroutines."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
import uvloop
import zmq
import zmq.asyncio
from aiohttp import web
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from multidict import CIMultiDict

from pdserve.api.auth import ENGINE_ID_HEADER, ENGINE_LEG_KEY_HEADER, ROUTER_AUTH_HEADER, WRONG_TARGET, RouterVerifier
from pdserve.api.continuation import CONTINUED_HEADER, TOKENS_HEADER, StreamTokens, tokens_comment
from pdserve.api.keys import KeyRing
from pdserve.api.kv_events import EngineLoad, EventSigner, KVEventBatch, TierEvents, encode_batch
from pdserve.launcher import free_port
from pdserve.router import RouterConfig, RunningRouter, start_router

KV_PARAMS = {
    "do_remote_prefill": True,
    "remote_engine_id": "e1",
    "remote_request_id": "r",
    "remote_block_ids": [1, 2],
    "remote_host": "127.0.0.1",
    "remote_port": 5555,
    "x_extra": {"a": 1},
}


class LoopThread:
    """An event loop in a daemon thread, as a separate process would have: uvloop's, the router process's."""

    def __init__(self) -> None:
        self.loop = uvloop.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coroutine: Coroutine[Any, Any, Any], timeout: float = 20.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@dataclass
class Seen:
    path: str
    body: dict[str, Any]
    headers: CIMultiDict[str]  # header names are case-insensitive (aiohttp sends X-Request-ID)


def stream_bytes(path: str, tokens: int) -> bytes:
    """The SSE answer of the decode stub, one event per token, as OpenAI would frame it."""
    events = []
    for i in range(tokens):
        finish = "length" if i == tokens - 1 else None
        if path.endswith("/chat/completions"):
            chunk = {
                "id": "c1",
                "object": "chat.completion.chunk",
                "created": 1,
                "model": "demo",
                "choices": [{"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": finish}],
            }
        else:
            chunk = {
                "id": "c1",
                "object": "text_completion",
                "created": 1,
                "model": "demo",
                "choices": [{"index": 0, "text": f"t{i} ", "finish_reason": finish}],
            }
        events.append(b"data: " + msgspec.json.encode(chunk) + b"\n\n")
    return b"".join(events) + b"data: [DONE]\n\n"


def usage(cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": 100,
        "completion_tokens": 8,
        "total_tokens": 108,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def usage_event(path: str, cached_tokens: int) -> bytes:
    """The last data event of a stream that asked for ``include_usage``."""
    kind = "chat.completion.chunk" if path.endswith("/chat/completions") else "text_completion"
    return (
        b"data: "
        + msgspec.json.encode(
            {"id": "c1", "object": kind, "created": 1, "model": "demo", "choices": [], "usage": usage(cached_tokens)}
        )
        + b"\n\n"
    )


def whole_answer(
    path: str, text: str, kv_params: dict[str, Any] | None = None, cached_tokens: int | None = None
) -> dict[str, Any]:
    extra = {} if cached_tokens is None else {"usage": usage(cached_tokens)}
    if path.endswith("/chat/completions"):
        return {
            "id": "c1",
            "object": "chat.completion",
            "created": 1,
            "model": "demo",
            "kv_transfer_params": kv_params,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}],
            **extra,
        }
    return {
        "id": "c1",
        "object": "text_completion",
        "created": 1,
        "model": "demo",
        "kv_transfer_params": kv_params,
        "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
        **extra,
    }


class Stub:
    """A prefill or decode engine stand-in. Settable: ``status`` (answer with an error), ``kv_params``
    (what prefill returns), ``tokens`` and ``delay`` (per token for decode, once for prefill), ``die_after``,
    ``cached_tokens`` (reported in usage when set; streams add a usage event when asked). With ``events``, it
    publishes KV-event batches (``publish``) on the port its /health advertises."""

    def __init__(
        self,
        role: str,
        events: bool = False,
        signer: EventSigner | None = None,
        router_public: KeyRing[Ed25519PublicKey] | None = None,
    ) -> None:
        self.role = role
        self.events = events
        self.signer = signer  # signs the KV-event batches (events.key), as an engine with keys does
        # With router.pub, legs and releases are checked as an engine checks them (pdserve/api/auth.py).
        self.router_public = router_public
        self.verifier = RouterVerifier(router_public, f"stub-{id(self):x}") if router_public is not None else None
        self.cached_tokens: int | None = None
        self.engine_id = f"stub-{id(self):x}"
        self.seq = 0
        self.kv_events_port: int | None = None
        self._context: zmq.asyncio.Context | None = None
        self._publisher: zmq.asyncio.Socket | None = None
        self.seen: list[Seen] = []
        self.status = 200
        self.kv_params: dict[str, Any] | None = KV_PARAMS
        self.tokens = 8
        self.answer_headers: dict[str, str] = {}  # on every 200 answer (a decode engine's rejected-params header)
        self.released: list[str] = []  # request ids of held blocks the router asked to free
        self.wait_before_answer = 0.0  # seconds before any answer (headers included)
        self.hung = False  # /health answers nothing (with wait_before_answer: a stopped process)
        self.delay = 0.0
        self.die_after: int | None = None  # decode: drop the connection after this many tokens
        # As a decode engine does for the router: token comments (token i is 100 + i) and continuations.
        self.compat_hash: str | None = None
        self.kv_cache_dtype: str | None = None  # what /health says the KV cache stores
        self.continue_status = 200  # the answer to a continuation (a 4xx: its history refused)
        self.error_after: int | None = None  # decode: end the stream with a 503 error event after this many tokens
        self.cancelled = threading.Event()  # a handler of ours was cancelled or found its client gone
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> Stub:
        app = web.Application()
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_post("/v1/kv_transfer/release", self.release)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        if self.events:
            self._context = zmq.asyncio.Context()
            self._publisher = self._context.socket(zmq.PUB)
            self._publisher.setsockopt(zmq.LINGER, 0)
            self.kv_events_port = self._publisher.bind_to_random_port("tcp://127.0.0.1")
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._publisher is not None:
            self._publisher.close(linger=0)
            self._context.term()
            self._publisher = self._context = None

    async def publish(
        self,
        stored: list[bytes] = (),
        removed: list[bytes] = (),
        snapshot: list[bytes] | None = None,
        block_size: int = 16,
        load: EngineLoad | None = None,
        seq: int | None = None,
        engine_id: str | None = None,
        tiers: list[TierEvents] = (),
    ) -> None:
        """Publish one batch (consecutive ``seq`` unless given; in the stub's name unless ``engine_id``)."""
        self.seq = self.seq if seq is None else seq
        batch = KVEventBatch(
            engine_id or self.engine_id,
            self.seq,
            block_size,
            list(stored),
            list(removed),
            load or EngineLoad(0, 0, 0, 0.0, 0),
            None if snapshot is None else list(snapshot),
            list(tiers),
        )
        self.seq += 1
        await self.send_raw(encode_batch(batch))

    async def rebind_events(self) -> None:
        """What a restarted engine looks like to a router: another events port, another engine id."""
        self._publisher.close(linger=0)
        self._publisher = self._context.socket(zmq.PUB)
        self._publisher.setsockopt(zmq.LINGER, 0)
        self.kv_events_port = self._publisher.bind_to_random_port("tcp://127.0.0.1")
        self.engine_id, self.seq = f"stub-{id(self):x}-again", 0

    async def send_raw(self, *frames: bytes) -> None:
        """Frames as they are (one: signed first when the stub signs)."""
        if self.signer is not None and len(frames) == 1:
            frames = tuple(self.signer.frames(frames[0]))
        await self._publisher.send_multipart(list(frames))

    def restart(self) -> None:
        """A new run, as far as leg checks go: another engine id and leg key (a router that has not polled /health
        since makes its next leg for the old one)."""
        assert self.router_public is not None
        self.engine_id = f"stub-{id(self):x}-{time.monotonic_ns()}"
        self.verifier = RouterVerifier(self.router_public, self.engine_id)

    def refused(self, request: web.Request, raw: bytes) -> web.Response | None:
        """The 403 an engine with keys answers a leg the router did not make for it, or None."""
        if self.verifier is None:
            return None
        problem = self.verifier.problem(request.headers.get(ROUTER_AUTH_HEADER), request.method, request.path, raw)
        if problem is None:
            return None
        error = {"message": problem, "type": problem, "param": "kv_transfer_params", "code": 403}
        headers = {ENGINE_ID_HEADER: self.engine_id, ENGINE_LEG_KEY_HEADER: self.verifier.leg_key}
        return web.json_response({"error": error}, status=403, headers=headers if problem == WRONG_TARGET else None)

    async def health(self, request: web.Request) -> web.Response:
        if self.hung:
            await asyncio.sleep(60)
        health = {
            "status": "ok",
            "engine_id": self.engine_id,
            "kv_compat_hash": self.compat_hash,
            "kv_cache_dtype": self.kv_cache_dtype,
        }
        if self.verifier is not None:
            health["leg_key"] = self.verifier.leg_key
        if self.kv_events_port is not None:
            health["kv_events_port"] = self.kv_events_port
        return web.json_response(health)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": "demo", "object": "model", "created": 1, "owned_by": "pdserve"}]}
        )

    async def release(self, request: web.Request) -> web.Response:
        refused = self.refused(request, await request.read())
        if refused is not None:
            return refused
        body = await request.json()
        self.released.append(body["kv_transfer_params"]["remote_request_id"])
        return web.json_response({"released": body["kv_transfer_params"]["remote_request_id"]})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        refused = self.refused(request, await request.read())
        if refused is not None:
            return refused
        body = await request.json()
        self.seen.append(Seen(request.path, body, CIMultiDict(request.headers)))
        try:
            await asyncio.sleep(self.wait_before_answer)
            if self.status != 200:
                return web.json_response(
                    {
                        "error": {
                            "message": f"stub says {self.status}",
                            "type": "stub",
                            "param": None,
                            "code": self.status,
                        }
                    },
                    status=self.status,
                    headers={"Retry-After": "2"} if self.status == 503 else None,
                )
            if self.role == "prefill":
                await asyncio.sleep(self.delay)
                return web.json_response(whole_answer(request.path, "x", self.kv_params, self.cached_tokens))
            if not body.get("stream"):
                return web.json_response(
                    whole_answer(
                        request.path, "".join(f"t{i} " for i in range(self.tokens)), cached_tokens=self.cached_tokens
                    ),
                    headers=self.answer_headers,
                )
            continued = (body.get("kv_transfer_params") or {}).get("continue")
            headers = {"Content-Type": "text/event-stream", **self.answer_headers}
            if continued is not None:
                if self.continue_status != 200:
                    error = {"message": "history refused", "type": "invalid_request_error", "code": 400}
                    return web.json_response({"error": error}, status=self.continue_status)
                headers[CONTINUED_HEADER] = "1"
            response = web.StreamResponse(headers=headers)
            await response.prepare(request)
            events = stream_bytes(request.path, self.tokens).split(b"\n\n")[:-1]
            if self.cached_tokens is not None and (body.get("stream_options") or {}).get("include_usage"):
                events.insert(-1, usage_event(request.path, self.cached_tokens)[:-2])
            start = len(continued["choices"][0]["token_ids"]) if continued and continued["choices"] else 0
            with_tokens = request.headers.get(TOKENS_HEADER) == "1"
            for i, event in enumerate(events):
                if i < start:
                    continue
                if i == self.die_after:
                    request.transport.close()
                    return response
                if i == self.error_after:  # as an engine whose core died mid-stream ends it
                    error = {"message": "the engine core died", "type": "service_unavailable", "code": 503}
                    await response.write(b"data: " + msgspec.json.encode({"error": error}) + b"\n\ndata: [DONE]\n\n")
                    return response
                if with_tokens and i < self.tokens:
                    finish = "length" if i == self.tokens - 1 else None
                    event = tokens_comment(StreamTokens(0, [100 + i], finish))[:-2] + b"\n\n" + event
                await response.write(event + b"\n\n")
                await asyncio.sleep(self.delay)
            await response.write_eof()
            return response
        except (asyncio.CancelledError, ConnectionResetError):
            self.cancelled.set()
            raise


def free_port_url() -> str:
    """A URL where nothing listens (connection refused)."""
    return f"http://127.0.0.1:{free_port()}"


class Cluster:
    """Stubs and routers started for one test, stopped after it."""

    def __init__(self, loop: LoopThread) -> None:
        self.loop = loop
        self._stubs: list[Stub] = []
        self._routers: list[RunningRouter] = []

    def stub(
        self,
        role: str,
        events: bool = False,
        signer: EventSigner | None = None,
        router_public: KeyRing[Ed25519PublicKey] | None = None,
    ) -> Stub:
        stub = self.loop.run(Stub(role, events, signer, router_public).start())
        self._stubs.append(stub)
        return stub

    def router(self, prefill: list[str], decode: list[str], **settings: Any) -> RunningRouter:
        settings.setdefault("pd_min_prefill_tokens", 0)  # tests of the decider turn it on themselves
        running = self.loop.run(start_router(RouterConfig(prefill, decode, **settings)))
        self._routers.append(running)
        return running

    def close(self) -> None:
        for running in self._routers:
            self.loop.run(running.close())
        for stub in self._stubs:
            self.loop.run(stub.stop())


async def post(url: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    data = body if isinstance(body, bytes) else msgspec.json.encode(body)
    async with aiohttp.ClientSession() as session, session.post(url, data=data, headers=headers) as response:
        return response.status, dict(response.headers), await response.read()


async def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as session, session.get(url, headers=headers) as response:
        return response.status, await response.read()


def metrics_text(loop: LoopThread, router: RunningRouter) -> str:
    status, text = loop.run(get(router.url + "/metrics"))
    assert status == 200
    return text.decode()


def settles(condition: Callable[[], Any], seconds: float = 5.0) -> bool:
    """Whether ``condition()`` becomes true within ``seconds`` (what another thread or process does takes time)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()
