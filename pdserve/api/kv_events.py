"""KV-cache events: what an engine publishes about its prefix cache and load, for routers.

An engine's EngineCore process publishes :class:`KVEventBatch` messages (msgpack) on a ZMQ PUB
socket (``--kv-events-port``; its port is in the engine's ``/health`` answer as
``kv_events_port``). A batch says which block hashes were stored in and removed from the prefix
cache since the previous batch, with the engine's load. Every few seconds a batch also carries a
``snapshot``: the complete set of cached hashes, which replaces whatever a subscriber knew, so a
router that starts late, restarts, or misses messages (``seq`` jumps) converges without asking.

The hashes are the block pool's own (pdserve/engine/block_hash.py), which a router recomputes
from a prompt's token ids; ``block_size`` tells it how to cut the prompt.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

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
