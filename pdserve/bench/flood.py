"""A stranger's flood of KV side channels, for tests and benchmarks: the costliest junk a peer without keys can
send. Each frame is a fresh envelope addressed to the flooded agent, with a wrong MAC, of ``frame_bytes`` (the
largest the side channel takes costs its agent the most: an HMAC over all of it), sent from several connections
as fast as ZMQ takes them. Whatever comes back is counted: a side channel with keys never answers."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq

from pdserve.kvtransfer import messages


def junk_frame(receiver: str, frame_bytes: int) -> bytes:
    """A fresh envelope to ``receiver`` with a wrong MAC, ``frame_bytes`` long (the body fills what the envelope's
    other fields leave)."""
    body = b"\0" * max(0, frame_bytes - 200)
    return msgspec.msgpack.encode(messages.Envelope("stranger", receiver, time.time(), b"n" * 16, body, b"m" * 32))


class SideChannelFlood:
    """Floods each (endpoint ``tcp://host:port``, receiver agent id) of ``targets`` from ``connections``
    DEALERs, in a thread, from ``start()`` until ``close()``."""

    def __init__(self, targets: Sequence[tuple[str, str]], frame_bytes: int, connections: int = 4) -> None:
        self.context = zmq.Context()
        self.sent = 0
        self.answers = 0
        self._stop = threading.Event()
        self.frame_bytes = frame_bytes
        self._sockets: list[tuple[zmq.Socket[bytes], str]] = []
        for endpoint, receiver in targets:
            for _ in range(connections):
                socket = self.context.socket(zmq.DEALER)
                socket.setsockopt(zmq.LINGER, 0)
                socket.setsockopt(zmq.SNDHWM, 10000)
                socket.connect(endpoint)
                self._sockets.append((socket, receiver))
        self._thread = threading.Thread(target=self._run, name="side-channel-flood", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for socket, receiver in self._sockets:
                try:
                    # Fresh: refused for its MAC, after an HMAC, not for its age.
                    socket.send(junk_frame(receiver, self.frame_bytes), zmq.NOBLOCK)
                    self.sent += 1
                except zmq.Again:
                    time.sleep(0.0002)
                while socket.poll(0):
                    socket.recv_multipart()
                    self.answers += 1

    def start(self) -> SideChannelFlood:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
        self.context.destroy(linger=0)

    def __enter__(self) -> SideChannelFlood:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.close()


def flood_until(targets: Sequence[tuple[str, str]], frame_bytes: int, stop: Any) -> None:
    """Flood ``targets`` until the event ``stop`` is set (the body of a flooding process)."""
    with SideChannelFlood(targets, frame_bytes):
        stop.wait()
