"""KVIndex: the router's picture of every pod's prefix cache, its KV tiers and its load, built from the
KV-cache events the engines publish (pdserve/api/kv_events.py), and prefix matching against it.

Per pod it keeps the set of block hashes in the engine's pool, one set per KV tier the engine reports (host
memory, local disk, shared file system: the media of ``MEDIA`` after "engine"), the last sequence number seen, a
stale flag and the last reported :class:`EngineLoad`. Each medium's removed hashes are applied before its
stored ones (see ``apply``); a snapshot then replaces that medium's set. A snapshot batch names every tier the
engine keeps, so a tier it leaves out is dropped. A ``seq`` gap, or joining a publisher mid-stream, marks the
pod stale until its next snapshot (at most ``SNAPSHOT_INTERVAL_S``): the sets are still used, since they are
mostly right, and the flag is shown in metrics and /debug/index. A new ``engine_id`` on the same pod (a
restarted engine) starts the pod's picture afresh.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import msgspec

from pdserve.api.kv_events import MEDIA, EngineLoad, KVEventBatch

logger = logging.getLogger(__name__)

TIER_MEDIA = MEDIA[1:]  # the media below the engine's pool, fastest first


@dataclass(eq=False)
class PodIndex:
    engine_id: str = ""
    block_size: int = 0  # 0 until the pod's first batch: nothing can be matched before
    hashes: set[bytes] = field(default_factory=set)  # in the engine's pool (medium "engine")
    tiers: dict[str, set[bytes]] = field(default_factory=dict)  # tier medium -> hashes it holds
    seq: int = -1  # last batch applied
    stale: bool = False  # batches were missed since the last snapshot
    load: EngineLoad | None = None
    updated: float = 0.0  # time.monotonic() of the last batch

    def held(self) -> dict[str, set[bytes]]:
        """Each medium the pod reports (the pool always) -> the hashes it holds, fastest medium first."""
        return {"engine": self.hashes, **{medium: self.tiers[medium] for medium in TIER_MEDIA if medium in self.tiers}}


@dataclass(frozen=True)
class Match:
    """A pod's match of a prompt: its leading blocks held in any medium, and their worth."""

    blocks: int = 0
    score: float = 0.0  # the sum, over those blocks, of the weight of the fastest medium holding each


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
        _fold(pod.hashes, batch.removed, batch.stored)
        if batch.snapshot is not None:
            pod.hashes = set(batch.snapshot)
            pod.stale = False
            # A snapshot batch lists every tier the engine keeps: one it no longer lists is gone (failed, removed).
            listed = {tier.medium for tier in batch.tiers}
            pod.tiers = {medium: held for medium, held in pod.tiers.items() if medium in listed}
        for tier in batch.tiers:
            # A medium this router does not know (a newer engine's) has no weight to be scored with: left out.
            if tier.medium not in TIER_MEDIA:
                continue
            held = pod.tiers.setdefault(tier.medium, set())
            _fold(held, tier.removed, tier.stored)
            if tier.snapshot is not None:
                pod.tiers[tier.medium] = set(tier.snapshot)
        pod.seq = batch.seq
        pod.block_size = batch.block_size
        pod.load = batch.load
        pod.updated = time.monotonic()
        self.num_batches += 1

    def forget(self, url: str) -> None:
        """Drop a pod's picture (it left, or publishes elsewhere now)."""
        self.pods.pop(url, None)

    def match(self, url: str, hashes: Sequence[bytes], weights: Mapping[str, float]) -> Match:
        """How many of the prompt's leading blocks (``hashes``, in order) the pod holds in any medium, up to the
        first block none holds, and their score: each block weighs what ``weights`` gives the fastest medium
        holding it. ``hashes`` may compute its items on demand (prompt.BlockHashes): only those looked at are."""
        pod = self.pods.get(url)
        if pod is None:
            return Match()
        media = [(held, weights[medium]) for medium, held in pod.held().items()]
        score = 0.0
        for index in range(len(hashes)):
            block = hashes[index]
            for held, weight in media:
                if block in held:
                    score += weight
                    break
            else:
                return Match(index, score)
        return Match(len(hashes), score)

    def summary(self, with_hashes: bool = False) -> dict[str, dict]:
        """Per pod: what /debug/index shows."""
        now = time.monotonic()
        out: dict[str, dict] = {}
        for url, pod in self.pods.items():
            entry: dict = {
                "engine_id": pod.engine_id,
                "block_size": pod.block_size,
                "num_blocks": len(pod.hashes),
                "media": {medium: len(held) for medium, held in pod.held().items()},
                "stale": pod.stale,
                "seq": pod.seq,
                "age_s": round(now - pod.updated, 3),
                "load": None if pod.load is None else msgspec.structs.asdict(pod.load),
            }
            if with_hashes:
                entry["block_hashes"] = _hex(pod.hashes)
                entry["tier_block_hashes"] = {
                    medium: _hex(pod.tiers[medium]) for medium in TIER_MEDIA if medium in pod.tiers
                }
            out[url] = entry
        return out


def _fold(held: set[bytes], removed: Iterable[bytes], stored: Iterable[bytes]) -> None:
    """One medium's changes, removed before stored: within one engine step (one batch) the pool's evictions happen
    while scheduling, before the step's new blocks are cached, so a hash evicted and cached again in the same step
    stays cached. A tier's lists are read in the same order."""
    held.difference_update(removed)
    held.update(stored)


def _hex(hashes: Iterable[bytes]) -> list[str]:
    return sorted(block_hash.hex() for block_hash in hashes)
