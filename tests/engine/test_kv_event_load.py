"""A KV-event batch reads the engine's load without taking the samples the metrics collect: publishing
between two stats leaves every pull timing to the next stats (before, each publish emptied them, and the
pdserve_kv_transfer_seconds histogram lost them)."""

from __future__ import annotations

import msgspec
import zmq

from pdserve.api.kv_events import KVEventBatch
from pdserve.engine.kv_events import KVEventPublisher
from tests.engine.helpers import make_engine


def test_publishing_kv_events_leaves_the_metrics_samples_alone():
    engine = make_engine(num_blocks=64, max_model_len=256)
    engine.scheduler.remote_kv._kv_transfer_seconds.append(0.25)
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        subscriber = context.socket(zmq.SUB)
        publisher = KVEventPublisher(context, engine, "engine-1", "127.0.0.1", 0)
        subscriber.connect(f"tcp://127.0.0.1:{publisher.port}")
        subscriber.setsockopt(zmq.SUBSCRIBE, b"")
        batch = None
        for attempt in range(50):  # a PUB drops what it sends before the subscription arrives
            publisher.publish(now=1000.0 + attempt * 10)
            if subscriber.poll(100):
                batch = msgspec.msgpack.decode(subscriber.recv_multipart()[-1], type=KVEventBatch)
                break
        assert batch is not None and batch.load.num_running == 0
        stats = engine.make_stats()
        assert stats.remote_kv.kv_transfer_seconds == [0.25]
    finally:
        context.destroy(linger=0)
