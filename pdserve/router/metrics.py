"""The router's Prometheus series (names are a contract: shared/DESIGN.md §5), in a registry of its own
so several routers can live in one process (tests) without clashing.

``pdserve_router_errors_total{kind}`` kinds:
- ``prefill_unreachable``, ``prefill_5xx``, ``prefill_bad_answer``, ``no_prefill`` (no prefill pod up): these
  send a request down the fallback path;
- ``decode_unreachable``: a decode pod refused or dropped the connection before answering;
- ``decode_unavailable``: a decode pod answered 503 (overloaded or draining); the request went to another;
- ``no_decode``: no decode pod could take the request (503);
- ``decode_broken``: a decode pod failed mid-answer;
- ``timeout``: request_timeout expired; ``client_disconnect``: the client left before the end.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

PATHS = ("disagg", "decode_only", "fallback")
ERROR_KINDS = ("prefill_unreachable", "prefill_5xx", "prefill_bad_answer", "no_prefill", "decode_unreachable",
               "decode_unavailable", "no_decode", "decode_broken", "timeout", "client_disconnect")
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        requests = Counter("pdserve_router_requests", "Generation requests by the path they took",
                           ["path"], registry=self.registry)
        errors = Counter("pdserve_router_errors", "Failures the router saw, by kind", ["kind"],
                         registry=self.registry)
        # Children are looked up once here, not per request (labels() costs a lock and a dict lookup).
        self.paths = {path: requests.labels(path) for path in PATHS}
        self.errors = {kind: errors.labels(kind) for kind in ERROR_KINDS}
        self.ejections = Counter("pdserve_router_pod_ejections", "Pods taken out of rotation after failing",
                                 registry=self.registry)
        self.latency = Histogram("pdserve_router_request_latency_seconds",
                                 "Generation request latency through the router, until the last byte",
                                 buckets=_LATENCY_BUCKETS, registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
