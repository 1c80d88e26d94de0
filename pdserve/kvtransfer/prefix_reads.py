"""PrefixReads: the reader's side of peer reads. It turns each ``PeerLoad`` the engine orders into one
``ReadPrefix`` to the holder's rank of the same number (``served``: the holder checks the router's capability
and the hashes), checks the reply (length, BLAKE3 digest), writes the bytes into the request's blocks, and reports
the load. One round trip, no handshake: a reader needs nothing from the holder but those bytes.

Each read has a deadline (``--kv-transfer-timeout``, at most ``MAX_READ_SECONDS``: a read is an offer, and a holder
that does not answer soon, a dead one say, must not cost more than recomputing would); a read that failed in any way
is reported failed and its request recomputes the prompt. The bytes are written in this thread when the reply
comes, so no write into a request's blocks is ever in flight after its read was reported. Connections come from a
pool of their own (``peers``), apart from the P/D pulls', so dropping one never touches a pull's transport state.
Runs in the agent's thread only.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Protocol

import blake3
import zmq

from pdserve.kvtransfer import messages
from pdserve.kvtransfer.layout import rank_agent_id
from pdserve.kvtransfer.peers import MAX_PEER_SOCKETS, Peer, Peers
from pdserve.kvtransfer.transport.base import Transport
from pdserve.kvtransfer.work import PeerLoad, TransferWork

logger = logging.getLogger(__name__)

REPLIES_PER_STEP = 16
# Seconds a peer read may take at most (2 GB at 1 GB/s: far more than a prompt's KV on any link worth reading over).
MAX_READ_SECONDS = 2.0


class Reports(Protocol):
    def prefix_loaded(self, request_id: str, num_bytes: int, seconds: float) -> None: ...
    def failed_recving(self, request_id: str, in_flight: bool, fault: bool) -> None: ...
    def rejected(self, reason: str, source: str) -> None: ...


@dataclass(eq=False)
class _Read:
    load: PeerLoad
    peer: Peer
    holder: str  # the holder rank's agent id: only its reply is taken
    num_bytes: int
    started: float
    deadline: float


class PrefixReads:
    def __init__(
        self,
        transport: Transport,
        peers: Peers,
        compat_hash: str,
        engine_id: str,
        timeout: float,
        reports: Reports,
        rank: int = 0,
        num_ranks: int = 1,
    ) -> None:
        self.transport = transport
        self.peers = peers
        self.compat_hash = compat_hash
        self.engine_id = engine_id
        self.timeout = min(timeout, MAX_READ_SECONDS)
        self.reports = reports
        self.rank = rank
        self.num_ranks = num_ranks
        self._reads: list[_Read] = []
        self._next_reap = 0.0

    @property
    def busy(self) -> bool:
        return bool(self._reads)

    def owns(self, socket: zmq.Socket[bytes]) -> bool:
        return self.peers.on_socket(socket) is not None

    def take(self, work: TransferWork, now: float) -> None:
        for request_id in work.cancels:  # the request ended: its read's reply, if it comes, is dropped
            for read in [read for read in self._reads if read.load.request_id == request_id]:
                self._end(read, "cancelled", fault=False)
        for load in work.peer_loads:
            self._start(load, now)

    def _start(self, load: PeerLoad, now: float) -> None:
        source = load.source
        if source.tp_size != self.num_ranks:
            # Rank r reads rank r's share of every block: the holder's ranks must split the heads as this one's.
            logger.info(
                "request %s: peer read skipped (the holder runs %d ranks, this engine %d)",
                load.request_id,
                source.tp_size,
                self.num_ranks,
            )
            self.reports.failed_recving(load.request_id, in_flight=False, fault=False)
            return
        address = (source.host, source.ports[self.rank])
        try:
            if address not in self.peers and len(self.peers) >= MAX_PEER_SOCKETS:
                self.peers.reap(now, {read.peer.address for read in self._reads}, keep=MAX_PEER_SOCKETS - 1)
            peer = self.peers.open(address, now)
        except zmq.ZMQError as error:
            logger.warning("request %s: peer read from %s:%d not started: %s", load.request_id, *address, error)
            self.reports.failed_recving(load.request_id, in_flight=False, fault=True)
            return
        holder = rank_agent_id(source.engine_id, self.rank)
        message = messages.ReadPrefix(
            load.request_id,
            source.handle,
            source.reader,
            source.expires_at,
            source.capability,
            self.compat_hash,
            load.first,
            len(load.local_block_ids),
            load.last_hash,
        )
        read = _Read(
            load, peer, holder, len(load.local_block_ids) * self.transport.block_bytes, now, now + self.timeout
        )
        self._reads.append(read)
        problem = self.peers.send(peer, message, holder)
        if problem is not None:
            self._end(read, problem)

    def on_reply(self, socket: zmq.Socket[bytes]) -> bool:
        """Read a bounded number of replies from one holder's connection; True if more may be waiting."""
        peer = self.peers.on_socket(socket)
        for _ in range(REPLIES_PER_STEP):
            if peer is None or not self.peers.is_current(peer):
                return False
            try:
                frames = socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return False
            self._reply(peer, frames)
        return True

    def _reply(self, peer: Peer, frames: list[zmq.Frame]) -> None:
        source = f"{peer.address[0]}:{peer.address[1]}"
        opened = self.peers.seal.open(frames[0].bytes)
        if isinstance(opened, str):
            self.reports.rejected(opened, source)
            return
        reply = opened.message
        read = next(
            (
                r
                for r in self._reads
                if r.peer is peer
                and isinstance(reply, messages.BlocksReply)
                and r.load.request_id == reply.request_id
                and r.holder == opened.sender
            ),
            None,
        )
        if read is None:  # not an answer to a read in flight here (late, or not from the holder asked)
            self.reports.rejected(messages.REJECT_UNEXPECTED, source)
            return
        assert isinstance(reply, messages.BlocksReply)
        data = frames[1].buffer if len(frames) > 1 else None
        if reply.error is not None:
            self._end(read, f"the holder refused: {reply.error}", fault=False)
        elif data is None or len(data) != read.num_bytes:
            self._end(read, f"expected {read.num_bytes} bytes, got {0 if data is None else len(data)}")
        elif blake3.blake3(data).digest() != reply.digest:
            self._end(read, "the block bytes arrived corrupted (digest mismatch)")
        else:
            try:
                self.transport.write_local(read.load.local_block_ids, data)
            except Exception as error:  # e.g. out of device memory for the staging copy
                logger.exception("request %s: writing blocks read from a peer", read.load.request_id)
                self._end(read, f"writing the blocks failed: {type(error).__name__}: {error}")
                return
            self._reads.remove(read)
            self.reports.prefix_loaded(read.load.request_id, read.num_bytes, time.monotonic() - read.started)

    def advance(self, now: float) -> None:
        for read in [read for read in self._reads if read.deadline <= now]:
            self._end(read, "timed out")
            if not any(other.peer is read.peer for other in self._reads):
                self.peers.drop(read.peer)  # a holder that does not answer: the next read connects afresh
        if now >= self._next_reap:
            self._next_reap = now + 1.0
            self.peers.reap(now, {read.peer.address for read in self._reads})

    def _end(self, read: _Read, error: str, fault: bool = True) -> None:
        self._reads.remove(read)
        if fault:
            logger.warning(
                "request %s: peer read from %s:%d failed (%s); the prompt is computed",
                read.load.request_id,
                *read.peer.address,
                error,
            )
        self.reports.failed_recving(read.load.request_id, in_flight=False, fault=fault)
