"""TransferAgent: the thread that moves one engine's KV blocks, so the engine loop never blocks
on the network.

It owns every piece of transfer state, and only this thread touches it:

- the side channel (a ZMQ ROUTER on ``host:port``) and the blocks this engine holds for remote
  decodes, with their leases: the prefill side, in :class:`holds.HeldBlocks`. Every message in and
  out is sealed (:class:`messages.Seal`) and names its receiver: with keys, a peer that cannot seal
  gets no answer at all, and only a prefill engine's handshake says where its memory is. Nothing a
  peer sends can stall this thread: the side channel takes few connections per address
  (:class:`admission.ConnectionCaps`), small frames, few queued, and is served a bounded slice a step;
  pulls, deadlines and leases run every step whatever arrives;
- the pulls this engine runs as a decode (below): a lazy handshake per remote engine (a challenge the
  reply must echo; compatibility hash checked; a restarted remote, which has a new id, replaces the old
  one), the transfer, the generation check, and lease renewals while requests wait. Every wait has a
  deadline (``transfer_timeout``).

Which transport moves the bytes is decided once, at start (:mod:`nixl_policy`): NIXL only where it
exposes nothing beyond the registration, else the checked TCP transport.

Under tensor parallelism there is one agent per rank, next to that rank's KV cache, with a side
channel of its own (``layout``). A decode rank's load of a request is one pull per prefill rank it
reads KV heads from, reported once all have ended; it releases every prefill rank (those it read
from with its reads, the others at once), and prefill ends a hold once every decode rank released it.

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
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch
import zmq

from pdserve.api.keys import ENGINE_KEY, load_secret
from pdserve.kvtransfer import messages
from pdserve.kvtransfer.admission import ConnectionCaps
from pdserve.kvtransfer.base import KVConnectorOutput
from pdserve.kvtransfer.config import KVTransferConfig
from pdserve.kvtransfer.holds import HeldBlocks
from pdserve.kvtransfer.layout import head_mapping_problem, head_ranges, num_kv_heads_of, rank_agent_id, read_plan
from pdserve.kvtransfer.nixl_policy import choose_transport, listening_sockets, unexpected_listeners
from pdserve.kvtransfer.params import RemotePrefill
from pdserve.kvtransfer.transport import Pull, Transport, make_transport
from pdserve.kvtransfer.work import LoadSpec, TransferWork

logger = logging.getLogger(__name__)

# How often the loop wakes while transfers or holds need polling (NIXL progress, notifications).
ACTIVE_POLL_MS = 1
IDLE_POLL_MS = 100
# Side-channel sockets to remote engines: at most this many open, and one unused this long is closed,
# so naming many peers (or a client naming junk addresses) never runs the process out of descriptors.
MAX_PEER_SOCKETS = 128
PEER_IDLE_S = 60.0
# How long an address whose engine was dropped as dead gets no new socket just to carry a release.
DEAD_PEER_MEMORY_S = 30.0
MAX_DEAD_PEERS = 1024
# Messages queued per peer socket before sends fail instead of blocking the agent thread.
PEER_SEND_HWM = 1000
# Holds per RenewLeases frame: a request id and a token each (~100 bytes), far below the side channel's frame bound.
RENEWALS_PER_MESSAGE = 128
# Frames queued per side-channel connection before ZMQ stops reading it (a stranger's flood waits in its own
# TCP buffers, not in this process).
SIDE_CHANNEL_RCVHWM = 16
# Replies read from one peer connection per step (the side channel's own bound is in holds).
REPLIES_PER_STEP = 64
# Refused side-channel frames are counted each; a warning is logged per reason at most this often.
REJECTION_LOG_INTERVAL_S = 10.0


def max_request_bytes(num_blocks: int) -> int:
    """The largest frame the side channel takes: a read naming every block of the cache (an id and a generation,
    at most 9 bytes each in msgpack), or a slice of renewals, with room for the envelope; never above
    ``MAX_MESSAGE_BYTES``. Anything larger is cut by ZMQ before it is buffered."""
    return min(messages.MAX_MESSAGE_BYTES, 64 * 1024 + 18 * num_blocks)


@dataclass
class _Peer:
    """A remote engine's side channel, and what its handshake told us."""

    address: tuple[str, int]
    socket: zmq.Socket[bytes]
    engine_id: str | None = None  # the agent there, set once the handshake succeeded: a reply from any other is not
    handshake_deadline: float | None = None  # set while a handshake is in flight
    expected: str = ""  # the agent the handshake in flight is addressed to
    challenge: bytes = b""  # the handshake in flight's: its reply must echo it
    waiting: list[Pull] = field(default_factory=list)  # pulls waiting for the handshake
    last_used: float = 0.0
    # A pull on this connection failed in the transport: it is dropped once no other pull on it is
    # in flight (never under them: one slow read must not fail the others).
    suspect: bool = False


@dataclass(eq=False)
class _Load:
    """One request's load on this rank: a pull from each prefill rank it reads KV heads from."""

    spec: LoadSpec
    open: int = 0  # pulls not ended yet
    num_bytes: int = 0
    error: str | None = None  # the first pull's failure
    cancelled: bool = False  # that failure was a cancel (the request ended), not a fault
    writing: int = 0  # failed pulls whose writes into the blocks may still land
    started: float = field(default_factory=time.monotonic)


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
        self.compat_hash = compat_hash
        self.faults = config.faults
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
        self.holds = HeldBlocks(
            config, self.transport, generations, self.seal, self._server, compat_hash, self.kv_head_ranges, self, rank
        )
        # Decode side.
        self._peers: dict[tuple[str, int], _Peer] = {}
        # Addresses whose engine was dropped as dead, until when: no socket is opened just to send them a release.
        self._dead: OrderedDict[tuple[str, int], float] = OrderedDict()
        self._next_reap = 0.0
        self._tracked: dict[str, RemotePrefill] = {}  # leases to renew
        self._delayed: list[Pull] = []  # fault hook: pulls not started yet
        self._next_renewal = 0.0
        self._rejection_logged: dict[str, float] = {}
        self._backlog = False  # frames left unread by the last step's bounded slices: poll again at once
        self._stalled = False  # fault hook: the one stall after a read was taken
        self._poller = zmq.Poller()
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
            for peer in self._peers.values():
                peer.socket.close(linger=0)
            self._caps.close()
            self._server.close(linger=0)
            self._wake_recv.close(linger=0)
            with self._wake_lock:  # the engine thread sends on it under this lock
                self._wake_send.close(linger=0)
            self.transport.close()
            self._context.term()

    def _step(self) -> None:
        busy = self.transport.busy or self.holds.busy or self._delayed or self._backlog
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
            else:
                self._backlog |= self._on_peer_reply(socket)
        now = time.monotonic()
        self.holds.retry_early_reads(now)
        self._start_delayed(now)
        for request_id, token, reader_rank, readers in self.transport.poll_releases():
            self.holds.release(request_id, token, reader_rank, readers)
        for pull, error in self.transport.progress(now):
            self._pull_done(pull, error)
        self._check_deadlines(now)

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
            for request_id, remote in work.tracks:
                self._tracked[request_id] = remote
                self._next_renewal = min(self._next_renewal, now + remote.lease_seconds / 3)
            for request_id, remote in work.releases:
                self._tracked.pop(request_id, None)
                self._send_release(remote)
            for request_id in work.cancels:
                self._cancel_pending(request_id)
            for spec in work.loads:
                for pull in self._pulls_of(spec):
                    if self.faults.delay_load:
                        pull.not_before = now + self.faults.delay_load
                        self._delayed.append(pull)
                    else:
                        self._start_pull(pull)
            # Every item above either took effect or, for pulls, was reported failed: the helpers
            # it calls never raise, so no exception can drop the rest of a work order.

    # ----- what the prefill side (HeldBlocks) reports -------------------------------------------

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

    # ----- decode side: pulling ------------------------------------------------------------------

    def _peer(self, address: tuple[str, int]) -> _Peer:
        peer = self._peers.get(address)
        if peer is None:
            if len(self._peers) >= MAX_PEER_SOCKETS:
                self._reap_idle_peers(time.monotonic(), keep=MAX_PEER_SOCKETS - 1)
            socket = self._context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            # A reply is at most the blocks one pull asks for, and no pull asks for more than this
            # engine's whole cache (its length is then checked against what that pull asked).
            max_reply = self.transport.num_blocks * self.transport.block_bytes + messages.MAX_MESSAGE_BYTES
            socket.setsockopt(zmq.MAXMSGSIZE, max_reply)
            socket.setsockopt(zmq.SNDHWM, PEER_SEND_HWM)
            socket.connect(f"tcp://{address[0]}:{address[1]}")
            self._poller.register(socket, zmq.POLLIN)
            peer = self._peers[address] = _Peer(address, socket)
        peer.last_used = time.monotonic()
        # Talked to for real work (a pull, renewals): whatever was found dead there before, it is
        # worth a release again (a restarted engine listens at the same address).
        self._dead.pop(address, None)
        return peer

    def _drop_peer(self, peer: _Peer, dead: bool = True) -> None:
        """Forget one connection to a remote engine (dead, restarted, refused, or idle when not
        ``dead``): the next use hand-shakes afresh. Only that connection: a newer one to the same
        address is left alone."""
        if self._peers.get(peer.address) is not peer:
            return
        del self._peers[peer.address]
        self._poller.unregister(peer.socket)
        peer.socket.close(linger=0)
        try:
            self.transport.forget_peer(peer.address)
        except Exception:
            logger.exception("forgetting the transport's state of %s:%d", *peer.address)
        if dead:
            self._dead[peer.address] = time.monotonic() + DEAD_PEER_MEMORY_S
            self._dead.move_to_end(peer.address)
            while len(self._dead) > MAX_DEAD_PEERS:
                self._dead.popitem(last=False)

    def _in_use(self, peer: _Peer) -> bool:
        return bool(peer.waiting or peer.handshake_deadline is not None or self.transport.pulls_on(peer))

    def _reap_idle_peers(self, now: float, keep: int = MAX_PEER_SOCKETS) -> None:
        """Close connections nothing uses: those idle for PEER_IDLE_S, and the least recently used
        beyond ``keep``. (A connection with tracked leases is in use: renewals go through it.)"""
        tracked = {remote.rank_address(rank) for remote in self._tracked.values() for rank in range(remote.tp_size)}
        idle = sorted(
            (p for p in self._peers.values() if p.address not in tracked and not self._in_use(p)),
            key=lambda p: p.last_used,
        )
        excess = len(self._peers) - keep
        for peer in idle:
            if excess > 0 or now - peer.last_used >= PEER_IDLE_S:
                self._drop_peer(peer, dead=False)
                excess -= 1

    def _send(self, peer: _Peer, message: messages.SideChannelMessage, receiver: str) -> str | None:
        """Send to agent ``receiver`` without blocking; the error if the connection cannot take it now (its
        queue is full: the peer is dead or hung)."""
        try:
            peer.socket.send(self.seal.seal(message, receiver), zmq.NOBLOCK)
        except zmq.ZMQError as error:
            return f"the side channel to {peer.address[0]}:{peer.address[1]} is not taking messages ({error})"
        return None

    def _pulls_of(self, spec: LoadSpec) -> list[Pull]:
        """A load's pulls, one per prefill rank this rank reads KV heads from (``layout.read_plan``).
        The prefill ranks it reads nothing from learn at once that this rank is done with the blocks.
        A load that cannot be planned is reported failed (and released) here, with no pull."""
        remote = spec.remote
        load = _Load(spec)
        try:
            plan: list[tuple[int, tuple[int, int] | None]] = [(0, None)]
            if self.kv_head_ranges:
                theirs = head_ranges(num_kv_heads_of(self.kv_head_ranges), remote.tp_size)
                segments = read_plan(self.kv_head_ranges[self.rank], theirs, self.rank)
                plan = [(segment.source_rank, (segment.start, segment.end)) for segment in segments]
            elif remote.tp_size > 1:
                raise ValueError("this engine does not say which KV heads it holds")
        except ValueError as error:
            load.error = f"no way to read this engine's KV heads from the prefill engine's ranks: {error}"
            self._report_load(load)
            self._send_release(remote)
            return []
        pulls = []
        for rank, heads in plan:
            num_bytes = len(spec.local_block_ids) * self.transport.layout.slice_bytes(heads)
            pulls.append(Pull(spec, num_bytes, rank, heads, load))
        load.open = len(pulls)
        for rank in set(range(remote.tp_size)) - {rank for rank, _ in plan}:
            self._send_release(remote, rank)
        return pulls

    def _start_pull(self, pull: Pull) -> None:
        """Start a pull, or report it failed: whatever goes wrong fails this pull only."""
        try:
            address = pull.spec.remote.rank_address(pull.source_rank)
            peer = self._peer(address)
            if peer.engine_id is not None and peer.engine_id != self._source_id(pull):
                # Another engine answers there now (a restart): its old memory is gone, and so is
                # whatever the old connection was doing.
                self._drop_peer(peer)
                peer = self._peer(address)
            if peer.engine_id is not None:
                self._transfer(pull, peer)
                return
            peer.waiting.append(pull)
            if peer.handshake_deadline is None:
                # The handshake has a deadline of its own; the transfer's starts when it does.
                peer.handshake_deadline = time.monotonic() + self.config.transfer_timeout
                peer.expected, peer.challenge = self._source_id(pull), messages.new_challenge()
                error = self._send(peer, messages.Handshake(self.agent_id, peer.challenge), peer.expected)
                if error is not None:
                    self._handshake_failed(peer, error)
        except Exception as error:
            logger.exception("request %s: starting a KV pull", pull.spec.request_id)
            in_flight = self._forget_pull(pull)
            self._pull_done(pull, f"the pull could not start: {type(error).__name__}: {error}", in_flight=in_flight)

    @staticmethod
    def _source_id(pull: Pull) -> str:
        """The agent a pull reads from: its prefill rank's."""
        return rank_agent_id(pull.spec.remote.engine_id, pull.source_rank)

    def _transfer(self, pull: Pull, peer: _Peer) -> None:
        assert peer.engine_id is not None
        pull.connection = peer
        pull.deadline = time.monotonic() + self.config.transfer_timeout
        self.transport.start_pull(pull, peer.socket, peer.engine_id)
        if self.faults.stall_after_read and not self._stalled:
            self._stalled = True
            time.sleep(self.faults.stall_after_read)

    def _forget_pull(self, pull: Pull) -> bool:
        """Take a pull out of every queue it may sit in (it is about to be reported); True if a
        write into its blocks may still land."""
        for peer in self._peers.values():
            if pull in peer.waiting:
                peer.waiting.remove(pull)
        if pull in self._delayed:
            self._delayed.remove(pull)
        return self.transport.discard(pull)

    def _handshake_failed(self, peer: _Peer, error: str, dead: bool = True) -> None:
        """``dead``: the engine did not answer (as opposed to answering with a refusal)."""
        logger.warning("handshake with %s:%d failed: %s", *peer.address, error)
        waiting, peer.waiting = peer.waiting, []
        peer.handshake_deadline = None
        self._drop_peer(peer, dead=dead)
        for pull in waiting:
            self._pull_done(pull, f"handshake failed: {error}")

    def _cancel_pending(self, request_id: str) -> None:
        """The request ended: its pulls that have not started moving data are dropped. (One that
        has started drains first: its destination blocks stay allocated until then.)"""
        for queue_ in [self._delayed, *(peer.waiting for peer in list(self._peers.values()))]:
            for pull in [p for p in queue_ if p.spec.request_id == request_id]:
                queue_.remove(pull)
                self._pull_done(pull, "the request ended before its pull started", cancelled=True)

    def _start_delayed(self, now: float) -> None:
        if not self._delayed:
            return
        due = [pull for pull in self._delayed if pull.not_before <= now]
        if due:
            self._delayed = [pull for pull in self._delayed if pull.not_before > now]
            for pull in due:
                self._start_pull(pull)

    def _on_peer_reply(self, socket: zmq.Socket[bytes]) -> bool:
        """Read a bounded number of replies from one peer connection; True if more may be waiting."""
        peer = next((p for p in self._peers.values() if p.socket is socket), None)
        for _ in range(REPLIES_PER_STEP):
            if peer is None or self._peers.get(peer.address) is not peer:  # a reply may drop the peer
                return False
            try:
                frames = socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return False
            self._peer_frames(peer, frames)
        return True

    def _peer_frames(self, peer: _Peer, frames: list[zmq.Frame]) -> None:
        source = f"{peer.address[0]}:{peer.address[1]}"
        opened = self.seal.open(frames[0].bytes)
        if isinstance(opened, str):
            self.rejected(opened, source)
            return
        message = opened.message
        if isinstance(message, messages.HandshakeReply):
            if peer.handshake_deadline is None or opened.sender != peer.expected or opened.sender != message.engine_id:
                self.rejected(messages.REJECT_UNEXPECTED, source)
            elif not messages.answers(message, peer.challenge):
                self.rejected(messages.REJECT_REPLAYED, source)  # an old reply: not an answer to this handshake
            else:
                self._on_handshake(peer, message)
        elif isinstance(message, messages.BlocksReply):
            if peer.engine_id is None or opened.sender != peer.engine_id:
                self.rejected(messages.REJECT_UNEXPECTED, source)
                return
            # Matched against the pulls sent on this connection only: another engine's reply
            # can never land in a pull meant for this one.
            self.transport.on_blocks_reply(message, frames[1].buffer if len(frames) > 1 else None, peer)
        else:
            self.rejected(messages.REJECT_UNEXPECTED, source)

    def _on_handshake(self, peer: _Peer, reply: messages.HandshakeReply) -> None:
        peer.handshake_deadline = None
        peer.challenge = b""
        waiting, peer.waiting = peer.waiting, []
        error = reply.error
        if error is None and reply.compat_hash != self.compat_hash:
            error = "incompatible KV cache (model, dtype, block size or layout differ)"
        if error is None:
            error = head_mapping_problem(self.kv_head_ranges, reply.kv_head_ranges)
        if error is None and self.kv_head_ranges and reply.kv_head_ranges:
            # Pulls were planned on the standard split of the model's KV heads over the prefill's ranks.
            expected = head_ranges(num_kv_heads_of(self.kv_head_ranges), len(reply.kv_head_ranges))
            if [tuple(heads) for heads in reply.kv_head_ranges] != expected or not 0 <= reply.rank < len(expected):
                error = f"the remote engine's KV heads are split as {reply.kv_head_ranges} (rank {reply.rank})"
        if error is None and reply.transport != self.transport.name:
            error = f"the remote engine uses the {reply.transport} transport, this one {self.transport.name}"
        if error is None:
            try:
                self.transport.add_peer(peer.address, reply)
            except Exception as exc:  # a NIXL failure to load the remote's metadata
                error = f"cannot connect the transport: {exc}"
        if error is not None:
            peer.waiting = waiting
            self._handshake_failed(peer, error, dead=False)
            return
        peer.engine_id = reply.engine_id
        logger.info("handshake with engine %s at %s:%d (%s)", reply.engine_id[:8], *peer.address, reply.transport)
        for pull in waiting:
            if self._source_id(pull) != reply.engine_id:
                self._pull_done(pull, "the prefill engine that held the blocks is gone (another engine answers)")
            else:
                self._start_pull(pull)

    def _pull_done(self, pull: Pull, error: str | None, cancelled: bool = False, in_flight: bool = False) -> None:
        """A pull ended: its load is reported once its last pull ended; a pull that did not release its
        prefill rank (failed or cancelled) tells it to free. ``in_flight``: it failed while a write into
        its blocks may still land (the load is reported so, and again once the transport says every such
        write drained). Never raises: the report is made first, and nothing after it can lose it."""
        spec: LoadSpec = pull.spec
        if error is None and self.faults.fail_load:
            error = "failed by fault injection"
        load: _Load = pull.load
        load.open -= 1
        if error is None:
            load.num_bytes += pull.num_bytes
        elif load.error is None:
            load.error, load.cancelled = error, cancelled
        load.writing += in_flight
        if load.open == 0:
            self._report_load(load)
        if error is not None and not cancelled:
            address = spec.remote.rank_address(pull.source_rank)
            logger.warning("request %s: KV pull from %s:%d failed: %s", spec.request_id, *address, error)
        peer = pull.connection
        if isinstance(peer, _Peer):
            if error is None:
                peer.suspect = False  # the connection works
            elif pull.peer_failed and not cancelled:
                # The engine may be dead or restarted: once nothing else runs on this connection,
                # the next pull from there hand-shakes afresh.
                peer.suspect = True
            if peer.suspect and not self._in_use(peer):
                self._drop_peer(peer)
        if not pull.released:
            self._send_release(spec.remote, pull.source_rank)

    def _report_load(self, load: _Load) -> None:
        """Every pull of a load ended: it landed (all did), or failed."""
        request_id = load.spec.request_id
        self._tracked.pop(request_id, None)
        with self._results_lock:
            if load.error is None:
                self._results.finished_recving.add(request_id)
                self._results.transfers.append((load.num_bytes, time.monotonic() - load.started))
            else:
                failed = self._results.failed_recving_in_flight if load.writing else self._results.failed_recving
                failed.add(request_id)
                self._results.num_failed_transfers += not load.cancelled

    def _send_release(self, remote: RemotePrefill, rank: int | None = None) -> None:
        """Tell a prefill engine's rank ``rank`` (None: every rank) that this rank is done with a
        request's blocks, best effort: one that cannot be told (dead, or not taking messages) frees them
        when their lease ends. Counted when it fails."""
        if self.faults.no_release:
            return
        release = messages.ReleaseBlocks([(remote.request_id, remote.hold_token)], self.rank, self.num_ranks)
        for source in range(remote.tp_size) if rank is None else (rank,):
            address = remote.rank_address(source)
            error = None
            if address not in self._peers and self._dead.get(address, 0.0) > time.monotonic():
                error = "its engine was just found dead"
            else:
                try:
                    error = self._send(self._peer(address), release, rank_agent_id(remote.engine_id, source))
                except zmq.ZMQError as exc:  # no socket could be made
                    error = str(exc)
            if error is not None:
                logger.info(
                    "request %s: could not tell %s:%d to free its blocks (%s); its lease will",
                    remote.request_id,
                    *address,
                    error,
                )
                with self._results_lock:
                    self._results.num_failed_releases += 1

    def _check_deadlines(self, now: float) -> None:
        self.holds.expire(now)
        for peer in list(self._peers.values()):
            if peer.handshake_deadline is not None and peer.handshake_deadline <= now:
                self._handshake_failed(peer, "timed out")
        for pull, in_flight in self.transport.expire(now):
            self._pull_done(pull, "transfer timed out", in_flight=in_flight)
        for pull in self.transport.drained():
            load = pull.load
            load.writing -= 1
            if not load.writing and not load.open:  # no write into its blocks can land any more
                with self._results_lock:
                    self._results.failed_recving.add(pull.spec.request_id)
        if self._tracked and now >= self._next_renewal and not self.faults.no_renew:
            # Three renewals per lease of the shortest lease asked for: one lost message is harmless.
            self._next_renewal = now + min(remote.lease_seconds for remote in self._tracked.values()) / 3
            self._renew_leases()
        if now >= self._next_reap:
            self._next_reap = now + 1.0
            self._reap_idle_peers(now)
            while self._dead and next(iter(self._dead.values())) <= now:
                self._dead.popitem(last=False)

    def _renew_leases(self) -> None:
        by_agent: dict[tuple[tuple[str, int], str], list[tuple[str, str]]] = {}
        for remote in self._tracked.values():
            for rank in range(remote.tp_size):  # every prefill rank holds the blocks
                agent = (remote.rank_address(rank), rank_agent_id(remote.engine_id, rank))
                by_agent.setdefault(agent, []).append((remote.request_id, remote.hold_token))
        for (address, receiver), holds in by_agent.items():
            peer = self._peer(address)
            # In slices that stay far below the peer's frame limit, however many requests wait.
            for start in range(0, len(holds), RENEWALS_PER_MESSAGE):
                renewal = messages.RenewLeases(holds[start : start + RENEWALS_PER_MESSAGE])
                error = self._send(peer, renewal, receiver)
                if error is not None:
                    logger.info("lease renewal to %s:%d not sent: %s", *address, error)
                    break
