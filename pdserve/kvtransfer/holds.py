"""HeldBlocks: the prefill side of a transfer agent. It owns the blocks this engine holds for remote
decodes, with their leases, and answers the side channel's ROUTER socket, where decode engines
hand-shake, renew leases, release blocks and (TCP transport) read them.

A hold ends when a decode releases it (a message, a NIXL notification, or a TCP read that asked to),
or when its lease expires; either is reported as finished sending, and the scheduler frees the
blocks, which bumps their generations, so a later read is detected. A hold outlives at most
``MAX_RENEWED_LEASES`` leases however often it is renewed. Runs in the agent's thread only.
"""

from __future__ import annotations

import logging
import time
import zlib
from collections import OrderedDict
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
        # request id -> (held block ids, lease deadline, the latest any renewal may push it to).
        self._held: dict[str, tuple[list[int], float, float]] = {}
        # TCP reads that came before their hold: (give up at, peer identity, message).
        self._early_reads: list[tuple[float, bytes, messages.ReadBlocks]] = []
        # Recent releases (bounded, oldest dropped): a read of these is late, not early; and a release
        # that came before its hold (decode gave up at once) ends that hold the moment it arrives.
        self._released: OrderedDict[str, None] = OrderedDict()

    @property
    def busy(self) -> bool:
        """Leases or early reads to watch (the agent then polls often)."""
        return bool(self._held or self._early_reads)

    def hold(self, request_id: str, block_ids: list[int], now: float) -> None:
        lease = self.config.lease_seconds
        self._held[request_id] = (block_ids, now + lease, now + MAX_RENEWED_LEASES * lease)
        if request_id in self._released:
            self.release(request_id)

    def unhold(self, request_id: str) -> None:
        """The scheduler freed these blocks itself (nobody can read them any more)."""
        self._held.pop(request_id, None)

    def release(self, request_id: str) -> None:
        self._released[request_id] = None
        if len(self._released) > MAX_REMEMBERED_RELEASES:
            self._released.popitem(last=False)
        if self._held.pop(request_id, None) is not None:
            self.reports.finished_sending(request_id)

    def expire(self, now: float) -> None:
        expired = [rid for rid, (_, deadline, _) in self._held.items() if deadline <= now]
        for request_id in expired:
            logger.warning("request %s: KV lease expired before a decode engine took the blocks", request_id)
            self.release(request_id)
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
                        self._held[request_id] = (held[0], min(deadline, held[2]), held[2])
            elif isinstance(message, messages.ReleaseBlocks):
                for request_id in message.request_ids:
                    self.release(request_id)
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
            config.engine_id,
            self.compat_hash,
            self.transport.name,
            self.transport.block_bytes,
            self.transport.num_blocks,
            self.transport.local_info() if error is None else {},
            error,
            self.kv_head_ranges,
        )

    def _reply(self, identity: bytes, message: messages.SideChannelMessage, *data: memoryview) -> None:
        """Answer a peer (a ROUTER drops, never blocks, when that peer's queue is full)."""
        self.server.send_multipart([identity, self.seal.seal(message), *data], copy=False)

    def _serve_read(self, identity: bytes, message: messages.ReadBlocks, retried: bool = False) -> None:
        held = self._held.get(message.request_id)
        error = None
        if (
            held is None
            and not retried
            and message.request_id not in self._released
            and len(self._early_reads) < MAX_EARLY_READS
        ):
            # Not held yet? The engine hands this agent a hold one step after the request finished,
            # and the params may reach a fast decode engine before that: wait a little for it.
            self._early_reads.append((time.monotonic() + EARLY_READ_GRACE_S, identity, message))
            return
        if held is None:
            error = "the blocks are not held (lease expired or released)"
        elif not set(message.block_ids) <= set(held[0]) or len(set(message.block_ids)) != len(message.block_ids):
            # Each held block at most once: a read can never make this engine send more than it holds.
            error = "the request does not hold these blocks (or names one twice)"
        elif len(message.generations) != len(message.block_ids):
            error = "one generation per block"
        elif self.generations[message.block_ids].tolist() != message.generations:
            error = "block generations changed"
        if error is not None:
            self._reply(identity, messages.BlocksReply(message.request_id, error))
            return
        data = self.transport.read_local(message.block_ids)
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
            self.release(message.request_id)
