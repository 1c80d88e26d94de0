"""KVSubscriber: one asyncio task per pod that publishes KV-cache events, reading its ZMQ PUB socket into the
router's KVIndex (pdserve/router/kv_index.py).

Where a pod publishes comes from its /health answer (``kv_events_port``, read by pods.HealthChecker), with its
engine's id; the host is the pod's own. A batch is taken only if it names that engine and a sequence number
above the last one taken from it (with keys, both are under the batch's MAC): a stream relayed from another
pod, or an old batch sent again, changes nothing. A pod that leaves (discovery) is unsubscribed and forgotten;
one whose port or engine changes (a restarted engine) is subscribed afresh. ZMQ reconnects by itself to a
publisher that went away and came back on the same port. Bounded: at most ``RCVHWM`` batches wait in the
socket, and a frame over ``MAX_BATCH_BYTES`` makes ZMQ drop that connection (it reconnects) instead of
buffering it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection
from urllib.parse import urlsplit

import zmq
import zmq.asyncio

from pdserve.api.keys import KeyRing
from pdserve.api.kv_events import MAX_BATCH_BYTES, EventSigner, decode_batch
from pdserve.router.kv_index import KVIndex

logger = logging.getLogger(__name__)

RCVHWM = 1000  # batches queued per pod before ZMQ drops (the index then waits for a snapshot)
RECONNECT_IVL_MAX_MS = 5000


def events_endpoint(pod_url: str, port: int) -> str:
    """tcp://HOST:PORT for a pod at ``pod_url`` publishing on ``port``."""
    host = urlsplit(pod_url).hostname or "127.0.0.1"
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class KVSubscriber:
    def __init__(
        self,
        index: KVIndex,
        on_malformed: Callable[[], None] | None = None,
        keys: KeyRing[bytes] | None = None,
        on_batch: Callable[[], None] | None = None,
    ) -> None:
        """``on_malformed``: called for each message dropped (malformed, not signed with ``keys``, another
        engine's, or old); ``on_batch``: after each batch applied (a pod's load changed)."""
        self.index = index
        self.on_malformed = on_malformed
        self.on_batch = on_batch
        self.signer = EventSigner(keys) if keys is not None else None
        self._context: zmq.asyncio.Context | None = None
        # pod URL -> ((endpoint, engine id), reader)
        self._tasks: dict[str, tuple[tuple[str, str | None], asyncio.Task[None]]] = {}

    def endpoints(self) -> dict[str, str]:
        return {url: source[0] for url, (source, _) in self._tasks.items()}

    def follow(self, url: str, port: int | None, engine_id: str | None = None) -> None:
        """Subscribe to the engine ``engine_id`` at ``url`` publishing on ``port`` (None: it does not publish)."""
        endpoint = None if port is None else events_endpoint(url, port)
        current = self._tasks.get(url)
        if current is not None and current[0] == (endpoint, engine_id):
            return
        if current is not None:  # the pod's engine moved (restarted): its old picture goes with the old stream
            self._stop(url, current[1])
        if endpoint is None:
            self._tasks.pop(url, None)
            return
        if self._context is None:
            self._context = zmq.asyncio.Context()
        logger.info("following KV events of %s at %s", url, endpoint)
        self._tasks[url] = ((endpoint, engine_id), asyncio.create_task(self._read(url, endpoint, engine_id)))

    def retain(self, urls: Collection[str]) -> None:
        """Unsubscribe from, and forget, every pod not in ``urls`` (they left)."""
        for url in [url for url in self._tasks if url not in urls]:
            self._drop(url)
        for url in [url for url in self.index.pods if url not in urls]:
            self.index.forget(url)

    def _drop(self, url: str) -> None:
        self._stop(url, self._tasks.pop(url)[1])

    def _stop(self, url: str, reader: asyncio.Task[None]) -> None:
        reader.cancel()
        self.index.forget(url)

    async def close(self) -> None:
        tasks = [task for _, task in self._tasks.values()]
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._context is not None:
            self._context.term()
            self._context = None

    async def _read(self, url: str, endpoint: str, engine_id: str | None) -> None:
        assert self._context is not None
        socket = self._context.socket(zmq.SUB)
        try:
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.RCVHWM, RCVHWM)
            socket.setsockopt(zmq.MAXMSGSIZE, MAX_BATCH_BYTES)
            socket.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
            if endpoint.startswith("tcp://["):
                socket.setsockopt(zmq.IPV6, 1)
            socket.setsockopt(zmq.SUBSCRIBE, b"")
            socket.connect(endpoint)
            index = self.index
            last_seq = -1
            while True:
                frames = await socket.recv_multipart()
                if self.signer is not None:
                    frame = self.signer.batch(frames)
                else:
                    frame = frames[0] if len(frames) == 1 else None
                batch = decode_batch(frame) if frame is not None else None
                if batch is None or batch.engine_id != engine_id or batch.seq <= last_seq:
                    if self.on_malformed is not None:
                        self.on_malformed()
                    continue
                last_seq = batch.seq
                index.apply(url, batch)
                if self.on_batch is not None:
                    self.on_batch()
        except zmq.ZMQError as error:  # a bad endpoint: say so, keep routing without this pod's picture
            logger.warning("KV events of %s at %s: %s", url, endpoint, error)
        finally:
            socket.close(linger=0)
