"""KV-cache events: what an engine publishes about its prefix cache and load, for routers.

An engine's EngineCore process publishes :class:`KVEventBatch` messages (msgpack) on a ZMQ PUB
socket (``--kv-events-port``; its port is in the engine's ``/health`` answer as
``kv_events_port``). A batch says which block hashes were stored in and removed from the prefix
cache since the previous batch, with the engine's load. Every few seconds a batch also carries a
``snapshot``: the complete set of cached hashes, which replaces whatever a subscriber knew, so a
router that starts late, restarts, or misses messages (``seq`` jumps) converges without asking.

The hashes are the block pool's own (pdserve/engine/block_hash.py), which a router recomputes
from a prompt's token ids; ``block_size`` tells it how to cut the prompt.

With the cluster secret (pdserve/api/auth.py) each message is three frames, the batch, the time it
was sent and an HMAC of both (:class:`EventSigner`), and a router with the secret drops any other:
a process that takes over an engine's address cannot steer the router with made-up cache contents.
Without it, a message is the batch alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec

from pdserve.api.auth import KV_EVENTS, MAX_CLOCK_SKEW_S, Signer
from pdserve.api.frames import frame_decoder

SNAPSHOT_INTERVAL_S = 5.0


class EngineLoad(msgspec.Struct):
    num_running: int
    num_waiting: int
    num_waiting_for_remote_kv: int
    kv_cache_usage: float
    num_blocks_held_for_remote: int


class KVEventBatch(msgspec.Struct, tag="kv_events"):
    engine_id: str
    seq: int  # consecutive per publisher: a gap means batches were missed (wait for the next snapshot)
    block_size: int
    stored: list[bytes]  # hashes that entered the prefix cache, in order
    removed: list[bytes]  # hashes that left it (their blocks were reused)
    load: EngineLoad
    snapshot: list[bytes] | None = None  # when set: every cached hash (applied after stored/removed)


encode_batch = msgspec.msgpack.Encoder().encode
MAX_BATCH_BYTES = 64 << 20
# The batch in a frame, or None for anything malformed or oversized.
decode_batch: Callable[[bytes], KVEventBatch | None] = frame_decoder(KVEventBatch, MAX_BATCH_BYTES)


class EventSigner:
    """Signs and checks KV-event messages with the cluster secret's ``kv-events`` key."""

    def __init__(self, secret: bytes) -> None:
        self._signer = Signer(secret, KV_EVENTS)

    def frames(self, batch: bytes) -> list[bytes]:
        sent_at = repr(time.time()).encode()
        return [batch, sent_at, self._signer.sign(batch, sent_at)]

    def batch(self, frames: list[bytes]) -> bytes | None:
        """The batch frame of a message this secret signed within the clock-skew window, else None."""
        if len(frames) != 3:
            return None
        batch, sent_at, mac = frames
        try:
            fresh = abs(time.time() - float(sent_at)) <= MAX_CLOCK_SKEW_S
        except ValueError:
            return None
        return batch if fresh and self._signer.verify(mac, batch, sent_at) else None
