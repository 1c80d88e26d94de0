"""Pulls: the decode side of a transfer agent. It turns each load the engine orders into pulls, runs them
through a lazy handshake per remote agent and the transfer, reports each load once all its pulls ended,
renews the leases of the holds its requests wait on, and tells prefill ranks when they may free.

A handshake carries a challenge its reply must echo, and checks the compatibility hash, the KV heads'
split and the transport; a restarted remote (a new id at a known address) replaces the old connection.
Every wait has a deadline (``transfer_timeout``): a handshake's, then each transfer's. A connection on
which a pull failed in the transport is dropped once no other pull runs on it (``peers``).

Under tensor parallelism a decode rank's load of a request is one pull per prefill rank it reads KV
heads from (``layout.read_plan``), reported once all have ended; it releases every prefill rank (those it
read from with its reads, the others at once), and prefill ends a hold once every decode rank released it.

Each pull moves through the states of :class:`PullState`, along ``_MOVES`` only (SGLang's ``KVPoll``, per
pull), and only this module moves it; a transport reports what happened (``progress``, ``expire``,
``drained``) and this side moves the pull. Runs in the agent's thread only.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

import zmq

from pdserve.kvtransfer import messages
from pdserve.kvtransfer.config import KVTransferConfig
from pdserve.kvtransfer.layout import head_mapping_problem, head_ranges, num_kv_heads_of, rank_agent_id, read_plan
from pdserve.kvtransfer.params import RemotePrefill
from pdserve.kvtransfer.peers import MAX_PEER_SOCKETS, Address, Peer, Peers
from pdserve.kvtransfer.transport.base import Transport
from pdserve.kvtransfer.work import LoadSpec, TransferWork
from pdserve.models.dtype import dtype_name

logger = logging.getLogger(__name__)

# Holds per RenewLeases frame: a request id and a token each (~100 bytes), far below the side channel's frame bound.
RENEWALS_PER_MESSAGE = 128
# Replies read from one peer connection per step (the side channel's own bound is in holds).
REPLIES_PER_STEP = 64


class Reports(Protocol):
    """Where the decode side reports what the engine must learn (the agent's results)."""

    def finished_recving(self, request_id: str, num_bytes: int, seconds: float) -> None: ...
    def failed_recving(self, request_id: str, in_flight: bool, fault: bool) -> None: ...
    def failed_release(self) -> None: ...
    def rejected(self, reason: str, source: str) -> None: ...


class PullState(enum.Enum):
    """Where a pull is: PLANNED, (DELAYED,) HANDSHAKING, TRANSFERRING, then DONE; FAILED from any state
    before DONE, through DRAINING when it failed while its transport may still write into its blocks."""

    PLANNED = "planned"  # made from a load, not started
    DELAYED = "delayed"  # fault hook (delay_load): not started before ``not_before``
    HANDSHAKING = "handshaking"  # waits for the handshake with its prefill rank's agent
    TRANSFERRING = "transferring"  # the transport moves its bytes
    DONE = "done"  # landed
    DRAINING = "draining"  # failed while a write into its blocks may still land (the transport says when none can)
    FAILED = "failed"  # failed or cancelled, and nothing more lands in its blocks


_MOVES: dict[PullState, frozenset[PullState]] = {
    PullState.PLANNED: frozenset({PullState.DELAYED, PullState.HANDSHAKING, PullState.TRANSFERRING, PullState.FAILED}),
    PullState.DELAYED: frozenset({PullState.HANDSHAKING, PullState.TRANSFERRING, PullState.FAILED}),
    # Again to HANDSHAKING: its connection was replaced before it started, and the new one hand-shakes.
    PullState.HANDSHAKING: frozenset({PullState.HANDSHAKING, PullState.TRANSFERRING, PullState.FAILED}),
    PullState.TRANSFERRING: frozenset({PullState.DONE, PullState.DRAINING, PullState.FAILED}),
    PullState.DRAINING: frozenset({PullState.FAILED}),
    PullState.DONE: frozenset(),
    PullState.FAILED: frozenset(),
}
# A pull in these has ended: its load counted it.
ENDED = frozenset({PullState.DONE, PullState.DRAINING, PullState.FAILED})


@dataclass(eq=False)
class Load:
    """One request's load on this rank: a pull from each prefill rank it reads KV heads from."""

    spec: LoadSpec
    open: int = 0  # pulls not ended yet
    num_bytes: int = 0
    error: str | None = None  # the first pull's failure
    cancelled: bool = False  # that failure was a cancel (the request ended), not a fault
    writing: int = 0  # failed pulls whose writes into the blocks may still land
    started: float = field(default_factory=time.monotonic)


@dataclass(eq=False)
class Pull:
    """The blocks one decode rank pulls for a request from one prefill rank: KV heads ``heads`` (None:
    every head, one rank each side) from rank ``source_rank``, as part of ``load``."""

    spec: LoadSpec
    num_bytes: int
    load: Load
    source_rank: int = 0
    heads: tuple[int, int] | None = None
    state: PullState = PullState.PLANNED
    not_before: float = 0.0  # fault hook: do not start before
    deadline: float = 0.0  # of the transfer, set when it starts
    connection: Peer | None = None  # the connection the transfer runs on (set when it starts)
    # Set by the transport:
    released: bool = False  # prefill was told to free (or frees by itself) once this pull ends
    peer_failed: bool = False  # failed in the transport (dead or unreachable peer), not by the peer's answer

    def move(self, to: PullState) -> None:
        """The one place a pull changes state; a move ``_MOVES`` does not list is a bug, refused."""
        if to not in _MOVES[self.state]:
            raise RuntimeError(f"request {self.spec.request_id}: a pull cannot go from {self.state.name} to {to.name}")
        self.state = to


class Pulls:
    def __init__(
        self,
        config: KVTransferConfig,
        transport: Transport,
        peers: Peers,
        compat_hash: str,
        kv_head_ranges: list[tuple[int, int]],
        reports: Reports,
        rank: int = 0,
    ) -> None:
        """``kv_head_ranges``: per rank of this engine, the KV heads its cache holds (empty: every head on
        one rank); ``rank``: this agent's."""
        self.config = config
        self.faults = config.faults
        self.transport = transport
        self.peers = peers
        self.agent_id = peers.seal.agent_id
        self.compat_hash = compat_hash
        self.kv_head_ranges = kv_head_ranges
        self.reports = reports
        self.rank = rank
        self.num_ranks = len(kv_head_ranges) or 1
        self._tracked: dict[str, RemotePrefill] = {}  # leases to renew
        self._delayed: list[Pull] = []  # fault hook: pulls not started yet
        self._next_renewal = 0.0
        self._next_reap = 0.0
        self._stalled = False  # fault hook: the one stall after a read was taken

    @property
    def busy(self) -> bool:
        """Pulls in flight or waiting to start (the agent then polls often)."""
        return self.transport.busy or bool(self._delayed)

    def take(self, work: TransferWork, now: float) -> None:
        """The decode side of a work order: leases to renew, releases, cancels and loads. Every item
        either takes effect or, for pulls, is reported failed: nothing here raises, so no exception can
        drop the rest of a work order."""
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
                    pull.move(PullState.DELAYED)
                    self._delayed.append(pull)
                else:
                    self._start_pull(pull)

    def advance(self, now: float) -> None:
        """One step: start the delayed pulls that are due, end those the transport finished, and hold every
        deadline (handshakes, transfers), renew leases and close idle connections when it is time."""
        self._start_delayed(now)
        for pull, error in self.transport.progress(now):
            self._pull_done(pull, error)
        for peer in self.peers:
            if peer.handshake_deadline is not None and peer.handshake_deadline <= now:
                self._handshake_failed(peer, "timed out")
        for pull, in_flight in self.transport.expire(now):
            self._pull_done(pull, "transfer timed out", in_flight=in_flight)
        for pull in self.transport.drained():
            pull.move(PullState.FAILED)
            load = pull.load
            load.writing -= 1
            if not load.writing and not load.open:  # no write into its blocks can land any more
                self.reports.failed_recving(pull.spec.request_id, in_flight=False, fault=False)
        if self._tracked and now >= self._next_renewal and not self.faults.no_renew:
            # Three renewals per lease of the shortest lease asked for: one lost message is harmless.
            self._next_renewal = now + min(remote.lease_seconds for remote in self._tracked.values()) / 3
            self._renew_leases()
        if now >= self._next_reap:
            self._next_reap = now + 1.0
            self.peers.reap(now, self._leased())

    # ----- replies from prefill agents ---------------------------------------------------------

    def on_reply(self, socket: zmq.Socket[bytes]) -> bool:
        """Read a bounded number of replies from one peer connection; True if more may be waiting."""
        peer = self.peers.on_socket(socket)
        for _ in range(REPLIES_PER_STEP):
            if peer is None or not self.peers.is_current(peer):  # a reply may drop the peer
                return False
            try:
                frames = socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return False
            self._peer_frames(peer, frames)
        return True

    def _peer_frames(self, peer: Peer, frames: list[zmq.Frame]) -> None:
        source = f"{peer.address[0]}:{peer.address[1]}"
        opened = self.peers.seal.open(frames[0].bytes)
        if isinstance(opened, str):
            self.reports.rejected(opened, source)
            return
        message = opened.message
        if isinstance(message, messages.HandshakeReply):
            if peer.handshake_deadline is None or opened.sender != peer.expected or opened.sender != message.engine_id:
                self.reports.rejected(messages.REJECT_UNEXPECTED, source)
            elif not messages.answers(message, peer.challenge):
                self.reports.rejected(messages.REJECT_REPLAYED, source)  # an old reply: not an answer to this handshake
            else:
                self._on_handshake(peer, message)
        elif isinstance(message, messages.BlocksReply):
            if peer.engine_id is None or opened.sender != peer.engine_id:
                self.reports.rejected(messages.REJECT_UNEXPECTED, source)
                return
            # Matched against the pulls sent on this connection only: another engine's reply
            # can never land in a pull meant for this one.
            self.transport.on_blocks_reply(message, frames[1].buffer if len(frames) > 1 else None, peer)
        else:
            self.reports.rejected(messages.REJECT_UNEXPECTED, source)

    def _on_handshake(self, peer: Peer, reply: messages.HandshakeReply) -> None:
        peer.handshake_deadline = None
        peer.challenge = b""
        waiting, peer.waiting = peer.waiting, []
        error = reply.error
        if error is None and reply.compat_hash != self.compat_hash:
            error = "incompatible KV cache (model, dtype, block size or layout differ)"
            ours = dtype_name(self.transport.kv_cache.dtype)
            if reply.kv_dtype and reply.kv_dtype != ours:  # refused, not converted: set one --kv-cache-dtype
                error = f"incompatible KV cache: the remote engine stores {reply.kv_dtype}, this one {ours}"
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

    # ----- a pull's life ------------------------------------------------------------------------

    def _pulls_of(self, spec: LoadSpec) -> list[Pull]:
        """A load's pulls, one per prefill rank this rank reads KV heads from (``layout.read_plan``).
        The prefill ranks it reads nothing from learn at once that this rank is done with the blocks.
        A load that cannot be planned is reported failed (and released) here, with no pull."""
        remote = spec.remote
        load = Load(spec)
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
            pulls.append(Pull(spec, num_bytes, load, rank, heads))
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
                self.peers.drop(peer)
                peer = self._peer(address)
            if peer.engine_id is not None:
                self._transfer(pull, peer)
                return
            pull.move(PullState.HANDSHAKING)
            peer.waiting.append(pull)
            if peer.handshake_deadline is None:
                # The handshake has a deadline of its own; the transfer's starts when it does.
                peer.handshake_deadline = time.monotonic() + self.config.transfer_timeout
                peer.expected, peer.challenge = self._source_id(pull), messages.new_challenge()
                error = self.peers.send(peer, messages.Handshake(self.agent_id, peer.challenge), peer.expected)
                if error is not None:
                    self._handshake_failed(peer, error)
        except Exception as error:
            logger.exception("request %s: starting a KV pull", pull.spec.request_id)
            if pull.state in ENDED:  # it was reported before the failure: once is all
                return
            in_flight = self._forget_pull(pull)
            self._pull_done(pull, f"the pull could not start: {type(error).__name__}: {error}", in_flight=in_flight)

    @staticmethod
    def _source_id(pull: Pull) -> str:
        """The agent a pull reads from: its prefill rank's."""
        return rank_agent_id(pull.spec.remote.engine_id, pull.source_rank)

    def _transfer(self, pull: Pull, peer: Peer) -> None:
        assert peer.engine_id is not None
        pull.move(PullState.TRANSFERRING)
        pull.connection = peer
        pull.deadline = time.monotonic() + self.config.transfer_timeout
        self.transport.start_pull(pull, peer.socket, peer.engine_id)
        if self.faults.stall_after_read and not self._stalled:
            self._stalled = True
            time.sleep(self.faults.stall_after_read)

    def _forget_pull(self, pull: Pull) -> bool:
        """Take a pull out of every queue it may sit in (it is about to be reported); True if a
        write into its blocks may still land."""
        for peer in self.peers:
            if pull in peer.waiting:
                peer.waiting.remove(pull)
        if pull in self._delayed:
            self._delayed.remove(pull)
        return self.transport.discard(pull)

    def _handshake_failed(self, peer: Peer, error: str, dead: bool = True) -> None:
        """``dead``: the engine did not answer (as opposed to answering with a refusal)."""
        logger.warning("handshake with %s:%d failed: %s", *peer.address, error)
        waiting, peer.waiting = peer.waiting, []
        peer.handshake_deadline = None
        self.peers.drop(peer, dead=dead)
        for pull in waiting:
            self._pull_done(pull, f"handshake failed: {error}")

    def _cancel_pending(self, request_id: str) -> None:
        """The request ended: its pulls that have not started moving data are dropped. (One that
        has started drains first: its destination blocks stay allocated until then.)"""
        for queue in [self._delayed, *(peer.waiting for peer in self.peers)]:
            for pull in [p for p in queue if p.spec.request_id == request_id]:
                queue.remove(pull)
                self._pull_done(pull, "the request ended before its pull started", cancelled=True)

    def _start_delayed(self, now: float) -> None:
        if not self._delayed:
            return
        due = [pull for pull in self._delayed if pull.not_before <= now]
        if due:
            self._delayed = [pull for pull in self._delayed if pull.not_before > now]
            for pull in due:
                self._start_pull(pull)

    def _pull_done(self, pull: Pull, error: str | None, cancelled: bool = False, in_flight: bool = False) -> None:
        """A pull ended: its load is reported once its last pull ended; a pull that did not release its
        prefill rank (failed or cancelled) tells it to free. ``in_flight``: it failed while a write into
        its blocks may still land (the load is reported so, and again once the transport says every such
        write drained). Never raises but for a pull that ended already (a bug: it would count twice): the
        report is made first, and nothing after it can lose it."""
        spec = pull.spec
        if error is None and self.faults.fail_load:
            error = "failed by fault injection"
        pull.move(PullState.DONE if error is None else PullState.DRAINING if in_flight else PullState.FAILED)
        load = pull.load
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
        if peer is not None:
            if error is None:
                peer.suspect = False  # the connection works
            elif pull.peer_failed and not cancelled:
                # The engine may be dead or restarted: once nothing else runs on this connection,
                # the next pull from there hand-shakes afresh.
                peer.suspect = True
            if peer.suspect and not self.peers.in_use(peer):
                self.peers.drop(peer)
        if not pull.released:
            self._send_release(spec.remote, pull.source_rank)

    def _report_load(self, load: Load) -> None:
        """Every pull of a load ended: it landed (all did), or failed."""
        request_id = load.spec.request_id
        self._tracked.pop(request_id, None)
        if load.error is None:
            self.reports.finished_recving(request_id, load.num_bytes, time.monotonic() - load.started)
        else:
            self.reports.failed_recving(request_id, in_flight=bool(load.writing), fault=not load.cancelled)

    # ----- leases and releases ------------------------------------------------------------------

    def _peer(self, address: Address) -> Peer:
        if address not in self.peers and len(self.peers) >= MAX_PEER_SOCKETS:
            self.peers.reap(time.monotonic(), self._leased(), keep=MAX_PEER_SOCKETS - 1)
        return self.peers.open(address, time.monotonic())

    def _leased(self) -> set[Address]:
        """Addresses of the prefill ranks holding blocks for requests here: their connections carry renewals."""
        return {remote.rank_address(rank) for remote in self._tracked.values() for rank in range(remote.tp_size)}

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
            if self.peers.found_dead(address, time.monotonic()):
                error = "its engine was just found dead"
            else:
                try:
                    error = self.peers.send(self._peer(address), release, rank_agent_id(remote.engine_id, source))
                except zmq.ZMQError as exc:  # no socket could be made
                    error = str(exc)
            if error is not None:
                logger.info(
                    "request %s: could not tell %s:%d to free its blocks (%s); its lease will",
                    remote.request_id,
                    *address,
                    error,
                )
                self.reports.failed_release()

    def _renew_leases(self) -> None:
        by_agent: dict[tuple[Address, str], list[tuple[str, str]]] = {}
        for remote in self._tracked.values():
            for rank in range(remote.tp_size):  # every prefill rank holds the blocks
                agent = (remote.rank_address(rank), rank_agent_id(remote.engine_id, rank))
                by_agent.setdefault(agent, []).append((remote.request_id, remote.hold_token))
        for (address, receiver), holds in by_agent.items():
            peer = self._peer(address)
            # In slices that stay far below the peer's frame limit, however many requests wait.
            for start in range(0, len(holds), RENEWALS_PER_MESSAGE):
                renewal = messages.RenewLeases(holds[start : start + RENEWALS_PER_MESSAGE])
                error = self.peers.send(peer, renewal, receiver)
                if error is not None:
                    logger.info("lease renewal to %s:%d not sent: %s", *address, error)
                    break
