"""ConnectionCaps: how many connections a side channel takes, from one peer address and in all.

ZMQ buffers what a connection sends before the agent reads it (at most ``RCVHWM`` frames of at most
``MAXMSGSIZE`` bytes a connection, both set small on the side channel), so what a stranger can make an engine
hold before anything is authenticated is bounded by the number of its connections. This caps that number.

The socket's monitor says when a connection is accepted (its file descriptor) and when it is gone. A
connection over the caps (``per_peer`` live ones from its address, or ``total`` in all) is shut down at once;
ZMQ then sees it end and closes it. No frame of a connection is delivered before it was counted: the socket has
a ZAP domain, so ZMQ holds each new connection's handshake until the ZAP handler here answers, and that answer
comes only after every monitor event before it was read (a connection is accepted before its handshake).
Both run in the transfer agent's thread, polled with its other sockets.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections import Counter

import zmq
from zmq.utils.monitor import recv_monitor_message

logger = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # ZMQ's fixed address for a context's ZAP handler
ZAP_DOMAIN = b"pdserve-side-channel"
DEFAULT_PER_PEER = 64  # a decode engine opens one connection per rank: far below this
DEFAULT_TOTAL = 4096


class ConnectionCaps:
    def __init__(
        self,
        context: zmq.Context[zmq.Socket[bytes]],
        server: zmq.Socket[bytes],
        per_peer: int = DEFAULT_PER_PEER,
        total: int = DEFAULT_TOTAL,
    ) -> None:
        """Caps the connections of ``server``; call before it binds."""
        self.per_peer = per_peer
        self.total = total
        self.refused = 0
        self.port = 0  # the server's port: an accepted connection's local port (set once it is bound)
        self._live: Counter[str] = Counter()  # peer address -> live connections let in
        self._fds: dict[int, str] = {}  # a let-in connection's descriptor -> its peer address
        self.zap = context.socket(zmq.REP)
        self.zap.setsockopt(zmq.LINGER, 0)
        self.zap.bind(ZAP_ENDPOINT)
        server.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        self.monitor = server.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)

    @property
    def sockets(self) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
        return self.monitor, self.zap

    def live(self, address: str | None = None) -> int:
        """Connections let in and not gone (from ``address``, or in all)."""
        return self._live[address] if address is not None else len(self._fds)

    def handle(self) -> None:
        """Read every pending monitor event, then answer every pending ZAP request (never blocks)."""
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            self._on_event(int(event["event"]), int(event["value"]))
        while self.zap.poll(0):
            request = self.zap.recv_multipart()
            if len(request) >= 2:  # every connection still open was let in: the cut ones are gone
                self.zap.send_multipart([request[0], request[1], b"200", b"OK", b"", b""])

    def _on_event(self, event: int, descriptor: int) -> None:
        if event == zmq.EVENT_DISCONNECTED:
            address = self._fds.pop(descriptor, None)
            if address is not None:
                self._live[address] -= 1
                if self._live[address] <= 0:
                    del self._live[address]
            return
        if event != zmq.EVENT_ACCEPTED:
            return
        address = self._admit(descriptor)
        if address is not None:
            self._fds[descriptor] = address
            self._live[address] += 1

    def _admit(self, descriptor: int) -> str | None:
        """The peer address of a newly accepted connection, or None when it was cut (over a cap, or gone)."""
        try:
            duplicate = os.dup(descriptor)
        except OSError:
            return None
        with socket.socket(fileno=duplicate) as connection:
            try:
                # Gone and its number reused by another socket (only ours have this local port)? Leave it be.
                if connection.getsockname()[1] != self.port:
                    return None
                address = str(connection.getpeername()[0])
            except OSError:
                return None
            if self._live[address] < self.per_peer and len(self._fds) < self.total:
                return address
            self.refused += 1
            if self.refused == 1 or self.refused % 1000 == 0:
                logger.warning("side channel: cut a connection from %s (%d refused so far)", address, self.refused)
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)  # ZMQ sees it end and closes it
        return None

    def close(self) -> None:
        self.monitor.close(linger=0)
        self.zap.close(linger=0)
