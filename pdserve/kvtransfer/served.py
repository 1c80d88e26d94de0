"""ServedPrefixes: the holder's side of peer reads. It owns the finished requests' blocks this engine (rank)
serves to peers, each under the router's handle, with its time to live, and answers ``ReadPrefix`` frames.

A finished turn's blocks (its prompt and its answer) stay held for ``--kv-peer-hold-seconds``; each read served
renews that, never past ``MAX_RENEWALS`` times it from the hold's start. The scheduler may drop a hold sooner
(its requests need the room, or the held share is at its cap): it frees the blocks and tells this side
(``unhold``), and a block freed meanwhile is never served, since its generation changed.

A read is served only when every check passes, cheapest first:

- this engine serves peers at all (``--kv-peer-hold-seconds`` > 0), and the reader's KV compatibility hash is
  this engine's;
- the router's capability (``pdserve.api.auth.capability_problem``) lets the reader (``ReadPrefix.reader``) read
  this engine's hold ``handle`` now, and the frame's authenticated sender is one of that reader's ranks;
- the hold exists, the blocks asked for are inside it, and the hold's hash of the last one is the reader's
  (chained hashes: the reader's prompt and the held tokens agree up to there, tenant salt included);
- the blocks' generations did not change, checked again after the copy.

Only bytes of the blocks asked for leave, over the side channel (the checked path), never NIXL metadata: a peer
with a capability reads that hold, and nothing else of this engine. Runs in the agent's thread only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import blake3
import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from pdserve.api.auth import capability_problem
from pdserve.api.keys import KeyRing
from pdserve.kvtransfer import messages
from pdserve.kvtransfer.layout import rank_agent_id
from pdserve.kvtransfer.transport.base import Transport
from pdserve.kvtransfer.work import PeerHold

logger = logging.getLogger(__name__)

# A hold outlives at most this many times its time to live, however often it is read.
MAX_RENEWALS = 4


class Reports(Protocol):
    def finished_sending(self, request_id: str) -> None: ...
    def served_peer(self, num_bytes: int) -> None: ...


@dataclass
class _Served:
    handle: str
    block_ids: list[int]
    hashes: list[bytes]
    generations: list[int]
    deadline: float
    bound: float


class ServedPrefixes:
    def __init__(
        self,
        hold_seconds: float,
        transport: Transport,
        generations: np.ndarray,
        engine_id: str,
        compat_hash: str,
        router_keys: KeyRing[Ed25519PublicKey] | None,
        reply: Callable[[bytes, str, messages.BlocksReply, memoryview | None], None],
        reports: Reports,
        num_ranks: int = 1,
    ) -> None:
        """``router_keys``: the router's public keys (None: a deployment without keys, where only the times of a
        capability are checked); ``reply(identity, receiver, message, data)`` answers a peer."""
        self.hold_seconds = hold_seconds
        self.transport = transport
        self.generations = generations
        self.engine_id = engine_id
        self.compat_hash = compat_hash
        self.router_keys = router_keys
        self.reply = reply
        self.reports = reports
        self.num_ranks = num_ranks
        self._held: dict[str, _Served] = {}  # request id -> its hold
        self._by_handle: dict[str, str] = {}  # handle -> request id

    def __contains__(self, request_id: str) -> bool:
        """Whether the blocks of request ``request_id`` are served now."""
        return request_id in self._held

    def hold(self, hold: PeerHold, now: float) -> None:
        if self.hold_seconds <= 0 or hold.handle in self._by_handle:
            # Not serving, or a handle used twice (the router makes a new one per leg): the older stays, and
            # the scheduler frees this one when its time is up.
            self.reports.finished_sending(hold.request_id)
            return
        self._held[hold.request_id] = _Served(
            hold.handle,
            hold.block_ids,
            hold.hashes,
            hold.generations,
            now + self.hold_seconds,
            now + MAX_RENEWALS * self.hold_seconds,
        )
        self._by_handle[hold.handle] = hold.request_id

    def unhold(self, request_id: str) -> None:
        """The scheduler freed this hold's blocks itself."""
        served = self._held.pop(request_id, None)
        if served is not None:
            del self._by_handle[served.handle]

    def expire(self, now: float) -> None:
        for request_id in [rid for rid, served in self._held.items() if served.deadline <= now]:
            self.unhold(request_id)
            self.reports.finished_sending(request_id)

    def serve(self, identity: bytes, sender: str, read: messages.ReadPrefix) -> None:
        error = self._problem(sender, read)
        if error is None:
            served = self._held[self._by_handle[read.handle]]
            block_ids = served.block_ids[read.first : read.first + read.count]
            expected = served.generations[read.first : read.first + read.count]
            data = self.transport.read_local(block_ids)
            if self.generations[block_ids].tolist() != expected:
                # Checked after the copy: bytes of blocks freed meanwhile are never sent.
                error = "the held blocks were freed"
        if error is not None:
            logger.info("peer read by %s refused: %s", sender[:16], error)
            self.reply(identity, sender, messages.BlocksReply(read.request_id, error), None)
            return
        served.deadline = min(time.monotonic() + self.hold_seconds, served.bound)  # a read renews the hold
        digest = blake3.blake3(data.data).digest()
        self.reply(identity, sender, messages.BlocksReply(read.request_id, digest=digest), data.data)
        self.reports.served_peer(data.nbytes)

    def _problem(self, sender: str, read: messages.ReadPrefix) -> str | None:
        """Why ``read`` from ``sender`` is not served (None: it is)."""
        if self.hold_seconds <= 0:
            return "this engine serves no peer reads"
        if read.compat_hash != self.compat_hash:
            return "incompatible KV cache (model, dtype, block size or layout differ)"
        if sender not in {rank_agent_id(read.reader, rank) for rank in range(self.num_ranks)}:
            return "the capability is for another engine"
        problem = capability_problem(
            self.router_keys, read.capability, read.reader, self.engine_id, read.handle, read.expires_at
        )
        if problem is not None:
            return f"capability refused: {problem}"
        request_id = self._by_handle.get(read.handle)
        if request_id is None:
            return "nothing is held under this handle (expired, dropped, or never held)"
        served = self._held[request_id]
        if read.count <= 0 or read.first < 0 or read.first + read.count > len(served.block_ids):
            return "the hold does not have these blocks"
        if served.hashes[read.first + read.count - 1] != read.last_hash:
            return "the held tokens differ from the reader's prompt"
        return None
