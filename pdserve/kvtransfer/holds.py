"""HeldBlocks: the prefill side of a transfer agent. It owns the blocks this engine holds for remote
decodes, with their leases, and answers the side channel's ROUTER socket, where decode engines
hand-shake, renew leases, release blocks and (TCP transport) read them.

A hold is named by its request id and a random token that only the hold's params carry (the router
hands them to the decode engine it picked): a message naming a hold with another token is ignored, so an
engine that has the side-channel key still reads, renews or releases only the holds it was told about.

A hold ends when a decode releases it (a message, a NIXL notification, or a TCP read that asked to),
or when its lease expires; either is reported as finished sending, and the scheduler frees the
blocks, which bumps their generations, so a later read is detected. A decode engine at TP m releases
from each of its m ranks (each names itself: rank r of m), and the hold ends once all m have: one
decode rank may still read while another is done. A hold outlives at most ``MAX_RENEWED_LEASES``
leases however often it is renewed. Runs in the agent's thread only.

Serving is bounded: one call of :meth:`HeldBlocks.serve` handles at most ``SERVE_FRAMES_PER_STEP`` frames and
``SERVE_BUDGET_S`` seconds, so a flood of frames (from a stranger, say) delays the agent's other work (pulls,
deadlines, leases) by at most that much a step, never stalls it.

The same side channel serves peer reads of finished turns' blocks (``ReadPrefix``): those holds and their checks
are :class:`served.ServedPrefixes`, which this class owns and hands those frames to.

Under tensor parallelism each rank of a prefill engine has its own HeldBlocks over its own cache,
all holding the same block ids: the engine frees a request's blocks once every rank's hold ended.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

import blake3
import numpy as np
import zmq
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from pdserve.api.keys import KeyRing
from pdserve.kvtransfer import messages
from pdserve.kvtransfer.config import KVTransferConfig
from pdserve.kvtransfer.served import ServedPrefixes
from pdserve.kvtransfer.transport.base import Transport
from pdserve.models.dtype import dtype_name

logger = logging.getLogger(__name__)

EARLY_READ_GRACE_S = 1.0
MAX_EARLY_READS = 1024
MAX_REMEMBERED_RELEASES = 4096
# A hold outlives at most this many leases however often it is renewed: a decode queue that never
# drains (or a peer renewing forever) cannot pin prefill memory without bound.
MAX_RENEWED_LEASES = 10
# What one call of serve() handles at most before the agent's other work runs again.
SERVE_FRAMES_PER_STEP = 64
SERVE_BUDGET_S = 0.005


class Reports(Protocol):
    """Where the prefill side reports what the engine must learn (the agent's results)."""

    def finished_sending(self, request_id: str) -> None: ...
    def expired(self, count: int) -> None: ...
    def rejected(self, reason: str, source: str) -> None: ...
    def served_peer(self, num_bytes: int) -> None: ...


@dataclass
class _Hold:
    block_ids: list[int]
    token: str  # in the hold's params only: a message naming another is not about this hold
    deadline: float  # of the lease
    bound: float  # the latest any renewal may push the deadline to


@dataclass
class _Releases:
    """The decode ranks that released one hold so far, of how many."""

    ranks: set[int] = field(default_factory=set)
    readers: int = 1
    ended: bool = False  # the hold ended (every reader released it, or its lease ran out)

    def add(self, rank: int, readers: int) -> None:
        self.ranks.add(rank)
        self.readers = max(self.readers, readers)

    @property
    def complete(self) -> bool:
        return self.ended or len(self.ranks) >= self.readers


class HeldBlocks:
    def __init__(
        self,
        config: KVTransferConfig,
        transport: Transport,
        generations: np.ndarray,
        seal: messages.Seal,
        server: zmq.Socket[bytes],
        compat_hash: str,
        kv_head_ranges: list[tuple[int, int]],
        reports: Reports,
        rank: int = 0,
        router_keys: KeyRing[Ed25519PublicKey] | None = None,
    ) -> None:
        """``router_keys``: the router's public keys, which check peer reads' capabilities (None: no keys)."""
        self.config = config
        self.faults = config.faults
        self.transport = transport
        self.generations = generations
        self.seal = seal
        self.server = server
        self.compat_hash = compat_hash
        self.kv_head_ranges = kv_head_ranges
        self.reports = reports
        self.rank = rank
        self._held: dict[str, _Hold] = {}
        # TCP reads that came before their hold: (give up at, peer identity, sender, message).
        self._early_reads: list[tuple[float, bytes, str, messages.ReadBlocks]] = []
        # Recent releases by (request id, token) (bounded, oldest dropped): a read of a fully released hold is
        # late, not early; and releases that came before their hold (decode gave up at once) count when it comes.
        self._released: OrderedDict[tuple[str, str], _Releases] = OrderedDict()
        self.served = ServedPrefixes(
            config.peer_hold_seconds,
            transport,
            generations,
            config.engine_id,
            compat_hash,
            router_keys,
            self._reply_blocks,
            reports,
            len(kv_head_ranges) or 1,
        )

    @property
    def busy(self) -> bool:
        """Leases or early reads to watch (the agent then polls often)."""
        return bool(self._held or self._early_reads)

    def hold(self, request_id: str, block_ids: list[int], token: str, now: float) -> None:
        lease = self.config.lease_seconds
        self._held[request_id] = _Hold(block_ids, token, now + lease, now + MAX_RENEWED_LEASES * lease)
        released = self._released.get((request_id, token))
        if released is not None and released.complete:
            self._end(request_id)

    def unhold(self, request_id: str) -> None:
        """The scheduler freed these blocks itself (nobody can read them any more)."""
        self._held.pop(request_id, None)

    def release(self, request_id: str, token: str, reader_rank: int = 0, readers: int = 1) -> None:
        """Decode rank ``reader_rank`` of ``readers`` is done with the blocks of the hold ``(request_id,
        token)``: the hold ends once every one of them is. A release naming another token is ignored."""
        released = self._releases(request_id, token)
        released.add(reader_rank, readers)
        hold = self._held.get(request_id)
        if released.complete and hold is not None and hold.token == token:
            self._end(request_id)

    def _releases(self, request_id: str, token: str) -> _Releases:
        """A hold's releases so far (remembered for the newest ``MAX_REMEMBERED_RELEASES`` holds: a release may
        come before its hold)."""
        key = (request_id, token)
        released = self._released.get(key)
        if released is None:
            released = self._released[key] = _Releases()
            if len(self._released) > MAX_REMEMBERED_RELEASES:
                self._released.popitem(last=False)
        return released

    def _end(self, request_id: str) -> None:
        """The hold is over (released by every reader, or its lease ran out): no read is served any more."""
        hold = self._held.pop(request_id, None)
        if hold is not None:
            self._releases(request_id, hold.token).ended = True
            self.reports.finished_sending(request_id)

    def expire(self, now: float) -> None:
        expired = [request_id for request_id, hold in self._held.items() if hold.deadline <= now]
        for request_id in expired:
            logger.warning("request %s: KV lease expired before a decode engine took the blocks", request_id)
            self._end(request_id)
        if expired:
            self.reports.expired(len(expired))

    def serve(self) -> bool:
        """Answer the frames waiting on the side channel, at most ``SERVE_FRAMES_PER_STEP`` of them and for
        at most ``SERVE_BUDGET_S``; True if more may be waiting."""
        end = time.monotonic() + SERVE_BUDGET_S
        for _ in range(SERVE_FRAMES_PER_STEP):
            try:
                frames = self.server.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return False
            self._serve_frames(frames)
            if time.monotonic() >= end:
                break
        return True

    def _serve_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            self.reports.rejected(messages.REJECT_MALFORMED, "a peer")
            return
        identity, frame = frames
        opened = self.seal.open(frame)
        if isinstance(opened, str):
            self.reports.rejected(opened, "a peer")  # no answer: a stranger learns nothing, not even an error
            return
        message, sender = opened.message, opened.sender
        if isinstance(message, messages.Handshake):
            self._reply(identity, sender, self._handshake_reply(message.challenge))
        elif isinstance(message, messages.RenewLeases):
            deadline = time.monotonic() + self.config.lease_seconds
            for request_id, token in message.holds:
                held = self._held.get(request_id)
                if held is not None and held.token == token:  # renewed, but never past the hold's own bound
                    held.deadline = min(deadline, held.bound)
        elif isinstance(message, messages.ReleaseBlocks):
            for request_id, token in message.holds:
                self.release(request_id, token, message.reader_rank, message.readers)
        elif isinstance(message, messages.ReadBlocks):
            self._serve_read(identity, sender, message)
        elif isinstance(message, messages.ReadPrefix):
            self.served.serve(identity, sender, message)
        else:
            self.reports.rejected(messages.REJECT_UNEXPECTED, "a peer")

    def retry_early_reads(self, now: float) -> None:
        if not self._early_reads:
            return
        waiting, self._early_reads = self._early_reads, []
        for deadline, identity, sender, message in waiting:
            if message.request_id in self._held or deadline <= now:
                self._serve_read(identity, sender, message, retried=True)
            else:
                self._early_reads.append((deadline, identity, sender, message))

    def _handshake_reply(self, challenge: bytes) -> messages.HandshakeReply:
        config = self.config
        error = None
        if not config.serves_blocks:
            error = "this engine hands its blocks to no peer (it only pulls: decode role)"
        elif self.faults.fail_handshake:
            error = "handshake refused (fault injection)"
        # Where this engine's memory is (NIXL metadata, addresses) only when it serves reads: with
        # them, a peer could read and write the whole cache.
        return messages.HandshakeReply(
            self.seal.agent_id,  # this rank's agent
            self.compat_hash,
            self.transport.name,
            self.transport.block_bytes,
            self.transport.num_blocks,
            self.transport.local_info() if error is None else {},
            error,
            self.kv_head_ranges,
            self.rank,
            challenge,
            dtype_name(self.transport.kv_cache.dtype),
        )

    def _reply(self, identity: bytes, receiver: str, message: messages.SideChannelMessage, *data: memoryview) -> None:
        """Answer a peer (a ROUTER drops, never blocks, when that peer's queue is full)."""
        self.server.send_multipart([identity, self.seal.seal(message, receiver), *data], copy=False)

    def _reply_blocks(
        self, identity: bytes, receiver: str, message: messages.BlocksReply, data: memoryview | None
    ) -> None:
        if data is None:
            self._reply(identity, receiver, message)
        else:
            self._reply(identity, receiver, message, data)

    def _serve_read(self, identity: bytes, sender: str, message: messages.ReadBlocks, retried: bool = False) -> None:
        hold = self._held.get(message.request_id)
        error = None
        released = self._released.get((message.request_id, message.token))
        if (
            hold is None
            and not retried
            and not (released is not None and released.complete)
            and len(self._early_reads) < MAX_EARLY_READS
        ):
            # Not held yet? The engine hands this agent a hold one step after the request finished,
            # and the params may reach a fast decode engine before that: wait a little for it.
            self._early_reads.append((time.monotonic() + EARLY_READ_GRACE_S, identity, sender, message))
            return
        if hold is None or hold.token != message.token:
            error = "the blocks are not held (lease expired or released)"
        elif not set(message.block_ids) <= set(hold.block_ids) or len(set(message.block_ids)) != len(message.block_ids):
            # Each held block at most once: a read can never make this engine send more than it holds.
            error = "the request does not hold these blocks (or names one twice)"
        elif len(message.generations) != len(message.block_ids):
            error = "one generation per block"
        elif self.generations[message.block_ids].tolist() != message.generations:
            error = "block generations changed"
        if error is not None:
            self._reply(identity, sender, messages.BlocksReply(message.request_id, error))
            return
        try:
            data = self.transport.read_local(message.block_ids, message.heads)
        except ValueError as problem:  # heads this rank does not hold
            self._reply(identity, sender, messages.BlocksReply(message.request_id, str(problem)))
            return
        if self.generations[message.block_ids].tolist() != message.generations:
            # Checked after the copy too: bytes copied from blocks freed meanwhile are never sent.
            error = "block generations changed while the blocks were read"
            self._reply(identity, sender, messages.BlocksReply(message.request_id, error))
            return
        digest = blake3.blake3(data.data).digest()
        if self.faults.corrupt_blocks:
            data.reshape(-1)[len(data.reshape(-1)) // 2] ^= 0xFF
        if self.faults.truncate_blocks:
            data = data.reshape(-1)[:-1]
        self._reply(identity, sender, messages.BlocksReply(message.request_id, digest=digest), data.data)
        if message.release:
            self.release(message.request_id, message.token, message.reader_rank, message.readers)
