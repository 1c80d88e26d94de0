"""Peers: the decode side's connections to remote agents' side channels, one DEALER socket per address,
and what each one's handshake said.

The pool is bounded: at most ``MAX_PEER_SOCKETS`` open, one unused for ``PEER_IDLE_S`` is closed, so
naming many peers (or a client naming junk addresses) never runs the process out of descriptors; a send
never blocks (``PEER_SEND_HWM`` queued, then it fails); and an address whose engine was found dead gets
no new socket just to carry a release for ``DEAD_PEER_MEMORY_S``. Dropping a connection forgets the
transport's state of that peer too, so the next use hand-shakes afresh. Runs in the agent's thread only.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import zmq

from pdserve.kvtransfer import messages
from pdserve.kvtransfer.transport.base import Transport

if TYPE_CHECKING:
    from pdserve.kvtransfer.pulls import Pull

logger = logging.getLogger(__name__)

MAX_PEER_SOCKETS = 128
PEER_IDLE_S = 60.0
# How long an address whose engine was dropped as dead gets no new socket just to carry a release.
DEAD_PEER_MEMORY_S = 30.0
MAX_DEAD_PEERS = 1024
# Messages queued per peer socket before sends fail instead of blocking the agent thread.
PEER_SEND_HWM = 1000

Address = tuple[str, int]


@dataclass
class Peer:
    """A remote engine's side channel, and what its handshake told us."""

    address: Address
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


class Peers:
    def __init__(
        self,
        context: zmq.Context[zmq.Socket[bytes]],
        poller: zmq.Poller,
        seal: messages.Seal,
        transport: Transport,
        transport_peers: bool = True,
    ) -> None:
        """New sockets come from ``context`` and are polled by the agent's ``poller``; messages are sealed
        with ``seal``. ``transport_peers``: the transport keeps state per connection (a pull's handshake), which
        dropping one forgets (peer reads keep none)."""
        self._context = context
        self._poller = poller
        self.seal = seal
        self.transport = transport
        self.transport_peers = transport_peers
        self._open: dict[Address, Peer] = {}
        # Addresses whose engine was dropped as dead, until when: no socket is opened just to send them a release.
        self._dead: OrderedDict[Address, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._open)

    def __contains__(self, address: Address) -> bool:
        return address in self._open

    def __iter__(self) -> Iterator[Peer]:
        """The open connections (a copy: iterating may drop some)."""
        return iter(list(self._open.values()))

    def is_current(self, peer: Peer) -> bool:
        """Whether ``peer`` is still the open connection to its address (not dropped, nor replaced)."""
        return self._open.get(peer.address) is peer

    def on_socket(self, socket: zmq.Socket[bytes]) -> Peer | None:
        return next((peer for peer in self._open.values() if peer.socket is socket), None)

    def open(self, address: Address, now: float) -> Peer:
        """The connection to ``address``, opened if there is none (room for it is the caller's: ``reap``)."""
        peer = self._open.get(address)
        if peer is None:
            socket = self._context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            # A reply is at most the blocks one pull asks for, and no pull asks for more than this
            # engine's whole cache (its length is then checked against what that pull asked).
            max_reply = self.transport.num_blocks * self.transport.block_bytes + messages.MAX_MESSAGE_BYTES
            socket.setsockopt(zmq.MAXMSGSIZE, max_reply)
            socket.setsockopt(zmq.SNDHWM, PEER_SEND_HWM)
            socket.connect(f"tcp://{address[0]}:{address[1]}")
            self._poller.register(socket, zmq.POLLIN)
            peer = self._open[address] = Peer(address, socket)
        peer.last_used = now
        # Talked to for real work (a pull, renewals): whatever was found dead there before, it is
        # worth a release again (a restarted engine listens at the same address).
        self._dead.pop(address, None)
        return peer

    def found_dead(self, address: Address, now: float) -> bool:
        """Whether ``address`` has no connection and its engine was found dead lately."""
        return address not in self._open and self._dead.get(address, 0.0) > now

    def drop(self, peer: Peer, dead: bool = True) -> None:
        """Forget one connection to a remote engine (dead, restarted, refused, or idle when not
        ``dead``): the next use hand-shakes afresh. Only that connection: a newer one to the same
        address is left alone."""
        if not self.is_current(peer):
            return
        del self._open[peer.address]
        self._poller.unregister(peer.socket)
        peer.socket.close(linger=0)
        try:
            if self.transport_peers:
                self.transport.forget_peer(peer.address)
        except Exception:
            logger.exception("forgetting the transport's state of %s:%d", *peer.address)
        if dead:
            self._dead[peer.address] = time.monotonic() + DEAD_PEER_MEMORY_S
            self._dead.move_to_end(peer.address)
            while len(self._dead) > MAX_DEAD_PEERS:
                self._dead.popitem(last=False)

    def in_use(self, peer: Peer) -> bool:
        return bool(peer.waiting or peer.handshake_deadline is not None or self.transport.pulls_on(peer))

    def reap(self, now: float, leased: set[Address], keep: int = MAX_PEER_SOCKETS) -> None:
        """Close connections nothing uses: those idle for PEER_IDLE_S, and the least recently used
        beyond ``keep``. (A connection to a ``leased`` address is in use: renewals go through it.)
        Forget dead addresses whose time is up."""
        idle = sorted(
            (p for p in self._open.values() if p.address not in leased and not self.in_use(p)),
            key=lambda p: p.last_used,
        )
        excess = len(self._open) - keep
        for peer in idle:
            if excess > 0 or now - peer.last_used >= PEER_IDLE_S:
                self.drop(peer, dead=False)
                excess -= 1
        while self._dead and next(iter(self._dead.values())) <= now:
            self._dead.popitem(last=False)

    def send(self, peer: Peer, message: messages.SideChannelMessage, receiver: str) -> str | None:
        """Send to agent ``receiver`` without blocking; the error if the connection cannot take it now (its
        queue is full: the peer is dead or hung)."""
        try:
            peer.socket.send(self.seal.seal(message, receiver), zmq.NOBLOCK)
        except zmq.ZMQError as error:
            return f"the side channel to {peer.address[0]}:{peer.address[1]} is not taking messages ({error})"
        return None

    def close(self) -> None:
        for peer in self._open.values():
            peer.socket.close(linger=0)
