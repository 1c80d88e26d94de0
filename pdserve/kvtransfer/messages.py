"""The side channel's messages (msgspec, msgpack on ZMQ): one ROUTER socket per engine, one
DEALER per remote engine it talks to. Nothing here is pickled; every frame is decoded into these
types and anything else is dropped.

Every message travels sealed in an :class:`Envelope` (:class:`Seal`) that names its sender and its
**receiver** (a transfer agent's id: the engine's id, new at every start, and the rank), and, when the
deployment has keys (pdserve/api/keys.py, ``engine.key``), carries an HMAC over all of it with a time and a
nonce. A receiver drops what is not addressed to it, so a sealed message captured on one link is useless
against any other engine, or a restart of the same one; the time and nonce make it useless against its own
receiver too. Checks run cheapest first (length, address, time) so junk costs no HMAC.

A handshake is a challenge: the asking engine sends a fresh nonce and accepts only the reply that echoes it,
so an old reply (with the memory whereabouts of an engine long gone) is never taken for a new one.

Holds are named by request id *and* the hold's token, which only the params of that hold carry: an engine
with the key reads, renews and releases only holds it was told about.

    decode -> prefill: Handshake        -> HandshakeReply (engine id, compatibility hash, transport data)
    decode -> prefill: RenewLeases      (no reply: lease renewal while requests wait in decode's queue)
    decode -> prefill: ReleaseBlocks    (no reply: done with these requests' blocks, free them)
    decode -> prefill: ReadBlocks       -> BlocksReply (TCP transport: the bytes themselves)
    any -> holder:     ReadPrefix       -> BlocksReply (peer reads of a finished turn's blocks: the bytes)

A ``ReadPrefix`` carries the router's capability for it (``pdserve.api.auth.capability_problem``): the holder
serves it only to the engine the capability names, only the blocks of the hold it names, and only over this
checked path, never by handing out where its memory is.

The block bytes a ``BlocksReply`` announces follow in a frame of their own: the sealed reply carries their
BLAKE3 digest, so with keys the bytes are as authentic as the reply.

An engine at tensor-parallel size n has one side channel per rank (``layout``): a decode rank
hand-shakes with, reads from and releases each prefill rank on its own channel.
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from pdserve.api.auth import NONCE_BYTES, SIDE_CHANNEL, ReplayGuard, Signer
from pdserve.api.frames import frame_decoder
from pdserve.api.keys import KeyRing

# Upper bound on one side-channel frame from a peer, except block data (which has its own bound).
MAX_MESSAGE_BYTES = 1 << 20
CHALLENGE_BYTES = 16


class Handshake(msgspec.Struct, tag="handshake"):
    engine_id: str  # the asking engine's agent, for logs
    challenge: bytes = b""  # echoed by the reply: a reply that does not is not an answer to this handshake


class HandshakeReply(msgspec.Struct, tag="handshake_reply"):
    engine_id: str  # the answering rank's agent (``layout.rank_agent_id``)
    compat_hash: str
    transport: str
    block_bytes: int
    num_blocks: int
    transport_info: dict[str, Any]  # e.g. NIXL agent metadata and memory addresses
    error: str | None = None
    # The engine's tensor-parallel layout: per rank, the [start, end) of the model's KV heads its cache
    # holds, and which rank answers. Not in the compatibility hash: engines of one model at different TP
    # sizes pair when every head the decode needs is somewhere on the prefill (``layout``).
    kv_head_ranges: list[tuple[int, int]] = msgspec.field(default_factory=list)
    rank: int = 0
    answer: bytes = b""  # the handshake's challenge
    kv_dtype: str = ""  # what its KV cache stores ("bfloat16"): named when the compatibility hashes differ by it


class RenewLeases(msgspec.Struct, tag="renew"):
    holds: list[tuple[str, str]]  # (request id, hold token)


class ReleaseBlocks(msgspec.Struct, tag="release"):
    holds: list[tuple[str, str]]  # (request id, hold token)
    # Which of how many decode ranks is done with them: a hold ends once every rank of the decode
    # engine released it (one rank may still be reading while another is done).
    reader_rank: int = 0
    readers: int = 1


class ReadBlocks(msgspec.Struct, tag="read"):
    request_id: str
    token: str  # the hold's token
    block_ids: list[int]
    generations: list[int]
    release: bool  # the read is this decode rank's last: count its release once sent
    heads: tuple[int, int] | None = None  # the KV heads [start, end) to read (None: every head held)
    reader_rank: int = 0
    readers: int = 1


class ReadPrefix(msgspec.Struct, tag="read_prefix"):
    request_id: str  # the reader's request (echoed in the reply)
    handle: str  # the hold's
    reader: str  # the engine the capability is for (the sender's engine)
    expires_at: float
    capability: str  # the router's signature (``pdserve.api.auth``)
    compat_hash: str  # the reader's: blocks of another model or layout are never sent
    first: int  # the blocks [first, first + count) of the hold
    count: int
    # The chained hash of the last block asked for: it commits to every token before it (with the tenant's
    # salt), so the hold's block at that index having it proves the reader's prompt and the hold agree so far.
    last_hash: bytes


class BlocksReply(msgspec.Struct, tag="blocks"):
    request_id: str
    error: str | None = None  # None: the next frame holds the blocks' bytes
    digest: bytes = b""  # BLAKE3 of those bytes: a corrupted (or, with keys, altered) transfer is never used


SideChannelMessage = Handshake | HandshakeReply | RenewLeases | ReleaseBlocks | ReadBlocks | ReadPrefix | BlocksReply

encode = msgspec.msgpack.Encoder().encode
# The message in a frame, or None for anything malformed or oversized (logged by the caller).
decode: Callable[[bytes], SideChannelMessage | None] = frame_decoder(SideChannelMessage, MAX_MESSAGE_BYTES)


class Envelope(msgspec.Struct, array_like=True):
    sender: str  # the sending agent's id
    receiver: str  # the agent it is for: any other drops it
    sent_at: float  # wall clock, seconds
    nonce: bytes
    body: bytes  # one encoded SideChannelMessage
    mac: bytes  # HMAC of everything above (empty without keys)


_envelope_encode = msgspec.msgpack.Encoder().encode
# Why a frame was refused (the reasons pdserve_kv_side_channel_rejected_total counts).
REJECT_MALFORMED = "malformed"
REJECT_OVERSIZED = "oversized"
REJECT_MISADDRESSED = "misaddressed"
REJECT_STALE = "stale"
REJECT_UNAUTHENTICATED = "unauthenticated"
REJECT_REPLAYED = "replayed"
REJECT_UNEXPECTED = "unexpected"  # authentic, but not from the engine this connection talks to, or not asked for


@dataclass(frozen=True)
class Opened:
    """A frame that passed every check: who sent it, and what."""

    sender: str
    message: SideChannelMessage


def new_challenge() -> bytes:
    return secrets.token_bytes(CHALLENGE_BYTES)


def answers(reply: HandshakeReply, challenge: bytes) -> bool:
    return bool(challenge) and hmac.compare_digest(reply.answer, challenge)


class Seal:
    """One agent's envelopes: seals what it sends (to one receiver), opens and checks what it receives.

    Checks, cheapest first: the frame is at most ``max_frame_bytes``; it decodes; it is addressed to this
    agent; with keys, its time is inside the window, its MAC is right and its nonce is new. Used by the agent
    thread only."""

    def __init__(self, agent_id: str, keys: KeyRing[bytes] | None, max_frame_bytes: int = MAX_MESSAGE_BYTES) -> None:
        self.agent_id = agent_id
        self.max_frame_bytes = max_frame_bytes
        self._signer = Signer(keys, SIDE_CHANNEL) if keys is not None else None
        self._replays = ReplayGuard()
        self._open_envelope: Callable[[bytes], Envelope | None] = frame_decoder(Envelope, max_frame_bytes)

    @property
    def authenticated(self) -> bool:
        return self._signer is not None

    def seal(self, message: SideChannelMessage, receiver: str) -> bytes:
        body = encode(message)
        if self._signer is None:
            return _envelope_encode(Envelope(self.agent_id, receiver, time.time(), b"", body, b""))
        sent_at, nonce = time.time(), secrets.token_bytes(NONCE_BYTES)
        mac = self._signer.sign(*_signed_parts(self.agent_id, receiver, sent_at, nonce, body))
        return _envelope_encode(Envelope(self.agent_id, receiver, sent_at, nonce, body, mac))

    def open(self, frame: bytes) -> Opened | str:
        """The checked message, or the reason it is refused (one of the ``REJECT_`` names)."""
        if len(frame) > self.max_frame_bytes:
            return REJECT_OVERSIZED
        envelope = self._open_envelope(frame)
        if envelope is None:
            return REJECT_MALFORMED
        if envelope.receiver != self.agent_id:
            return REJECT_MISADDRESSED
        if self._signer is not None:
            if self._replays.stale(envelope.sent_at):
                return REJECT_STALE
            signed = _signed_parts(envelope.sender, envelope.receiver, envelope.sent_at, envelope.nonce, envelope.body)
            if not self._signer.verify(envelope.mac, *signed):
                return REJECT_UNAUTHENTICATED
            if self._replays.problem(envelope.sent_at, envelope.nonce) is not None:
                return REJECT_REPLAYED
        message = decode(envelope.body)
        if message is None:
            return REJECT_MALFORMED
        return Opened(envelope.sender, message)


def _signed_parts(sender: str, receiver: str, sent_at: float, nonce: bytes, body: bytes) -> tuple[bytes, ...]:
    return sender.encode(), receiver.encode(), repr(sent_at).encode(), nonce, body
