"""HeldBlocks: the prefill side of a transfer agent. It owns the blocks this engine holds for remote
decodes, with their leases, and answers the side channel's ROUTER socket, where decode engines
hand-shake, renew leases, release blocks and (TCP transport) read them.

A hold ends when a decode releases it (a message, a NIXL notification, or a TCP read that asked to),
or when its lease expires; either is reported as finished sending, and the scheduler frees the
blocks, which bumps their generations, so a later read is detected. A decode engine at TP m releases
from each of its m ranks (each names itself: rank r of m), and the hold ends once all m have: one
decode rank may still read while another is done. A hold outlives at most ``MAX_RENEWED_LEASES``
leases however often it is renewed. Runs in the agent's thread only.

Under tensor parallelism each rank of a prefill engine has its own HeldBlocks over its own cache,
all holding the same block ids: the engine frees a request's blocks once every rank's hold ended.
"""

from __future__ import annotations

import logging
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import zmq

from pdserve.kvtransfer import messages
from pdserve.kvtransfer.config import KVTransferConfig
from pdserve.kvtransfer.transport import Transport

logger = logging.getLogger(__name__)

EARLY_READ_GRACE_S = 1.0
MAX_EARLY_READS = 1024
MAX_REMEMBERED_RELEASES = 4096
# A hold outlives at most this many leases however often it is renewed: a decode queue that never
# drains (or a peer renewing forever) cannot pin prefill memory without bound.
MAX_RENEWED_LEASES = 10


class Reports(Protocol):
    """Where the prefill side reports what the engine must learn (the agent's results)."""

    def finished_sending(self, request_id: str) -> None: ...
    def expired(self, count: int) -> None: ...
    def rejected(self, reason: str, source: str) -> None: ...


@dataclass
class _Hold:
    block_ids: list[int]
    deadline: float  # of the lease
    bound: float  # the latest any renewal may push the deadline to


@dataclass
class _Releases:
    """The decode ranks that released one request so far, of how many."""

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
    ) -> None:
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
        # TCP reads that came before their hold: (give up at, peer identity, message).
        self._early_reads: list[tuple[float, bytes, messages.ReadBlocks]] = []
        # Recent releases (bounded, oldest dropped): a read of a fully released request is late, not
        # early; and releases that came before their hold (decode gave up at once) count when it comes.
        self._released: OrderedDict[str, _Releases] = OrderedDict()

    @property
    def busy(self) -> bool:
        """Leases or early reads to watch (the agent then polls often)."""
        return bool(self._held or self._early_reads)

    def hold(self, request_id: str, block_ids: list[int], now: float) -> None:
        lease = self.config.lease_seconds
        self._held[request_id] = _Hold(block_ids, now + lease, now + MAX_RENEWED_LEASES * lease)
        released = self._released.get(request_id)
        if released is not None and released.complete:
            self._end(request_id)

    def unhold(self, request_id: str) -> None:
        """The scheduler freed these blocks itself (nobody can read them any more)."""
        self._held.pop(request_id, None)

    def release(self, request_id: str, reader_rank: int = 0, readers: int = 1) -> None:
        """Decode rank ``reader_rank`` of ``readers`` is done with these blocks: the hold ends once
        every one of them is."""
        released = self._releases(request_id)
        released.add(reader_rank, readers)
        if released.complete:
            self._end(request_id)

    def _releases(self, request_id: str) -> _Releases:
        """A request's releases so far (remembered for the newest ``MAX_REMEMBERED_RELEASES`` requests)."""
        released = self._released.get(request_id)
        if released is None:
            released = self._released[request_id] = _Releases()
            if len(self._released) > MAX_REMEMBERED_RELEASES:
                self._released.popitem(last=False)
        return released

    def _end(self, request_id: str) -> None:
        """The hold is over (released by every reader, or its lease ran out): no read is served any more."""
        self._releases(request_id).ended = True
        if self._held.pop(request_id, None) is not None:
            self.reports.finished_sending(request_id)

    def expire(self, now: float) -> None:
        expired = [request_id for request_id, hold in self._held.items() if hold.deadline <= now]
        for request_id in expired:
            logger.warning("request %s: KV lease expired before a decode engine took the blocks", request_id)
            self._end(request_id)
        if expired:
            self.reports.expired(len(expired))

    def serve(self) -> None:
        """Answer every frame waiting on the side channel."""
        while True:
            try:
                frames = self.server.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                continue
            identity, frame = frames
            opened = self.seal.open(frame)
            if isinstance(opened, str):
                self.reports.rejected(opened, "a peer")  # no answer: a stranger learns nothing, not even an error
                continue
            message = opened.message
            if isinstance(message, messages.Handshake):
                self._reply(identity, self._handshake_reply())
            elif isinstance(message, messages.RenewLeases):
                deadline = time.monotonic() + self.config.lease_seconds
                for request_id in message.request_ids:
                    held = self._held.get(request_id)
                    if held is not None:  # renewed, but never past the hold's own bound
                        held.deadline = min(deadline, held.bound)
            elif isinstance(message, messages.ReleaseBlocks):
                for request_id in message.request_ids:
                    self.release(request_id, message.reader_rank, message.readers)
            elif isinstance(message, messages.ReadBlocks):
                self._serve_read(identity, message)
            else:
                logger.warning("side channel: dropped a malformed or unexpected message (%d bytes)", len(frame))

    def retry_early_reads(self, now: float) -> None:
        if not self._early_reads:
            return
        waiting, self._early_reads = self._early_reads, []
        for deadline, identity, message in waiting:
            if message.request_id in self._held or deadline <= now:
                self._serve_read(identity, message, retried=True)
            else:
                self._early_reads.append((deadline, identity, message))

    def _handshake_reply(self) -> messages.HandshakeReply:
        config = self.config
        error = None
        if not config.serves_blocks:
            error = "this engine hands its blocks to no peer (it only pulls: decode role)"
        elif self.faults.fail_handshake:
            error = "handshake refused (fault injection)"
        # Where this engine's memory is (NIXL metadata, addresses) only when it serves reads: with
        # them, a peer could read and write the whole cache.
        return messages.HandshakeReply(
            self.seal.engine_id,  # this rank's agent
            self.compat_hash,
            self.transport.name,
            self.transport.block_bytes,
            self.transport.num_blocks,
            self.transport.local_info() if error is None else {},
            error,
            self.kv_head_ranges,
            self.rank,
        )

    def _reply(self, identity: bytes, message: messages.SideChannelMessage, *data: memoryview) -> None:
        """Answer a peer (a ROUTER drops, never blocks, when that peer's queue is full)."""
        self.server.send_multipart([identity, self.seal.seal(message), *data], copy=False)

    def _serve_read(self, identity: bytes, message: messages.ReadBlocks, retried: bool = False) -> None:
        hold = self._held.get(message.request_id)
        error = None
        released = self._released.get(message.request_id)
        if (
            hold is None
            and not retried
            and not (released is not None and released.complete)
            and len(self._early_reads) < MAX_EARLY_READS
        ):
            # Not held yet? The engine hands this agent a hold one step after the request finished,
            # and the params may reach a fast decode engine before that: wait a little for it.
            self._early_reads.append((time.monotonic() + EARLY_READ_GRACE_S, identity, message))
            return
        if hold is None:
            error = "the blocks are not held (lease expired or released)"
        elif not set(message.block_ids) <= set(hold.block_ids) or len(set(message.block_ids)) != len(message.block_ids):
            # Each held block at most once: a read can never make this engine send more than it holds.
            error = "the request does not hold these blocks (or names one twice)"
        elif len(message.generations) != len(message.block_ids):
            error = "one generation per block"
        elif self.generations[message.block_ids].tolist() != message.generations:
            error = "block generations changed"
        if error is not None:
            self._reply(identity, messages.BlocksReply(message.request_id, error))
            return
        try:
            data = self.transport.read_local(message.block_ids, message.heads)
        except ValueError as problem:  # heads this rank does not hold
            self._reply(identity, messages.BlocksReply(message.request_id, str(problem)))
            return
        if self.generations[message.block_ids].tolist() != message.generations:
            # Checked after the copy too: bytes copied from blocks freed meanwhile are never sent.
            error = "block generations changed while the blocks were read"
            self._reply(identity, messages.BlocksReply(message.request_id, error))
            return
        checksum = zlib.crc32(data.data)
        if self.faults.corrupt_blocks:
            data.reshape(-1)[len(data.reshape(-1)) // 2] ^= 0xFF
        if self.faults.truncate_blocks:
            data = data.reshape(-1)[:-1]
        self._reply(identity, messages.BlocksReply(message.request_id, checksum=checksum), data.data)
        if message.release:
            self.release(message.request_id, message.reader_rank, message.readers)
