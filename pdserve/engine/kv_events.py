"""KVEventPublisher: the EngineCore process's side of the KV-event stream (pdserve/api/kv_events.py).

It binds a ZMQ PUB socket, asks the core to record prefix-cache changes, and after each loop iteration
publishes what changed (stored / removed hashes) with the engine's load: whenever either changed (a
request arriving or leaving changes the queues: routers that admit by these signals must hear it at once,
not at the next idle beat, or they admit a burst's worth a second), at least once a second while idle,
and with a full snapshot every few seconds.
PUB never blocks: a slow or absent subscriber loses messages, never slows the engine.
"""

from __future__ import annotations

import time

import zmq

from pdserve.api.keys import KeyRing
from pdserve.api.kv_events import SNAPSHOT_INTERVAL_S, EventSigner, KVEventBatch, encode_batch
from pdserve.engine.engine_core import EngineCore

IDLE_PUBLISH_INTERVAL_S = 1.0


class KVEventPublisher:
    def __init__(
        self,
        context: zmq.Context[zmq.Socket[bytes]],
        core: EngineCore,
        engine_id: str,
        host: str,
        port: int,
        keys: KeyRing[bytes] | None = None,
    ) -> None:
        self.core = core
        self.signer = EventSigner(keys) if keys is not None else None
        core.record_cache_events()
        self.engine_id = engine_id
        self.socket = context.socket(zmq.PUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, 1000)
        if port:
            self.socket.bind(f"tcp://{host}:{port}")
            self.port = port
        else:
            self.port = self.socket.bind_to_random_port(f"tcp://{host}")
        self._seq = 0
        self._last_publish = 0.0
        self._last_snapshot = 0.0
        self._last_queues: tuple[int, ...] = ()

    def publish(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        stored, removed = self.core.take_cache_events()
        snapshot_due = now - self._last_snapshot >= SNAPSHOT_INTERVAL_S
        tiers = self.core.take_tier_events(snapshot_due)
        tiers_changed = any(tier.stored or tier.removed for tier in tiers)
        # Not make_stats: that hands the metrics' samples (pull and grammar timings) over to its caller.
        load = self.core.scheduler.load()
        # The counts, not the KV usage, which moves a little with every decode step.
        queues = (load.num_running, load.num_waiting, load.num_waiting_for_remote_kv, load.num_blocks_held_for_remote)
        if not (
            stored
            or removed
            or tiers_changed
            or snapshot_due
            or queues != self._last_queues
            or now - self._last_publish >= IDLE_PUBLISH_INTERVAL_S
        ):
            return
        batch = KVEventBatch(
            self.engine_id,
            self._seq,
            self.core.config.block_size,
            stored,
            removed,
            load,
            self.core.cached_block_hashes() if snapshot_due else None,
            tiers,
        )
        frame = encode_batch(batch)
        # PUB drops, never blocks, at a full subscriber: it resyncs.
        self.socket.send_multipart(self.signer.frames(frame) if self.signer is not None else [frame])
        self._seq += 1
        self._last_publish = now
        self._last_queues = queues
        if snapshot_due:
            self._last_snapshot = now

    def close(self) -> None:
        self.socket.close(linger=0)
