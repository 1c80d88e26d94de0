"""The router's loop-thread counters and histograms expose exactly what prometheus_client's own Counter and
Histogram do for the same updates (their ``_created`` times aside)."""

from __future__ import annotations

import re

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from pdserve.router import loop_metrics

BUCKETS = (0.005, 0.1, 1.0, 64.0, 131072.0)


def _text(registry: CollectorRegistry) -> str:
    return re.sub(r"(_created\{?[^ ]*) [0-9.e+]+", r"\1 T", generate_latest(registry).decode())


def _update(module, registry: CollectorRegistry) -> None:
    plain = module.Counter("demo_events", "Events", registry=registry)
    labelled = module.Counter("demo_errors", "Errors by kind", ["kind"], registry=registry)
    histogram = module.Histogram("demo_seconds", "Seconds", ["tenant"], buckets=BUCKETS, registry=registry)
    plain.inc()
    plain.inc(2.5)
    labelled.labels("timeout").inc()
    labelled.labels("broken").inc(3)
    labelled.labels("gone").inc()
    labelled.remove("gone")
    for value in (0.0, 0.005, 0.0051, 1.0, 99.0, 131072.0, 1e9):
        histogram.labels("a").observe(value)
    histogram.labels("b").observe(0.5)


def test_the_exposition_is_prometheus_clients():
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    _update(loop_metrics, ours)
    _update(prometheus_client, theirs)
    assert _text(ours) == _text(theirs)
    assert 'demo_seconds_bucket{le="+Inf",tenant="a"} 7.0' in _text(ours)


def test_misuse_is_refused():
    registry = CollectorRegistry()
    labelled = loop_metrics.Counter("demo_errors", "Errors by kind", ["kind"], registry=registry)
    with pytest.raises(ValueError):
        labelled.inc()  # a labelled counter counts through its children
    with pytest.raises(ValueError):
        labelled.labels("a", "b")
    with pytest.raises(ValueError):
        labelled.labels("a").inc(-1)
    with pytest.raises(ValueError):
        loop_metrics.Histogram("demo_bad", "Bad", buckets=(1.0, 0.5), registry=registry)
    with pytest.raises(ValueError):  # one name once per registry, as prometheus_client has it
        loop_metrics.Counter("demo_errors", "Again", registry=registry)
