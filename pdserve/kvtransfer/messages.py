"""The side channel's messages (msgspec, msgpack on ZMQ): one ROUTER socket per engine, one
DEALER per remote engine it talks to. Nothing here is pickled; every frame is decoded into these
types and anything else is dropped.

    decode -> prefill: Handshake        -> HandshakeReply (engine id, compatibility hash, transport data)
    decode -> prefill: RenewLeases      (no reply: lease renewal while requests wait in decode's queue)
    decode -> prefill: ReleaseBlocks    (no reply: done with these requests' blocks, free them)
    decode -> prefill: ReadBlocks       -> BlocksReply (TCP transport: the bytes themselves)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from pdserve.api.frames import frame_decoder

# Upper bound on one side-channel frame from a peer, except block data (which has its own bound).
MAX_MESSAGE_BYTES = 1 << 20


class Handshake(msgspec.Struct, tag="handshake"):
    engine_id: str  # the asking engine, for logs


class HandshakeReply(msgspec.Struct, tag="handshake_reply"):
    engine_id: str
    compat_hash: str
    transport: str
    block_bytes: int
    num_blocks: int
    transport_info: dict[str, Any]  # e.g. NIXL agent metadata and memory addresses
    error: str | None = None


class RenewLeases(msgspec.Struct, tag="renew"):
    request_ids: list[str]


class ReleaseBlocks(msgspec.Struct, tag="release"):
    request_ids: list[str]


class ReadBlocks(msgspec.Struct, tag="read"):
    request_id: str
    block_ids: list[int]
    generations: list[int]
    release: bool  # the read is the last: free the request's blocks once sent


class BlocksReply(msgspec.Struct, tag="blocks"):
    request_id: str
    error: str | None = None  # None: the next frame holds the blocks' bytes
    checksum: int = 0  # CRC-32 of those bytes: a corrupted transfer is detected, never computed from


SideChannelMessage = Handshake | HandshakeReply | RenewLeases | ReleaseBlocks | ReadBlocks | BlocksReply

encode = msgspec.msgpack.Encoder().encode
# The message in a frame, or None for anything malformed or oversized (logged by the caller).
decode: Callable[[bytes], SideChannelMessage | None] = frame_decoder(SideChannelMessage, MAX_MESSAGE_BYTES)
