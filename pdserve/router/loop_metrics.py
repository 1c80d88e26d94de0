"""Counters and histograms updated only on the router's event-loop thread, exposed through a prometheus_client
registry like its own.

Why: prometheus_client takes a lock for every increment (a histogram's observation takes two) and checks the
metric's state on each call; a P/D request updates about a dozen series, ~3% of the router's CPU per request
(``bench/router.py``). Everything that updates these runs on the loop's thread, so plain attributes suffice; a
scrape (also on the loop) reads them. The exposition is prometheus_client's: the same ``_total``, ``_bucket``,
``_sum``, ``_count`` and ``_created`` samples as its Counter and Histogram.
"""

from __future__ import annotations

import bisect
import math
import time
from abc import abstractmethod
from collections.abc import Iterator, Sequence
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString


class CounterChild:
    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("a counter only goes up")
        self.value += amount


class HistogramChild:
    __slots__ = ("_bounds", "counts", "created", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # per bucket, not cumulative; the last: above every bound (+Inf)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        self.counts[bisect.bisect_left(self._bounds, amount)] += 1
        self.sum += amount


ChildT = TypeVar("ChildT", CounterChild, HistogramChild)


class _Family(Collector, Generic[ChildT]):
    """One metric's children by label values (no labels: one child, under ``()``)."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], ChildT] = {}
        registry.register(self)

    def _child(self, values: tuple[str, ...]) -> ChildT:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name} has labels {self.labelnames}, given {values}")
            child = self._children[values] = self._new_child()
        return child

    @abstractmethod
    def _new_child(self) -> ChildT: ...

    def labels(self, *values: str) -> ChildT:
        return self._child(tuple(str(value) for value in values))

    def remove(self, *values: str) -> None:
        self._children.pop(tuple(str(value) for value in values), None)

    def describe(self) -> list[Metric]:
        return [self._family()]

    @abstractmethod
    def _family(self) -> Metric: ...


class Counter(_Family[CounterChild]):
    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str] = (), *, registry: CollectorRegistry
    ) -> None:
        super().__init__(name.removesuffix("_total"), documentation, labelnames, registry)
        self._unlabelled = self._child(()) if not self.labelnames else None

    def _new_child(self) -> CounterChild:
        return CounterChild()

    def inc(self, amount: float = 1.0) -> None:
        if self._unlabelled is None:
            raise ValueError(f"{self.name} has labels: inc() a child of labels()")
        self._unlabelled.inc(amount)

    def _family(self) -> CounterMetricFamily:
        return CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        for values, child in list(self._children.items()):
            family.add_metric(values, child.value, created=child.created)
        yield family


class Histogram(_Family[HistogramChild]):
    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        *,
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        bounds = tuple(float(bound) for bound in buckets if bound != math.inf)
        if list(bounds) != sorted(bounds) or not bounds:
            raise ValueError(f"{name}: buckets must be in increasing order")
        self._bounds = bounds
        super().__init__(name, documentation, labelnames, registry)
        self._unlabelled = self._child(()) if not self.labelnames else None

    def _new_child(self) -> HistogramChild:
        return HistogramChild(self._bounds)

    def observe(self, amount: float) -> None:
        if self._unlabelled is None:
            raise ValueError(f"{self.name} has labels: observe() on a child of labels()")
        self._unlabelled.observe(amount)

    def _family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        for values, child in list(self._children.items()):
            cumulative, buckets = 0, []
            for bound, count in zip((*self._bounds, math.inf), child.counts, strict=True):
                cumulative += count
                buckets.append((floatToGoString(bound), cumulative))
            family.add_metric(values, buckets, child.sum)
            family.add_sample(f"{self.name}_created", dict(zip(self.labelnames, values, strict=True)), child.created)
        yield family
