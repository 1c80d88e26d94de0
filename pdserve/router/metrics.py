"""The router's Prometheus series (names are a contract: docs/contracts.md), in a registry of its own
so several routers can live in one process (tests) without clashing; updated on the event loop's thread only
(``loop_metrics``: no lock per update).

``pdserve_router_errors_total{kind}`` kinds:
- ``prefill_unreachable``, ``prefill_5xx``, ``prefill_bad_answer``, ``no_prefill`` (no prefill pod up): these
  send a request down the fallback path;
- ``decode_unreachable``: a decode pod refused or dropped the connection before answering;
- ``decode_unavailable``: a decode pod answered 503 (overloaded or draining); the request went to another;
- ``no_decode``: no decode pod could take the request (503);
- ``decode_broken``: a decode pod failed mid-answer (a stream: then continued elsewhere if it can be);
- ``stream_cut``: a stream that broke and could not be continued: the client's connection was ended;
- ``decode_hung``: a decode pod left rotation (its health probe failed) before its first byte; the request
  went to another;
- ``timeout``: request_timeout expired; ``client_disconnect``: the client left before the end.

Routing series: ``pdserve_router_choices_total{role,pod,policy}`` (policy: the routing that decided, or
``affinity``); ``pdserve_router_prefix_blocks_predicted_total{role}`` and ``..._realised_total{role}``: for legs
whose answer reported usage, the cached leading blocks the index predicted on the chosen pod and those the
engine reported (``usage.prompt_tokens_details.cached_tokens`` / block size; decode: whole answers, and
streamed ones that asked for ``include_usage``); ``pdserve_router_prefill_skipped_total``: requests sent
decode-only because the decode pod had nearly all the prompt cached; ``pdserve_router_retries_total``: decode
legs sent to another pod; KV-event health: batches, gaps, malformed frames, and per pod (at scrape time) the
index's size (the engine's pool, and each medium the pod reports: its KV tiers too) and stale flag.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.api.report import LATENCY_BUCKETS, TOKEN_BUCKETS, Report
from pdserve.router.kv_index import KVIndex
from pdserve.router.loop_metrics import Counter, CounterChild, Histogram

PATHS = ("disagg", "decode_only", "fallback")
ERROR_KINDS = (
    "prefill_unreachable",
    "prefill_5xx",
    "prefill_bad_answer",
    "no_prefill",
    "prefill_timeout",
    "no_compatible_prefill",
    "decode_rejected_params",
    "decode_unreachable",
    "decode_unavailable",
    "no_decode",
    "decode_broken",
    "stream_cut",
    "decode_hung",
    "timeout",
    "client_disconnect",
)
ROLES = ("prefill", "decode")
MIGRATION_CAUSES = ("broken", "stall", "engine_error", "drain")


class RouterMetrics:
    def __init__(self, index: KVIndex | None = None) -> None:
        self.registry = CollectorRegistry()
        requests = Counter(
            "pdserve_router_requests", "Generation requests by the path they took", ["path"], registry=self.registry
        )
        errors = Counter("pdserve_router_errors", "Failures the router saw, by kind", ["kind"], registry=self.registry)
        # Children are looked up once here, not per request (labels() costs a lock and a dict lookup).
        self.paths = {path: requests.labels(path) for path in PATHS}
        self.prefill_releases = Counter(
            "pdserve_router_prefill_releases",
            "Held prefill blocks the router asked a prefill pod to free (its client left between the legs), by outcome",
            ["outcome"],
            registry=self.registry,
        )
        self.errors = {kind: errors.labels(kind) for kind in ERROR_KINDS}
        self.prefix_sources = Counter(
            "pdserve_router_prefix_sources",
            "Prefill legs sent with a peer to read the prompt's leading KV from (a decode pod holding the last turn)",
            registry=self.registry,
        )
        self.peer_holds = Counter(
            "pdserve_router_peer_holds",
            "Decode legs answered by a pod asked to hold the finished turn for peer reads",
            registry=self.registry,
        )
        self.ejections = Counter(
            "pdserve_router_pod_ejections", "Pods taken out of rotation after failing", registry=self.registry
        )
        # What sizes the pools (a planner, the operator's autoscaler): arrivals, and each answered
        # request's lengths and latencies as its decode engine reported them (pdserve/api/report.py),
        # under the engines' names for lengths, so one query covers routers or engines.
        self.received = Counter(
            "pdserve_router_requests_received", "Generation requests received (read, parsed)", registry=self.registry
        )
        self.prompt_tokens = Histogram(
            "pdserve_request_prompt_tokens",
            "Prompt tokens of an answered request",
            buckets=TOKEN_BUCKETS,
            registry=self.registry,
        )
        self.generation_tokens = Histogram(
            "pdserve_request_generation_tokens",
            "Tokens generated for an answered request",
            buckets=TOKEN_BUCKETS,
            registry=self.registry,
        )
        self.ttft = Histogram(
            "pdserve_router_time_to_first_token_seconds",
            "Time to first token through the router: its arrival to the decode engine's first token",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tpot = Histogram(
            "pdserve_router_time_per_output_token_seconds",
            "Time per output token after the first, as the decode engine reported it",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.latency = Histogram(
            "pdserve_router_request_latency_seconds",
            "Generation request latency through the router, until the last byte",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._choices = Counter(
            "pdserve_router_choices",
            "Pods chosen, by role, pod and the policy that chose",
            ["role", "pod", "policy"],
            registry=self.registry,
        )
        self._choice_children: dict[tuple[str, str, str], CounterChild] = {}
        predicted = Counter(
            "pdserve_router_prefix_blocks_predicted",
            "Cached leading prompt blocks the index predicted on the chosen pod",
            ["role"],
            registry=self.registry,
        )
        realised = Counter(
            "pdserve_router_prefix_blocks_realised",
            "Cached leading prompt blocks the chosen pod's engine reported",
            ["role"],
            registry=self.registry,
        )
        self.predicted = {role: predicted.labels(role) for role in ROLES}
        self.realised = {role: realised.labels(role) for role in ROLES}
        self.prefill_skipped = Counter(
            "pdserve_router_prefill_skipped",
            "Requests sent decode-only: the decode pod had nearly all the prompt cached",
            registry=self.registry,
        )
        self.retries = Counter(
            "pdserve_router_retries", "Decode legs retried on another pod before any byte", registry=self.registry
        )
        migrations = Counter(
            "pdserve_router_migrations",
            "Streams continued on another decode pod, by why the leg ended (broken: connection lost or closed "
            "early; stall: no event within --token-deadline; engine_error: the engine's server error; drain: a "
            "draining engine handed it back)",
            ["cause"],
            registry=self.registry,
        )
        self.migrations = {cause: migrations.labels(cause) for cause in MIGRATION_CAUSES}
        self.migrations_across_revisions = Counter(
            "pdserve_router_migrations_across_revisions",
            "Streams continued on a decode pod of another model revision (KV compatibility hash) because none of "
            "theirs was left: the tokens after the break are that revision's",
            registry=self.registry,
        )
        self.malformed_events = Counter(
            "pdserve_router_kv_events_malformed",
            "KV-event frames dropped: malformed, oversized, not signed with events.key, naming another engine than "
            "the pod's /health, or older than the last taken",
            registry=self.registry,
        )
        if index is not None:
            self.registry.register(_IndexCollector(index))

    def observe_report(self, report: Report, before_decode_s: float) -> None:
        """An answered request's report; `before_decode_s`: from its arrival here until its decode leg was sent."""
        self.prompt_tokens.observe(report.prompt_tokens)
        self.generation_tokens.observe(report.completion_tokens)
        if report.ttft_s is not None:
            self.ttft.observe(before_decode_s + report.ttft_s)
        if report.tpot_s is not None:
            self.tpot.observe(report.tpot_s)

    def chose(self, role: str, pod: str, policy: str) -> None:
        key = (role, pod, policy)
        child = self._choice_children.get(key)
        if child is None:
            child = self._choice_children[key] = self._choices.labels(role, pod, policy)
        child.inc()

    def forget_pods(self, urls: set[str]) -> None:
        """Drop the per-pod series of pods that left (bounded cardinality under discovery churn)."""
        for key in [key for key in self._choice_children if key[1] not in urls]:
            del self._choice_children[key]
            self._choices.remove(*key)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _IndexCollector(Collector):
    """The KV index's state, read at scrape time (nothing to update per batch, no series left behind)."""

    def __init__(self, index: KVIndex) -> None:
        self.index = index

    def collect(self) -> Iterator[Metric]:
        index = self.index
        batches = CounterMetricFamily("pdserve_router_kv_event_batches", "KV-event batches applied")
        batches.add_metric([], index.num_batches)
        gaps = CounterMetricFamily(
            "pdserve_router_kv_event_gaps", "KV-event sequence gaps, joining a publisher mid-stream included"
        )
        gaps.add_metric([], index.num_gaps)
        blocks = GaugeMetricFamily(
            "pdserve_router_kv_index_blocks", "Block hashes the index holds per pod (its engine's pool)", labels=["pod"]
        )
        medium_blocks = GaugeMetricFamily(
            "pdserve_router_kv_index_medium_blocks",
            "Block hashes the index holds per pod and medium (engine: the pool; host, disk, shared: its KV tiers)",
            labels=["pod", "medium"],
        )
        stale = GaugeMetricFamily(
            "pdserve_router_kv_index_stale",
            "1 while a pod's index missed batches and waits for a snapshot",
            labels=["pod"],
        )
        for url, pod in list(index.pods.items()):
            blocks.add_metric([url], len(pod.hashes))
            for medium, held in pod.held().items():
                medium_blocks.add_metric([url, medium], len(held))
            stale.add_metric([url], 1.0 if pod.stale else 0.0)
        yield from (batches, gaps, blocks, medium_blocks, stale)
