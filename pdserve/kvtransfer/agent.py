"""TransferAgent: the thread that moves one engine's KV blocks, so the engine loop never blocks
on the network, and ``make_transfer_agent``, how an engine (or a worker rank) builds one.

The agent owns every piece of transfer state, and only its thread touches it. This module is the
thread and the side channel it listens on; the two sides live next to it:

- the prefill side, :class:`holds.HeldBlocks`: the blocks this engine holds for remote decodes, with
  their leases, and the answers on the side channel (a ZMQ ROUTER on ``host:port``);
- the decode side, :class:`pulls.Pulls`: the pulls this engine runs, their handshakes, and lease
  renewals while requests wait, over connections to remote agents (:class:`peers.Peers`);
- peer reads of finished turns' blocks: this engine's side as a holder (:class:`served.ServedPrefixes`, owned
  by the held blocks, on the same side channel) and as a reader (:class:`prefix_reads.PrefixReads`, over
  connections of its own).

Every message in and out is sealed (:class:`messages.Seal`) and names its receiver: with keys, a peer
that cannot seal gets no answer at all, and only a prefill engine's handshake says where its memory is.
Nothing a peer sends can stall this thread: the side channel takes few connections per address
(:class:`admission.ConnectionCaps`), small frames, few queued, and is served a bounded slice a step;
pulls, deadlines and leases run every step whatever arrives.

Which transport moves the bytes is decided once, at start (:mod:`nixl_policy`): NIXL only where it
exposes nothing beyond the registration, else the checked TCP transport (``transport.registry``).

Under tensor parallelism there is one agent per rank, next to that rank's KV cache, with a side
channel of its own (``layout``).

The engine thread posts a :class:`TransferWork` each step and drains the results with
:meth:`collect`; both are thread-safe.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable

import numpy as np
import torch
import zmq

from pdserve.api.keys import ENGINE_KEY, load_router_public, load_secret
from pdserve.kvtransfer import messages
from pdserve.kvtransfer.admission import ConnectionCaps
from pdserve.kvtransfer.base import KVConnectorOutput
from pdserve.kvtransfer.config import KVTransferConfig
from pdserve.kvtransfer.holds import HeldBlocks
from pdserve.kvtransfer.layout import rank_agent_id
from pdserve.kvtransfer.nixl_policy import choose_transport, listening_sockets, unexpected_listeners
from pdserve.kvtransfer.peers import Peers
from pdserve.kvtransfer.prefix_reads import PrefixReads
from pdserve.kvtransfer.pulls import Pulls
from pdserve.kvtransfer.transport.base import Transport
from pdserve.kvtransfer.transport.registry import make_transport
from pdserve.kvtransfer.work import TransferWork

logger = logging.getLogger(__name__)

# How often the loop wakes while transfers or holds need polling (NIXL progress, notifications).
ACTIVE_POLL_MS = 1
IDLE_POLL_MS = 100
# Frames queued per side-channel connection before ZMQ stops reading it (a stranger's flood waits in its own
# TCP buffers, not in this process).
SIDE_CHANNEL_RCVHWM = 16
# Refused side-channel frames are counted each; a warning is logged per reason at most this often.
REJECTION_LOG_INTERVAL_S = 10.0


def max_request_bytes(num_blocks: int) -> int:
    """The largest frame the side channel takes: a read naming every block of the cache (an id and a generation,
    at most 9 bytes each in msgpack), or a slice of renewals, with room for the envelope; never above
    ``MAX_MESSAGE_BYTES``. Anything larger is cut by ZMQ before it is buffered."""
    return min(messages.MAX_MESSAGE_BYTES, 64 * 1024 + 18 * num_blocks)


class TransferAgent:
    def __init__(
        self,
        config: KVTransferConfig,
        kv_cache: torch.Tensor,
        generations: np.ndarray,
        compat_hash: str,
        kv_head_ranges: list[tuple[int, int]] | None = None,
        rank: int = 0,
    ) -> None:
        """``kv_head_ranges``: per rank of this engine, the [start, end) of the model's KV heads its
        cache holds (advertised in handshakes; None: not said, taken as every head on one rank);
        ``rank``: the rank whose cache ``kv_cache`` is. A configured side-channel port is rank 0's;
        rank r listens on it + r."""
        self.config = config
        self.kv_head_ranges = kv_head_ranges or []
        self.rank = rank
        self.num_ranks = len(self.kv_head_ranges) or 1
        self.agent_id = rank_agent_id(config.engine_id, rank)
        self.generations = generations
        keys = load_secret(config.keys_dir, ENGINE_KEY) if config.keys_dir else None
        self.seal = messages.Seal(self.agent_id, keys)
        choice = choose_transport(config.transport, config.host, config.nixl_unbounded)
        listening = listening_sockets()
        self.transport: Transport = make_transport(choice, kv_cache, generations, self.seal, rank, self.kv_head_ranges)
        exposed = unexpected_listeners(config.host, listening)  # what the transport (UCX) opened, beyond our address
        if exposed:
            self.transport.close()
            raise RuntimeError(
                f"the {choice.name} transport listens on {', '.join(exposed)}, beyond this engine's KV address "
                f"{config.host} and loopback (UCX_NET_DEVICES={os.environ.get('UCX_NET_DEVICES', '')!r}): refusing "
                f"to start"
            )
        self._context = zmq.Context()
        self._server = self._context.socket(zmq.ROUTER)
        self._server.setsockopt(zmq.LINGER, 0)
        self._server.setsockopt(zmq.MAXMSGSIZE, max_request_bytes(self.transport.num_blocks))
        self._server.setsockopt(zmq.RCVHWM, SIDE_CHANNEL_RCVHWM)
        self._caps = ConnectionCaps(self._context, self._server)
        if config.side_channel_port:
            self.port = config.side_channel_port + rank
            self._server.bind(f"tcp://{config.host}:{self.port}")
        else:
            self.port = self._server.bind_to_random_port(f"tcp://{config.host}")
        self._caps.port = self.port
        self._wake_address = f"inproc://pdserve-kv-agent-{id(self)}"
        self._wake_recv = self._context.socket(zmq.PULL)
        self._wake_recv.bind(self._wake_address)
        self._wake_lock = threading.Lock()
        self._wake_send = self._context.socket(zmq.PUSH)
        self._wake_send.connect(self._wake_address)
        self._inbox: queue.SimpleQueue[TransferWork] = queue.SimpleQueue()
        self._results_lock = threading.Lock()
        self._results = KVConnectorOutput()
        self._stop = threading.Event()
        self._poller = zmq.Poller()
        router_keys = load_router_public(config.keys_dir) if config.keys_dir else None
        self.holds = HeldBlocks(
            config,
            self.transport,
            generations,
            self.seal,
            self._server,
            compat_hash,
            self.kv_head_ranges,
            self,
            rank,
            router_keys,
        )
        peers = Peers(self._context, self._poller, self.seal, self.transport)
        self.pulls = Pulls(config, self.transport, peers, compat_hash, self.kv_head_ranges, self, rank)
        self.prefix_reads = PrefixReads(
            self.transport,
            Peers(self._context, self._poller, self.seal, self.transport, transport_peers=False),
            compat_hash,
            config.engine_id,
            config.transfer_timeout,
            self,
            rank,
            self.num_ranks,
        )
        self._rejection_logged: dict[str, float] = {}
        self._backlog = False  # frames left unread by the last step's bounded slices: poll again at once
        self._thread = threading.Thread(target=self._run, name="pdserve-kv-agent", daemon=True)
        self._thread.start()
        logger.info(
            "KV transfer agent %s%s: %s transport (%s), side channel %s:%d (%s), lease %.0f s",
            config.engine_id[:8],
            f" rank {rank}" if self.num_ranks > 1 else "",
            self.transport.name,
            choice.reason,
            config.host,
            self.port,
            "authenticated" if self.seal.authenticated else "NOT authenticated",
            config.lease_seconds,
        )

    # ----- engine thread ------------------------------------------------------------------

    def submit(self, work: TransferWork) -> None:
        """Hand the agent a work order; never blocks and never raises (the engine thread calls it)."""
        self._inbox.put(work)
        with self._wake_lock, contextlib.suppress(zmq.Again):
            # A full wake pipe means wake-ups are pending already: the agent finds this work too.
            # A closed one means the agent thread has stopped (close() raced it): nobody to wake.
            if not self._wake_send.closed:
                self._wake_send.send(b"", zmq.NOBLOCK)

    def collect(self) -> KVConnectorOutput | None:
        with self._results_lock:
            results = self._results
            if not results.says_anything():
                return None
            self._results = KVConnectorOutput()
        return results

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self.submit(TransferWork())
            self._thread.join(5)

    # ----- the agent thread -----------------------------------------------------------------

    def _run(self) -> None:
        self._poller.register(self._server, zmq.POLLIN)
        self._poller.register(self._wake_recv, zmq.POLLIN)
        for socket in self._caps.sockets:
            self._poller.register(socket, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                try:
                    self._step()
                except Exception:
                    # One bad message or transfer must not stop every other transfer of this engine.
                    logger.exception("KV transfer agent: unexpected error (continuing)")
                    time.sleep(0.01)
        finally:
            self.pulls.peers.close()
            self.prefix_reads.peers.close()
            self._caps.close()
            self._server.close(linger=0)
            self._wake_recv.close(linger=0)
            with self._wake_lock:  # the engine thread sends on it under this lock
                self._wake_send.close(linger=0)
            self.transport.close()
            self._context.term()

    def _step(self) -> None:
        busy = self.pulls.busy or self.holds.busy or self.prefix_reads.busy or self._backlog
        ready = self._poller.poll(
            (0 if self.transport.busy or self._backlog else ACTIVE_POLL_MS) if busy else IDLE_POLL_MS
        )
        self._take_work()  # first: a read may have come together with the hold it reads
        self._backlog = False
        for socket, _ in ready:
            if socket is self._server:
                self._backlog |= self.holds.serve()  # a bounded slice: the rest waits for the next step
            elif socket is self._wake_recv:
                while self._wake_recv.poll(0):
                    self._wake_recv.recv()
            elif socket in self._caps.sockets:
                self._caps.handle()
            elif self.prefix_reads.owns(socket):
                self._backlog |= self.prefix_reads.on_reply(socket)
            else:
                self._backlog |= self.pulls.on_reply(socket)
        now = time.monotonic()
        self.holds.retry_early_reads(now)
        for request_id, token, reader_rank, readers in self.transport.poll_releases():
            self.holds.release(request_id, token, reader_rank, readers)
        self.holds.expire(now)
        self.holds.served.expire(now)
        self.pulls.advance(now)
        self.prefix_reads.advance(now)

    def _take_work(self) -> None:
        now = time.monotonic()
        while True:
            try:
                work = self._inbox.get_nowait()
            except queue.Empty:
                return
            for request_id, block_ids, token in work.holds:
                self.holds.hold(request_id, block_ids, token, now)
            for request_id in work.unholds:  # after the holds: a hold and its cancel may come together
                self.holds.unhold(request_id)
            for peer_hold in work.peer_holds:
                self.holds.served.hold(peer_hold, now)
            for request_id in work.peer_unholds:
                self.holds.served.unhold(request_id)
            self.pulls.take(work, now)  # never raises: no exception drops the rest of a work order
            self.prefix_reads.take(work, now)

    # ----- what the two sides report (holds.Reports, pulls.Reports) ------------------------------

    def finished_sending(self, request_id: str) -> None:
        with self._results_lock:
            self._results.finished_sending.add(request_id)

    def expired(self, count: int) -> None:
        with self._results_lock:
            self._results.num_expired_leases += count

    def rejected(self, reason: str, source: str) -> None:
        with self._results_lock:
            rejected = self._results.rejected_messages
            rejected[reason] = rejected.get(reason, 0) + 1
        now = time.monotonic()
        if now >= self._rejection_logged.get(reason, 0.0):
            self._rejection_logged[reason] = now + REJECTION_LOG_INTERVAL_S
            logger.warning("side channel: refused a frame from %s (%s)", source, reason.replace("_", " "))

    def finished_recving(self, request_id: str, num_bytes: int, seconds: float) -> None:
        with self._results_lock:
            self._results.finished_recving.add(request_id)
            self._results.transfers.append((num_bytes, seconds))

    def failed_recving(self, request_id: str, in_flight: bool, fault: bool) -> None:
        """``in_flight``: a write into its blocks may still land (reported again, not in flight, once none
        can); ``fault``: a failed transfer, counted (not a cancel, nor the end of such a drain)."""
        with self._results_lock:
            failed = self._results.failed_recving_in_flight if in_flight else self._results.failed_recving
            failed.add(request_id)
            self._results.num_failed_transfers += fault

    def prefix_loaded(self, request_id: str, num_bytes: int, seconds: float) -> None:
        with self._results_lock:
            self._results.finished_recving.add(request_id)
            self._results.peer_loads.append((num_bytes, seconds))

    def served_peer(self, num_bytes: int) -> None:
        with self._results_lock:
            self._results.peer_reads_served.append(num_bytes)

    def failed_release(self) -> None:
        with self._results_lock:
            self._results.num_failed_releases += 1


def make_transfer_agent(
    config: KVTransferConfig,
    kv_cache: torch.Tensor,
    generations: Callable[[int], np.ndarray],
    compat_hash: str,
    kv_head_ranges: list[tuple[int, int]] | None = None,
    rank: int = 0,
) -> TransferAgent:
    """The transfer agent of rank ``rank`` over its ``kv_cache``, with the engine's block generation array
    made by ``generations(rows)``: one int64 per row of the cache, state slots' rows too (the engine's block
    pool makes it, or maps the one its ranks share; this package only reads and registers it). Built when
    the cache is, before the scheduler's block pool, which is then built on the same array."""
    rows = kv_cache.shape[0]
    array = generations(rows)
    if array.shape != (rows,) or array.dtype != np.int64 or not array.flags.c_contiguous:
        # A transport reads a block's generation at 8 bytes times its id (NIXL, from a peer's memory).
        raise ValueError(f"block generations must be a contiguous int64[{rows}], got {array.dtype}{list(array.shape)}")
    return TransferAgent(config, kv_cache, array, compat_hash, kv_head_ranges, rank)
