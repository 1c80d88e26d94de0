"""The P/D gate of an engine's API process: what a request's ``kv_transfer_params`` may make this engine do,
decided once, before the request reaches the core.

An engine in a P/D role reads the params once (``PDGate.open``) into a :class:`PDLeg`: a prefill leg
(``do_remote_decode``) or a decode leg (``do_remote_prefill``, parsed into a typed ``RemotePrefill``;
malformed params are a 400 naming the field). Any other engine ignores them, as vLLM does without a KV
connector. P/D params make this engine hold KV for others or connect to a peer the params name, so with keys
they are taken only from the router: its signed ``X-PDServe-Router-Auth`` header (pdserve/api/auth.py), made for
this engine's id and checked before anything else (a forged decode leg must not even make this engine release
the blocks it names).

Once its prompt is known, a decode leg is screened (``screen``, the decode role's rule
``pdserve.kvtransfer.decode_side.unusable_reason``): remote blocks of another model or layout, or of another
prompt, or a request for prompt logprobs (which need the prompt's logits), are not pulled but computed here:
the prefill engine is told to free, the rejection counted, and the answer says why in a header, so the router
does not count the request as disaggregated. What passes goes to the core as it is, over ZMQ
(``EngineCoreClient.add_request``), where the connector takes it as screened.

A decode leg refused at the door (a body that does not decode, a bad value) tells its prefill engine to free the
blocks it holds for it; one refused for now (503: overload, draining) does not, since the router may send it to
another decode engine.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
from aiohttp import web

from pdserve.api.auth import (
    ENGINE_ID_HEADER,
    ENGINE_LEG_KEY_HEADER,
    ROUTER_AUTH_HEADER,
    WRONG_TARGET,
    RouterVerifier,
)
from pdserve.api.continuation import Continuation, parse_continuation
from pdserve.api.peer_kv import PeerKV, parse_peer_kv
from pdserve.api.protocol import (
    KV_PARAMS_REJECTED_HEADER,
    ChatCompletionRequest,
    CompletionRequest,
    ProtocolError,
    decode_request,
)
from pdserve.kvtransfer.decode_side import unusable_reason
from pdserve.kvtransfer.params import RemotePrefill, parse_remote_prefill, wants_remote_decode
from pdserve.server.core_client import EngineCoreClient
from pdserve.server.input_processor import InputError
from pdserve.server.metrics import EngineMetrics

RequestT = TypeVar("RequestT", CompletionRequest, ChatCompletionRequest)


@dataclass(frozen=True)
class PDLeg:
    """A request's part in P/D, as its ``kv_transfer_params`` say (the default: none)."""

    remote_decode: bool = False  # a prefill leg: its prompt's KV is held for a decode engine when it ends
    remote_prefill: RemotePrefill | None = None  # a decode leg: its prompt's KV is pulled from there
    peer: PeerKV | None = None  # peer reads: hold this request's blocks for peers, or read its prefix from one
    continued: Continuation | None = None  # a stream another engine broke off: its output so far


# Per HTTP request: its leg as it stands (a screen may drop its remote blocks), and why its params went unused.
_LEG_KEY = web.RequestKey("pd_leg", PDLeg)
_REJECTED_KEY = web.RequestKey("kv_params_rejected", str)


class _PDParamsOnly(msgspec.Struct):
    """A request body read for its P/D params alone (the rest may be invalid)."""

    kv_transfer_params: dict[str, Any] | None = None


def _params_of(raw: bytes) -> dict[str, Any] | None:
    """The body's ``kv_transfer_params``, when it is a JSON object that has them as an object."""
    try:
        return msgspec.json.decode(raw, type=_PDParamsOnly).kv_transfer_params
    except msgspec.MsgspecError:
        return None


def _remote_prefill_or_none(params: dict[str, Any]) -> RemotePrefill | None:
    """The remote blocks ``params`` name, if they are well-formed (nothing else could be released)."""
    try:
        return parse_remote_prefill(params)
    except ValueError:
        return None


def leg_headers(request: web.Request) -> dict[str, str] | None:
    """Headers a decode leg's answer carries: why its params were not used, when they were not."""
    reason = request.get(_REJECTED_KEY)
    return {KV_PARAMS_REJECTED_HEADER: reason} if reason is not None else None


class PDGate:
    def __init__(
        self,
        client: EngineCoreClient,
        metrics: EngineMetrics,
        kv_transfer: bool,
        serves_blocks: bool,
        router_verifier: RouterVerifier | None,
    ) -> None:
        """``kv_transfer``: this engine speaks the P/D protocol (a P/D role); ``serves_blocks``: it takes
        prefill legs (the prefill role); ``router_verifier``: None takes P/D params from any client (no keys)."""
        self.client = client
        self.metrics = metrics
        self.kv_transfer = kv_transfer
        self.serves_blocks = serves_blocks
        self.router_verifier = router_verifier

    async def open(
        self, request: web.Request, raw: bytes, request_type: type[RequestT], own_params: bool = False
    ) -> tuple[RequestT, PDLeg]:
        """The request's body and its P/D leg (``own_params``: its params are this engine's own prefill leg's
        answer, behind a gateway: taken without the router's signature). Raises ProtocolError for a body that does
        not decode (400) or P/D params not from the router (403), InputError (400, naming the field) for params
        this engine cannot act on; a decode leg refused after its params were read tells its prefill engine to
        free."""
        try:
            body = decode_request(raw, request_type)
        except ProtocolError as error:
            # A decode leg's body that does not decode (``max_tokens: "ten"``, say: the prefill leg, sent with
            # ``max_tokens`` 1, took it) still names its prefill engine's hold, freed now rather than by lease.
            params = _params_of(raw) if self.kv_transfer else None
            if params:
                if not own_params:
                    self.verify_router(request, raw)
                await self._release_refused(_remote_prefill_or_none(params), error)
            raise
        continued = None
        if body.kv_transfer_params and body.kv_transfer_params.get("continue") is not None:
            # Whatever the role: an engine that ignored it would answer the whole output again.
            self.verify_router(request, raw)
            try:
                continued = parse_continuation(body.kv_transfer_params)
            except ValueError as error:
                raise InputError("kv_transfer_params", str(error)) from error
            if set(body.kv_transfer_params) - {"continue", "kv_peer_hold"}:
                raise InputError(
                    "kv_transfer_params", "a continued request computes its history here: it takes no other P/D leg"
                )
            if not body.stream:
                raise InputError("stream", "kv_transfer_params.continue continues a stream: it needs stream=true")
        params = body.kv_transfer_params if self.kv_transfer else None
        if not params:
            leg = PDLeg(continued=continued)
        else:
            if continued is None and not own_params:
                self.verify_router(request, raw)
            if wants_remote_decode(params) and not self.serves_blocks:
                raise InputError(
                    "kv_transfer_params",
                    "this engine hands its KV to no peer (decode role): send prefill legs to prefill",
                )
            try:
                remote_prefill = parse_remote_prefill(params)  # client input: a 400 naming the field
                peer = parse_peer_kv(params)
            except ValueError as error:
                raise InputError("kv_transfer_params", str(error)) from error
            if peer is not None and peer.hold and wants_remote_decode(params):
                raise InputError(
                    "kv_transfer_params",
                    "kv_peer_hold holds a finished turn for peers; a prefill leg's blocks are held for its decode",
                )
            leg = PDLeg(wants_remote_decode(params), remote_prefill, peer, continued)
        request[_LEG_KEY] = leg
        async with self.releasing_refused(request):
            if leg.remote_decode and body.stream:
                raise InputError(
                    "stream",
                    "a prefill leg (kv_transfer_params.do_remote_decode) needs stream=false: its answer carries "
                    "the transfer parameters",
                )
            if params and set(params) != {"continue"} and body.n is not None and body.n > 1:
                raise InputError("n", "kv_transfer_params needs n=1 (one request's KV is handed over)")
        return body, leg

    def verify_router(self, request: web.Request, raw: bytes) -> None:
        """403 unless the router signed this request (or nothing needs its signature)."""
        if self.router_verifier is None:
            return
        header = request.headers.get(ROUTER_AUTH_HEADER)
        problem = self.router_verifier.problem(header, request.method, request.path, raw)
        if problem == WRONG_TARGET:  # signed for another engine (or a previous run of this one)
            raise ProtocolError(
                f"this request was signed for another engine; this is engine {self.router_verifier.engine_id}",
                403,
                param="kv_transfer_params",
                error_type=WRONG_TARGET,
                headers={
                    ENGINE_ID_HEADER: self.router_verifier.engine_id,
                    ENGINE_LEG_KEY_HEADER: self.router_verifier.leg_key,
                },
            )
        if problem is not None:
            raise ProtocolError(
                f"kv_transfer_params are taken only from the router (its {ROUTER_AUTH_HEADER} header: {problem})",
                403,
                param="kv_transfer_params",
                error_type="permission_denied",
            )

    async def screen(
        self, request: web.Request, leg: PDLeg, prompts: list[list[int]], wants_prompt_logprobs: bool
    ) -> PDLeg:
        """The leg the core gets for ``prompts``: a decode leg's remote blocks are dropped (freed, counted, said
        in a header) unless they can serve it. Called once the request is admitted: a request refused for now
        (503) goes to another decode engine, which must still find the blocks held."""
        remote = leg.remote_prefill
        if remote is None:
            return leg
        if len(prompts) > 1:
            reason: str | None = "several_prompts"
        else:
            compat_hash = self.client.ready.kv_compat_hash
            reason = unusable_reason(remote, prompts[0], compat_hash, wants_prompt_logprobs)
        if reason is None:
            return leg
        await self.client.release_remote_blocks(remote)
        self.metrics.kv_params_rejected.labels(reason).inc()
        request[_REJECTED_KEY] = reason
        leg = request[_LEG_KEY] = dataclasses.replace(leg, remote_prefill=None)
        return leg

    @contextlib.asynccontextmanager
    async def releasing_refused(self, request: web.Request) -> AsyncIterator[None]:
        """A decode leg refused here never reaches the scheduler, whose connector would otherwise tell the
        prefill engine to free its blocks: say it here, or they stay held until the lease ends."""
        try:
            yield
        except (ProtocolError, ValueError) as error:
            await self._release_refused(request[_LEG_KEY].remote_prefill, error)
            raise

    async def _release_refused(self, remote: RemotePrefill | None, error: Exception) -> None:
        """Free the prefill hold a refused decode leg names. Except when it is refused for now (503:
        overloaded, draining): the router retries such a refusal on another decode engine with the
        same params, which must still find the blocks held (if it gives up, the lease frees them)."""
        retryable = isinstance(error, ProtocolError) and error.status == 503
        if remote is not None and not retryable and self.client.alive:
            await self.client.release_remote_blocks(remote)
