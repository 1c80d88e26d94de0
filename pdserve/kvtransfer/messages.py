"""The side channel's messages (msgspec, msgpack on ZMQ): one ROUTER socket per engine, one
DEALER per remote engine it talks to. Nothing here is pickled; every frame is decoded into these
types and anything else is dropped.

Every message travels sealed in an :class:`Envelope` (:class:`Seal`): it names the sender's
incarnation (engine id and start time, so a restarted engine is told apart from its old self) and,
when the deployment has a secret (pdserve/api/auth.py), carries an HMAC over all of it with a time
and a nonce, so a stranger can neither speak nor replay. The block bytes a ``BlocksReply`` announces
follow in a frame of their own: the sealed reply carries their CRC-32.

    decode -> prefill: Handshake        -> HandshakeReply (engine id, compatibility hash, transport data)
    decode -> prefill: RenewLeases      (no reply: lease renewal while requests wait in decode's queue)
    decode -> prefill: ReleaseBlocks    (no reply: done with these requests' blocks, free them)
    decode -> prefill: ReadBlocks       -> BlocksReply (TCP transport: the bytes themselves)

An engine at tensor-parallel size n has one side channel per rank (``layout``): a decode rank
hand-shakes with, reads from and releases each prefill rank on its own channel.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from pdserve.api.auth import NONCE_BYTES, SIDE_CHANNEL, ReplayGuard, Signer
from pdserve.api.frames import frame_decoder

# Upper bound on one side-channel frame from a peer, except block data (which has its own bound).
MAX_MESSAGE_BYTES = 1 << 20


class Handshake(msgspec.Struct, tag="handshake"):
    engine_id: str  # the asking engine's agent, for logs


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


class RenewLeases(msgspec.Struct, tag="renew"):
    request_ids: list[str]


class ReleaseBlocks(msgspec.Struct, tag="release"):
    request_ids: list[str]
    # Which of how many decode ranks is done with them: a hold ends once every rank of the decode
    # engine released it (one rank may still be reading while another is done).
    reader_rank: int = 0
    readers: int = 1


class ReadBlocks(msgspec.Struct, tag="read"):
    request_id: str
    block_ids: list[int]
    generations: list[int]
    release: bool  # the read is this decode rank's last: count its release once sent
    heads: tuple[int, int] | None = None  # the KV heads [start, end) to read (None: every head held)
    reader_rank: int = 0
    readers: int = 1


class BlocksReply(msgspec.Struct, tag="blocks"):
    request_id: str
    error: str | None = None  # None: the next frame holds the blocks' bytes
    checksum: int = 0  # CRC-32 of those bytes: a corrupted transfer is detected, never computed from


SideChannelMessage = Handshake | HandshakeReply | RenewLeases | ReleaseBlocks | ReadBlocks | BlocksReply

encode = msgspec.msgpack.Encoder().encode
# The message in a frame, or None for anything malformed or oversized (logged by the caller).
decode: Callable[[bytes], SideChannelMessage | None] = frame_decoder(SideChannelMessage, MAX_MESSAGE_BYTES)


class Envelope(msgspec.Struct, array_like=True):
    sender: str  # the sending engine's id
    incarnation: int  # its start time (ns since the epoch): a restart makes a larger one
    sent_at: float  # wall clock, seconds
    nonce: bytes
    body: bytes  # one encoded SideChannelMessage
    mac: bytes  # HMAC of everything above (empty without a secret)


_envelope_encode = msgspec.msgpack.Encoder().encode
_open_envelope: Callable[[bytes], Envelope | None] = frame_decoder(Envelope, MAX_MESSAGE_BYTES + 1024)
# Senders whose newest incarnation is remembered (least recently heard from forgotten first).
MAX_REMEMBERED_SENDERS = 4096
# Why a frame was refused (the reasons pdserve_kv_side_channel_rejected_total counts).
REJECT_MALFORMED = "malformed"
REJECT_UNAUTHENTICATED = "unauthenticated"
REJECT_REPLAYED = "replayed"
REJECT_OLD_INCARNATION = "old_incarnation"


@dataclass(frozen=True)
class Opened:
    """A frame that passed every check: who sent it, and what."""

    sender: str
    incarnation: int
    message: SideChannelMessage


class Seal:
    """One engine's envelopes: seals what it sends, opens (and checks) what it receives.

    Checks, in order: the frame decodes; with a secret, its MAC is right and its time and nonce are
    fresh; it is not from an older incarnation of an engine already heard from (a stopped engine's
    late messages, after its restart answered). Used by the agent thread only."""

    def __init__(self, engine_id: str, incarnation: int, secret: bytes | None) -> None:
        self.engine_id = engine_id
        self.incarnation = incarnation
        self._signer = Signer(secret, SIDE_CHANNEL) if secret is not None else None
        self._replays = ReplayGuard()
        self._incarnations: OrderedDict[str, int] = OrderedDict()

    @property
    def authenticated(self) -> bool:
        return self._signer is not None

    def seal(self, message: SideChannelMessage) -> bytes:
        body = encode(message)
        if self._signer is None:
            return _envelope_encode(Envelope(self.engine_id, self.incarnation, time.time(), b"", body, b""))
        sent_at, nonce = time.time(), secrets.token_bytes(NONCE_BYTES)
        mac = self._signer.sign(*_signed_parts(self.engine_id, self.incarnation, sent_at, nonce, body))
        return _envelope_encode(Envelope(self.engine_id, self.incarnation, sent_at, nonce, body, mac))

    def open(self, frame: bytes) -> Opened | str:
        """The checked message, or the reason it is refused (one of the ``REJECT_`` names)."""
        envelope = _open_envelope(frame)
        if envelope is None:
            return REJECT_MALFORMED
        if self._signer is not None:
            signed = (envelope.sender, envelope.incarnation, envelope.sent_at, envelope.nonce, envelope.body)
            if not self._signer.verify(envelope.mac, *_signed_parts(*signed)):
                return REJECT_UNAUTHENTICATED
            if self._replays.problem(envelope.sent_at, envelope.nonce) is not None:
                return REJECT_REPLAYED
        newest = self._incarnations.get(envelope.sender)
        if newest is not None and envelope.incarnation < newest:
            return REJECT_OLD_INCARNATION
        message = decode(envelope.body)
        if message is None:
            return REJECT_MALFORMED
        self._incarnations[envelope.sender] = envelope.incarnation
        self._incarnations.move_to_end(envelope.sender)
        if len(self._incarnations) > MAX_REMEMBERED_SENDERS:
            self._incarnations.popitem(last=False)
        return Opened(envelope.sender, envelope.incarnation, message)


def _signed_parts(sender: str, incarnation: int, sent_at: float, nonce: bytes, body: bytes) -> tuple[bytes, ...]:
    return sender.encode(), incarnation.to_bytes(8, "big", signed=True), repr(sent_at).encode(), nonce, body
