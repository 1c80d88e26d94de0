"""KV-cache events: what an engine publishes about its prefix cache and load, for routers.

An engine's EngineCore process publishes :class:`KVEventBatch` messages (msgpack) on a ZMQ PUB
socket (``--kv-events-port``; its port is in the engine's ``/health`` answer as
``kv_events_port``). A batch says which block hashes were stored in and removed from the prefix
cache since the previous batch, with the engine's load. Every few seconds a batch also carries a
``snapshot``: the complete set of cached hashes, which replaces whatever a subscriber knew, so a
router that starts late, restarts, or misses messages (``seq`` jumps) converges without asking.

The hashes are the block pool's own (pdserve/engine/block_hash.py), which a router recomputes
from a prompt's token ids; ``block_size`` tells it how to cut the prompt.

With the deployment's keys (pdserve/api/keys.py, ``events.key``) each message is three frames, the batch,
the time it was sent and an HMAC of both (:class:`EventSigner`), and a router with the keys drops any other.
The batch names its engine and its sequence number, so what the MAC covers says whose stream it is and
where in it: a router takes a batch only from the pod whose ``/health`` gave that engine id, and only with a
sequence number above the last it took from that engine (pdserve/router/subscriber.py). So a stream relayed
from another pod's address, or an old batch sent again, is refused, and a process that takes over an engine's
address cannot steer the router with made-up cache contents. Without keys, a message is the batch alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec

from pdserve.api.auth import KV_EVENTS, MAX_CLOCK_SKEW_S, Signer
from pdserve.api.frames import frame_decoder
from pdserve.api.keys import KeyRing

SNAPSHOT_INTERVAL_S = 5.0


class EngineLoad(msgspec.Struct):
    num_running: int
    num_waiting: int
    num_waiting_for_remote_kv: int
    kv_cache_usage: float
    num_blocks_held_for_remote: int


# Where a block is held, from fastest to slowest to reach (vLLM's events name the medium too): the engine's own
# pool ("engine", the batch's ``stored``/``removed``), then its tiers (``KVEventBatch.tiers``).
MEDIA = ("engine", "host", "disk", "shared")


class TierEvents(msgspec.Struct):
    """What entered and left one of the engine's KV tiers since the previous batch."""

    medium: str  # one of MEDIA, not "engine"
    stored: list[bytes]
    removed: list[bytes]  # evicted, aged out, deleted, or found corrupt
    snapshot: list[bytes] | None = None  # when set: every hash the tier holds (applied after stored/removed)


class KVEventBatch(msgspec.Struct, tag="kv_events"):
    engine_id: str
    seq: int  # consecutive per publisher: a gap means batches were missed (wait for the next snapshot)
    block_size: int
    stored: list[bytes]  # hashes that entered the prefix cache, in order
    removed: list[bytes]  # hashes that left it (their blocks were reused)
    load: EngineLoad
    snapshot: list[bytes] | None = None  # when set: every cached hash (applied after stored/removed)
    # The tiers below the pool (one entry per tier the engine keeps; none without tiers). A tier's snapshot
    # comes with the pool's.
    tiers: list[TierEvents] = []


encode_batch = msgspec.msgpack.Encoder().encode
MAX_BATCH_BYTES = 64 << 20
# The batch in a frame, or None for anything malformed or oversized.
decode_batch: Callable[[bytes], KVEventBatch | None] = frame_decoder(KVEventBatch, MAX_BATCH_BYTES)


class EventSigner:
    """Signs and checks KV-event messages with ``events.key``."""

    def __init__(self, keys: KeyRing[bytes]) -> None:
        self._signer = Signer(keys, KV_EVENTS)

    def frames(self, batch: bytes) -> list[bytes]:
        sent_at = repr(time.time()).encode()
        return [batch, sent_at, self._signer.sign(batch, sent_at)]

    def batch(self, frames: list[bytes]) -> bytes | None:
        """The batch frame of a message signed with the key within the clock-skew window, else None."""
        if len(frames) != 3:
            return None
        batch, sent_at, mac = frames
        try:
            fresh = abs(time.time() - float(sent_at)) <= MAX_CLOCK_SKEW_S
        except ValueError:
            return None
        return batch if fresh and self._signer.verify(mac, batch, sent_at) else None
