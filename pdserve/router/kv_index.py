"""KVIndex: the router's picture of every pod's prefix cache and load, built from the KV-cache events the
engines publish (pdserve/api/kv_events.py), and prefix matching against it.

Per pod it keeps the set of cached block hashes, the last sequence number seen, a stale flag and the last
reported :class:`EngineLoad`. A batch's removed hashes are applied before its stored ones (see ``apply``); a
batch with a snapshot then replaces the set. A ``seq`` gap, or joining a publisher mid-stream, marks the pod
stale until its next snapshot (at most ``SNAPSHOT_INTERVAL_S``): the set is still used, since it is mostly
right, and the flag is shown in metrics and /debug/index. A new ``engine_id`` on the same pod (a restarted
engine) starts the pod's picture afresh.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec

from pdserve.api.kv_events import EngineLoad, KVEventBatch

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class PodIndex:
    engine_id: str = ""
    block_size: int = 0  # 0 until the pod's first batch: nothing can be matched before
    hashes: set[bytes] = field(default_factory=set)
    seq: int = -1  # last batch applied
    stale: bool = False  # batches were missed since the last snapshot
    load: EngineLoad | None = None
    updated: float = 0.0  # time.monotonic() of the last batch


class KVIndex:
    def __init__(self) -> None:
        self.pods: dict[str, PodIndex] = {}  # pod URL -> its picture
        self.num_batches = 0
        self.num_gaps = 0  # seq jumps, and publishers joined mid-stream

    def apply(self, url: str, batch: KVEventBatch) -> None:
        """Fold one batch from the pod at ``url`` into its picture."""
        pod = self.pods.get(url)
        if pod is None or pod.engine_id != batch.engine_id:
            pod = self.pods[url] = PodIndex(batch.engine_id)
        # Missed batches (including those before we subscribed, unless this is the publisher's first one).
        if batch.seq != pod.seq + 1:
            self.num_gaps += 1
            if not pod.stale and batch.snapshot is None:
                # Joining a running publisher is normal (router start); losing batches is worth a warning.
                logger.log(
                    logging.INFO if pod.seq < 0 else logging.WARNING,
                    "KV events from %s: batch %d after %d; its index is stale until the next snapshot",
                    url,
                    batch.seq,
                    pod.seq,
                )
            pod.stale = True
        hashes = pod.hashes
        # Removed before stored: within one engine step (one batch) evictions happen while scheduling, before
        # the step's new blocks are cached, so a hash evicted and cached again in the same step stays cached.
        hashes.difference_update(batch.removed)
        hashes.update(batch.stored)
        if batch.snapshot is not None:
            pod.hashes = set(batch.snapshot)
            pod.stale = False
        pod.seq = batch.seq
        pod.block_size = batch.block_size
        pod.load = batch.load
        pod.updated = time.monotonic()
        self.num_batches += 1

    def forget(self, url: str) -> None:
        """Drop a pod's picture (it left, or publishes elsewhere now)."""
        self.pods.pop(url, None)

    def match(self, url: str, hashes: Sequence[bytes]) -> int:
        """How many of the prompt's leading blocks (``hashes``, in order) the pod has cached: the count up to the
        first miss. ``hashes`` may compute its items on demand (prompt.BlockHashes): only those looked at are."""
        pod = self.pods.get(url)
        if pod is None:
            return 0
        cached = pod.hashes
        for index in range(len(hashes)):
            if hashes[index] not in cached:
                return index
        return len(hashes)

    def summary(self, with_hashes: bool = False) -> dict[str, dict]:
        """Per pod: what /debug/index shows."""
        now = time.monotonic()
        out: dict[str, dict] = {}
        for url, pod in self.pods.items():
            entry: dict = {
                "engine_id": pod.engine_id,
                "block_size": pod.block_size,
                "num_blocks": len(pod.hashes),
                "stale": pod.stale,
                "seq": pod.seq,
                "age_s": round(now - pod.updated, 3),
                "load": None if pod.load is None else msgspec.structs.asdict(pod.load),
            }
            if with_hashes:
                entry["block_hashes"] = sorted(block_hash.hex() for block_hash in pod.hashes)
            out[url] = entry
        return out
