"""What a PDService's routers saw over the last interval: the autoscaler's measured input.

A `Window` holds the arrivals and, as histograms (`Buckets`), the answered requests' prompt and
generated lengths and their TTFT and TPOT (the routers' series, docs/contracts.md). Two sources:

- `RouterScraper`: every Ready router pod's /metrics read directly and summed. Counters are
  cumulative, so a window is the difference from the previous read, pod by pod: a pod whose
  counters went down restarted (its whole count is new); a pod first seen gives its baseline
  only (its traffic before the first read is not in any window). The first read gives no window.
- `PrometheusQuery`: `increase(...[interval])` of the same series, summed over the routers
  Prometheus scrapes (`sum by (le)` for histograms); Prometheus handles resets and new pods.
"""

from __future__ import annotations

import json
import logging
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.operator.scrape import each_pod, samples
from pdserve.planner.workload import Buckets

logger = logging.getLogger(__name__)

RECEIVED = "pdserve_router_requests_received_total"
# Window field -> the histogram's name (its _bucket series hold the cumulative counts by `le`).
HISTOGRAMS = {
    "prompt": "pdserve_request_prompt_tokens",
    "generation": "pdserve_request_generation_tokens",
    "ttft": "pdserve_router_time_to_first_token_seconds",
    "tpot": "pdserve_router_time_per_output_token_seconds",
}
QUERY_TIMEOUT_S = 10.0


@dataclass
class Window:
    seconds: float
    arrivals: float
    prompt: Buckets
    generation: Buckets
    ttft: Buckets
    tpot: Buckets

    @property
    def rate(self) -> float:
        return self.arrivals / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        """What the status shows of it."""
        found: dict[str, Any] = {
            "windowSeconds": round(self.seconds, 1),
            "arrivalRate": round(self.rate, 3),
            "meanPromptTokens": round(self.prompt.mean(), 1),
            "meanOutputTokens": round(self.generation.mean(), 1),
        }
        if self.ttft.total:
            found["measuredTTFTp50"] = round(self.ttft.quantile(0.5), 4)
        if self.tpot.total:
            found["measuredTPOTp50"] = round(self.tpot.quantile(0.5), 4)
        return found


# One pod's cumulative counts: the arrivals counter, and per histogram its buckets by upper bound.
@dataclass
class Counts:
    received: float = 0.0
    buckets: dict[str, dict[float, float]] = field(default_factory=dict)

    @classmethod
    def read(cls, found: Sequence[tuple[str, dict[str, str], float]]) -> Counts:
        counts = cls(buckets={key: {} for key in HISTOGRAMS})
        by_name = {f"{name}_bucket": key for key, name in HISTOGRAMS.items()}
        for name, labels, value in found:
            if name == RECEIVED:
                counts.received += value
            elif name in by_name and "le" in labels:
                bound = float(labels["le"])
                histogram = counts.buckets[by_name[name]]
                histogram[bound] = histogram.get(bound, 0.0) + value
        return counts

    def went_down_from(self, earlier: Counts) -> bool:
        """Whether some count is below the earlier one's: the process restarted in between."""
        if self.received < earlier.received:
            return True
        return any(
            self.buckets[key].get(bound, 0.0) < value
            for key, histogram in earlier.buckets.items()
            for bound, value in histogram.items()
        )

    def minus(self, earlier: Counts | None) -> Counts:
        if earlier is None or self.went_down_from(earlier):
            return self
        return Counts(
            self.received - earlier.received,
            {
                key: {bound: value - earlier.buckets[key].get(bound, 0.0) for bound, value in histogram.items()}
                for key, histogram in self.buckets.items()
            },
        )


def summed(parts: Sequence[Counts]) -> Counts:
    total = Counts(buckets={key: {} for key in HISTOGRAMS})
    for part in parts:
        total.received += part.received
        for key, histogram in part.buckets.items():
            for bound, value in histogram.items():
                total.buckets[key][bound] = total.buckets[key].get(bound, 0.0) + value
    return total


def window_of(counts: Counts, seconds: float) -> Window:
    return Window(
        seconds,
        counts.received,
        **{key: Buckets.from_cumulative(counts.buckets[key]) for key in HISTOGRAMS},
    )


class RouterScraper:
    """Windows from the router pods' own /metrics (what it read last is kept in between)."""

    def __init__(self) -> None:
        self.previous: dict[str, Counts] = {}
        self.previous_time: float | None = None

    def window(self, pods: Sequence[Mapping[str, Any]], now: float) -> Window | None:
        """The window since the last call (None on the first, or when no router could be read)."""

        def read(name: str, url: str) -> Counts | None:
            try:
                return Counts.read(samples(url))
            except (OSError, ValueError) as error:
                logger.info("could not read router pod %s's metrics: %s", name, error)
                return None

        current = each_pod(pods, read)
        if not current:
            return None
        deltas = [counts.minus(self.previous[name]) for name, counts in current.items() if name in self.previous]
        earlier = self.previous_time
        self.previous, self.previous_time = current, now
        if earlier is None or not deltas:
            return None
        return window_of(summed(deltas), now - earlier)


class PrometheusQuery:
    """Windows from a Prometheus server's view of the routers' series (`selector`: its label matchers)."""

    def __init__(self, url: str, selector: str) -> None:
        self.url = url.rstrip("/")
        self.selector = selector

    def _query(self, expression: str) -> list[dict[str, Any]]:
        address = f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': expression})}"
        with urllib.request.urlopen(address, timeout=QUERY_TIMEOUT_S) as response:
            answer = json.loads(response.read())
        if answer.get("status") != "success":
            raise ValueError(f"Prometheus refused {expression!r}: {answer.get('error')}")
        result: list[dict[str, Any]] = answer["data"]["result"]
        return result

    def window(self, seconds: float) -> Window:
        span = f"[{max(1, round(seconds))}s]"
        counts = Counts(buckets={key: {} for key in HISTOGRAMS})
        for item in self._query(f"sum(increase({RECEIVED}{self.selector}{span}))"):
            counts.received += float(item["value"][1])
        for key, name in HISTOGRAMS.items():
            for item in self._query(f"sum by (le) (increase({name}_bucket{self.selector}{span}))"):
                counts.buckets[key][float(item["metric"]["le"])] = float(item["value"][1])
        return window_of(counts, seconds)


def default_selector(namespace: str, name: str) -> str:
    """The routers' series as Prometheus usually labels a pod's: by namespace and pod name."""
    return f'{{namespace="{namespace}",pod=~"{name}-router-.*"}}'
