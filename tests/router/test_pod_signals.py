"""Saturation from the pods' own signals (pdserve/router/admission.py ``PodSignals``), driven exactly: a KVIndex
with the loads the pods last published, and the router's record of when it last sent each pod a request.

The case that mattered: an engine whose prompts all hit its prefix cache stores no new blocks, so before its
engine published each change of its queues, its only signal was the once-a-second idle beat, and a router
counting every admission since a pod's last signal admitted ``--saturation-queue`` requests per pod per second:
32 concurrent streams of a repeated prompt set went in groups of 5 a second (tests/chaos/test_migration_chaos.py
found it)."""

from __future__ import annotations

import time

from pdserve.api.kv_events import EngineLoad
from pdserve.router.admission import PodSignals
from pdserve.router.kv_index import KVIndex, PodIndex
from pdserve.router.pods import PodSet

QUEUE_LIMIT = 5


def _signals(decode_urls: list[str], loads: dict[str, tuple[EngineLoad, float]]) -> tuple[PodSignals, PodSet]:
    """Signals over decode pods (no prefill pods) whose last batch said ``load``, ``age`` seconds ago."""
    decode = PodSet("decode", decode_urls)
    index = KVIndex()
    now = time.monotonic()
    for url, (load, age) in loads.items():
        index.pods[url] = PodIndex("engine-" + url[-1], load=load, updated=now - age)
    return PodSignals(PodSet("prefill", []), decode, index, QUEUE_LIMIT, 0.9), decode


def _admitted_at(times: list[float]):
    return lambda since: sum(1 for t in times if t > since)


def test_a_pod_sent_nothing_since_its_signal_holds_no_admission_back():
    idle = EngineLoad(0, 0, 0, 0.1, 0)
    signals, decode = _signals(["http://a:1", "http://b:2"], {"http://a:1": (idle, 0.9), "http://b:2": (idle, 0.02)})
    now = time.monotonic()
    admitted = [now - 0.5] * 20  # sent half a second ago, all to b, whose signal since counts them
    decode.pods[1].sent_at = now - 0.5
    saturation = signals(_admitted_at(admitted))
    assert saturation.stage is None and saturation.headroom == 2 * QUEUE_LIMIT


def test_requests_sent_after_a_pods_signal_count_against_the_headroom_until_it_signals_again():
    idle = EngineLoad(0, 0, 0, 0.1, 0)
    signals, decode = _signals(["http://a:1", "http://b:2"], {"http://a:1": (idle, 0.9), "http://b:2": (idle, 0.02)})
    now = time.monotonic()
    decode.pods[0].sent_at = now - 0.5  # after a's signal: a has not told of it yet
    admitted = [now - 0.5] * (2 * QUEUE_LIMIT)
    saturation = signals(_admitted_at(admitted))
    assert saturation.stage == "decode" and saturation.headroom == 0


def test_admissions_after_every_signal_count_though_none_was_sent_yet():
    """A burst admitted at once, before any leg went out, cannot all go: the newest signal is the line."""
    idle = EngineLoad(0, 0, 0, 0.1, 0)
    signals, _ = _signals(["http://a:1"], {"http://a:1": (idle, 0.3)})
    admitted = [time.monotonic()] * 3
    saturation = signals(_admitted_at(admitted))
    assert saturation.stage is None and saturation.headroom == QUEUE_LIMIT - 3
    admitted *= 2
    assert signals(_admitted_at(admitted)).stage == "decode"


def test_waiting_queues_and_kv_usage_saturate_a_pod():
    full = EngineLoad(4, QUEUE_LIMIT, 0, 0.5, 0)
    cache_full = EngineLoad(4, 0, 0, 0.95, 0)
    signals, _ = _signals(["http://a:1", "http://b:2"], {"http://a:1": (full, 0.1), "http://b:2": (cache_full, 0.1)})
    assert signals(_admitted_at([])).stage == "decode"


def test_a_pod_without_a_recent_signal_leaves_its_stage_unsaturated():
    full = EngineLoad(4, QUEUE_LIMIT, 0, 0.5, 0)
    signals, _ = _signals(["http://a:1"], {"http://a:1": (full, 10.0)})
    assert signals(_admitted_at([])).stage is None
