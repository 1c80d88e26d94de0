"""The load a KV-event batch carries: read without taking the samples the metrics collect (publishing between two
stats leaves every pull timing to the next stats; before, each publish emptied them, and the
pdserve_kv_transfer_seconds histogram lost them), and published as soon as the queues change, not at the next idle
beat (routers admit by it: tests/router/test_pod_signals.py)."""

from __future__ import annotations

import msgspec
import zmq

from pdserve.api.kv_events import KVEventBatch
from pdserve.engine.kv_events import KVEventPublisher
from tests.engine.helpers import make_engine, make_request, prompt_of


def _subscribed(context, publisher: KVEventPublisher):
    """A subscriber that has joined (a PUB drops what it sends before the subscription arrives)."""
    subscriber = context.socket(zmq.SUB)
    subscriber.connect(f"tcp://127.0.0.1:{publisher.port}")
    subscriber.setsockopt(zmq.SUBSCRIBE, b"")
    for attempt in range(50):
        publisher.publish(now=1000.0 + attempt * 10)  # each past the idle beat: always sent
        if subscriber.poll(100):
            while subscriber.poll(0):
                subscriber.recv_multipart()
            return subscriber
    raise AssertionError("the subscriber never joined")


def _batches(subscriber) -> list[KVEventBatch]:
    found = []
    while subscriber.poll(50):
        found.append(msgspec.msgpack.decode(subscriber.recv_multipart()[-1], type=KVEventBatch))
    return found


def test_a_change_of_the_queues_is_published_at_once_and_an_unchanged_load_waits_for_the_beat():
    engine = make_engine(num_blocks=64, max_model_len=256)
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        publisher = KVEventPublisher(context, engine, "engine-1", "127.0.0.1", 0)
        subscriber = _subscribed(context, publisher)
        now = 2000.0
        publisher.publish(now)  # past the beat: the load as it is (idle)
        assert [b.load.num_waiting for b in _batches(subscriber)] == [0]
        publisher.publish(now + 0.01)
        assert _batches(subscriber) == []  # nothing changed, the beat is a second away
        engine.add_request(make_request("r1", prompt_of(5, 1), max_tokens=4))
        publisher.publish(now + 0.02)  # no block stored: only the queue changed
        assert [b.load.num_waiting for b in _batches(subscriber)] == [1]
    finally:
        context.destroy(linger=0)


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
