"""The engine's API process: the aiohttp application and its routes in front of an EngineCore
process, how it starts (``start_engine_server``) and how it drains and stops (``RunningServer``).

The generation endpoints are ``serving.OpenAIServing``'s; this module holds the small ones
(models, health, metrics, OpenAPI, debug). Requests are validated by decoding into
``pdserve.api.protocol`` types and by the input processor; anything wrong is a 4xx
OpenAI-style error, never a crash.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from pdserve.api.auth import RouterVerifier
from pdserve.api.http import api_key_middleware, error_middleware, json_response, reserve_port, start_app
from pdserve.api.openapi import MAX_BODY_BYTES, ApiLimits, openapi_document
from pdserve.api.protocol import (
    KVReleaseRequest,
    KVReleaseResponse,
    ModelCard,
    ModelList,
    ProtocolError,
    decode_request,
)
from pdserve.api.roles import engine_role
from pdserve.api.tokenizer import load_tokenizer
from pdserve.engine.engine_args import EngineArgs
from pdserve.engine.sampling_params import SamplingParamsError
from pdserve.models.config import ModelConfig
from pdserve.server.chat_output import ChatParsers
from pdserve.server.core_client import EngineCoreClient, EngineDeadError
from pdserve.server.input_processor import InputError, InputProcessor
from pdserve.server.metrics import EngineMetrics
from pdserve.server.serving import MAX_N, OpenAIServing, ServerLimits

logger = logging.getLogger(__name__)


def _engine_errors(error: Exception) -> ProtocolError | None:
    """The API process's own exceptions as HTTP errors (the toolkit's middleware asks)."""
    if isinstance(error, InputError | SamplingParamsError):
        return ProtocolError(str(error), param=error.param)
    if isinstance(error, EngineDeadError):
        return ProtocolError(str(error), 503, error_type="service_unavailable")
    return None


class EngineServer:
    def __init__(
        self,
        client: EngineCoreClient,
        tokenizer: Any,
        model_name: str,
        eos_token_ids: list[int],
        api_key: str | None = None,
        limits: ServerLimits | None = None,
        kv_transfer: bool = False,
        serves_blocks: bool = False,
        router_verifier: RouterVerifier | None = None,
        chat_parsers: ChatParsers | None = None,
    ) -> None:
        self.client = client
        self.api_key = api_key
        self.model_name = model_name
        self.max_model_len = client.ready.max_model_len
        self.metrics = EngineMetrics(
            lambda: client.stats,
            {
                "block_size": str(client.ready.block_size),
                "num_gpu_blocks": str(client.ready.num_kv_blocks),
                "enable_prefix_caching": str(client.ready.enable_prefix_caching),
                "cache_dtype": client.ready.kv_cache_dtype,
            },
            client.ready.cpu,
            (client.ready.startup_phases, client.ready.startup_seconds),
        )
        client.on_stats = self.metrics.observe_stats
        self.processor = InputProcessor(tokenizer, len(tokenizer), self.max_model_len, eos_token_ids)
        self.serving = OpenAIServing(
            client,
            self.processor,
            model_name,
            self.metrics,
            limits or ServerLimits(),
            kv_transfer,
            serves_blocks,
            router_verifier,
            chat_parsers,
        )
        self.created = int(time.time())
        self._openapi: bytes | None = None

    @property
    def draining(self) -> bool:
        return self.serving.draining

    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=MAX_BODY_BYTES,
            middlewares=[error_middleware(_engine_errors), api_key_middleware(self.api_key)],
        )
        app.router.add_post("/v1/completions", self.serving.completions)
        app.router.add_post("/v1/chat/completions", self.serving.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.render_metrics)
        app.router.add_get("/openapi.json", self.openapi)
        app.router.add_get("/debug/cached_blocks", self.debug_cached_blocks)
        if self.serving.gate.kv_transfer:
            app.router.add_post("/v1/kv_transfer/release", self.release_held_blocks)
        return app

    async def release_held_blocks(self, request: web.Request) -> web.Response:
        """Free the blocks a prefill leg of this engine holds (the router says no decode will pull
        them). Its request finished already; aborting it ends the hold at once instead of by lease.
        An unknown or already released id is a no-op: releasing twice is harmless. Like P/D params,
        taken only from the router when the engine has keys."""
        raw = await request.read()
        body = decode_request(raw, KVReleaseRequest)
        self.serving.gate.verify_router(request, raw)
        request_id = body.kv_transfer_params.remote_request_id
        await self.client.abort([request_id])
        return json_response(KVReleaseResponse(released=request_id))

    async def models(self, request: web.Request) -> web.Response:
        card = ModelCard(id=self.model_name, created=self.created, max_model_len=self.max_model_len)
        return json_response(ModelList(data=[card]))

    async def health(self, request: web.Request) -> web.Response:
        if not self.client.alive:
            return web.json_response({"status": "engine core is not running"}, status=503)
        if self.draining:
            return web.json_response({"status": "shutting down"}, status=503)
        # Routers learn here where this engine publishes its KV-cache events (pdserve/api/kv_events.py),
        # which engines it may pair with (the same KV compatibility hash; the KV dtype, to say why not) and its id
        # for this run (what the router signs P/D legs for, and the engine its KV events must name), the leg key of
        # this run (the router's legs carry a MAC from it: pdserve/api/auth.py), and where it serves peer reads.
        ready = self.client.ready
        peer_source = ready.kv_peer_source
        verifier = self.serving.gate.router_verifier
        return web.json_response(
            {
                "status": "ok",
                "kv_events_port": ready.kv_events_port,
                "kv_compat_hash": ready.kv_compat_hash,
                "kv_cache_dtype": ready.kv_cache_dtype,
                "engine_id": ready.engine_id,
                "leg_key": None if verifier is None else verifier.leg_key,
                "kv_peer_source": None
                if peer_source is None
                else {"host": peer_source[0], "ports": peer_source[1], "hold_seconds": peer_source[2]},
            }
        )

    async def render_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8")

    async def openapi(self, request: web.Request) -> web.Response:
        if self._openapi is None:
            limits = ApiLimits(
                max_model_len=self.max_model_len,
                vocab_size=self.processor.vocab_size,
                max_n=MAX_N,
                max_logprobs=self.processor.max_logprobs,
                max_choices=self.serving.limits.max_in_flight,
            )
            document = openapi_document(
                f"pdserve engine ({self.model_name})",
                "v1",
                server="engine",
                limits=limits,
                kv_transfer=self.serving.gate.kv_transfer,
                api_key=self.api_key is not None,
                priorities=self.client.ready.scheduling_policy == "priority",
            )
            self._openapi = msgspec.json.encode(document)
        return web.Response(body=self._openapi, content_type="application/json")

    async def debug_cached_blocks(self, request: web.Request) -> web.Response:
        """Every hash in the prefix cache (hex), for checking what routers believe against the truth."""
        hashes = await self.client.cached_blocks()
        return web.json_response(
            {"block_size": self.client.ready.block_size, "block_hashes": [block_hash.hex() for block_hash in hashes]}
        )


@dataclass
class RunningServer:
    """A started engine server: its URL, and how to drain and stop it."""

    url: str
    server: EngineServer
    runner: web.AppRunner

    async def drain(self, timeout: float, handoff: float | None = None) -> bool:
        """Stop taking new requests (503, /health fails) and wait, at most ``timeout`` seconds, until
        the running ones have finished and no blocks are held for a remote decode (a prefill keeps
        serving pulls for what it holds). After ``handoff`` seconds (None: never), the streams the
        router relays are handed back to it, to continue elsewhere. True when everything drained in time."""
        serving = self.server.serving
        serving.draining = True
        client = self.server.client
        started = time.monotonic()
        deadline = started + timeout
        while time.monotonic() < deadline and client.alive:
            if handoff is not None and not serving.handing_off and time.monotonic() >= started + handoff:
                serving.handing_off = True
            stats = client.stats
            if client.num_in_flight == 0 and (stats is None or stats.remote_kv.num_blocks_held_for_remote == 0):
                return True
            await asyncio.sleep(0.1)
        return not client.alive

    async def close(self) -> None:
        await self.runner.cleanup()  # stops accepting, closes connections (their handlers abort)
        if self.server.serving.gateway_prefill is not None:
            await self.server.serving.gateway_prefill.close()
        await self.server.client.shutdown()


async def start_engine_server(
    args: EngineArgs,
    host: str = "127.0.0.1",
    port: int = 0,
    served_model_name: str | None = None,
    api_key: str | None = None,
    limits: ServerLimits | None = None,
    router_verifier: RouterVerifier | None = None,
    tool_call_parser: str | None = None,
) -> RunningServer:
    """Start the core process and the HTTP server; ``port`` 0 picks a free port. ``router_verifier``:
    P/D params and releases are taken only with the router's signature (None: from any client).
    ``tool_call_parser``: reads tool calls from answers (``tool_choice`` "auto"); the reasoning
    parser is the engine's (``args.reasoning_parser``)."""
    folder = args.model
    if folder is None:  # the built-in demo model, written once here: the core then reads the same folder
        from pdserve.models.demo import ensure_demo_model

        folder = str(ensure_demo_model())
        args = replace(args, model=folder)
    tokenizer = load_tokenizer(args.tokenizer or folder)
    chat_parsers = ChatParsers.of(tokenizer, args.reasoning_parser, tool_call_parser)  # raises before anything starts
    # The HTTP port is taken first: starting the core binds free ports of its own (side channels, one
    # per rank, KV events), and one of those must never be the port this server was told to use.
    reserved = reserve_port(host, port)
    try:
        client = await EngineCoreClient.start(args)
    except BaseException:
        reserved.close()
        raise
    try:
        eos_ids = ModelConfig.from_folder(folder).eos_token_ids or (
            [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        )
        server = EngineServer(
            client,
            tokenizer,
            served_model_name or Path(folder).name,
            eos_ids,
            api_key,
            limits,
            kv_transfer=engine_role(args.role).kv_transfer,
            serves_blocks=engine_role(args.role).serves_blocks,
            router_verifier=router_verifier,
            chat_parsers=chat_parsers,
        )
        runner, url = await start_app(server.app(), host, port, reserved)
    except BaseException:
        reserved.close()
        await client.shutdown()
        raise
    logger.info(
        "serving %s at %s/v1 (KV cache: %d blocks of %d tokens, context %d)",
        server.model_name,
        url,
        client.ready.num_kv_blocks,
        client.ready.block_size,
        client.ready.max_model_len,
    )
    return RunningServer(url, server, runner)
