"""Prometheus metrics of an engine server (names are a contract: docs/contracts.md).

Request-level series (finish reasons, TTFT, TPOT, end-to-end latency) are observed by the API
process as responses finish. Scheduler state (queues, KV usage, prefix-cache and preemption
totals) lives in the core and arrives with every output message; a collector turns the latest
snapshot into series at scrape time, so nothing is double-counted and nothing goes stale.
Engines also export the vLLM-named series that Gateway API inference extensions and autoscalers
scrape, so pdserve pods can sit behind an InferencePool like vLLM pods.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric

from pdserve.api.report import LATENCY_BUCKETS, TOKEN_BUCKETS
from pdserve.engine.core_process import CpuShare
from pdserve.engine.stats import SchedulerStats

# 1, 2, 5, 10, 20, 50, ... up to a million tokens.
_VLLM_TOKEN_BUCKETS = tuple(float(mantissa * 10**exponent) for exponent in range(7) for mantissa in (1, 2, 5))[:-2]


_FAST_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)


class _SchedulerCollector:
    def __init__(
        self,
        stats: Callable[[], SchedulerStats | None],
        cache_config: dict[str, str],
        cpu: CpuShare | None,
        startup: tuple[list[tuple[str, float]], float],
    ) -> None:
        self._stats = stats
        self._cache_config = cache_config
        self._cpu = cpu
        self._startup_phases, self._startup_seconds = startup

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        if self._startup_seconds:
            phases = GaugeMetricFamily(
                "pdserve_startup_phase_seconds",
                "Seconds each phase of the engine's start took (load_weights, profile_memory, allocate_kv_cache, "
                "warm_up)",
                labels=["phase"],
            )
            for name, seconds in self._startup_phases:
                phases.add_metric([name], seconds)
            yield phases
            yield GaugeMetricFamily(
                "pdserve_startup_seconds",
                "Seconds the engine took to start, phases and all",
                value=self._startup_seconds,
            )
        if self._cpu is not None:
            cpu = self._cpu
            now = stats.compute_threads if stats is not None and stats.compute_threads is not None else cpu.threads
            yield GaugeMetricFamily(
                "pdserve_cpu_compute_threads",
                "Compute threads of each rank now (CPU engines; fewer while other processes take the CPUs)",
                value=now,
            )
            yield GaugeMetricFamily(
                "pdserve_cpu_thread_budget",
                "Compute threads of each rank from affinity, CPU quota or the settings (the most it runs)",
                value=cpu.threads,
            )
            yield GaugeMetricFamily(
                "pdserve_cpu_quota_cores", "CPUs of the cgroup's CPU quota (0: none)", value=cpu.cpu_quota
            )
            yield GaugeMetricFamily(
                "pdserve_memory_limit_bytes", "The cgroup's memory limit (0: none)", value=cpu.memory_limit
            )
        if stats is None:
            return
        remote_kv = stats.remote_kv
        gauges = {
            "pdserve_num_requests_running": ("Requests being computed", stats.num_running),
            "pdserve_num_requests_waiting": ("Requests queued", stats.num_waiting),
            "pdserve_num_requests_waiting_for_remote_kv": (
                "Requests waiting for remote KV blocks",
                stats.num_waiting_for_remote_kvs,
            ),
            "pdserve_kv_cache_usage_ratio": (
                "Fraction of KV blocks owned (cached free blocks, and blocks only held for peer reads, count as free)",
                stats.kv_cache_usage,
            ),
            "pdserve_kv_blocks_held_for_remote": (
                "KV blocks held for remote decode",
                remote_kv.num_blocks_held_for_remote,
            ),
            "pdserve_kv_blocks_held_for_peers": (
                "KV blocks of finished turns held for peer reads (--kv-peer-hold-seconds)",
                remote_kv.num_blocks_held_for_peers,
            ),
            "pdserve_num_requests_waiting_for_grammar": (
                "Requests whose structured-output grammar is compiling",
                stats.num_waiting_for_grammar,
            ),
            "pdserve_kv_blocks_quarantined": (
                "KV blocks of abandoned loads kept out of use until no write into them can land",
                remote_kv.num_blocks_quarantined,
            ),
            "pdserve_state_slots_used": (
                "Linear-attention state slots owned by requests (hybrid models; 0 otherwise)",
                stats.num_state_slots_used,
            ),
            "pdserve_state_slots_held_for_remote": (
                "State slots of finished prefill legs held for remote decode (hybrid models)",
                remote_kv.num_state_slots_held_for_remote,
            ),
            "vllm:num_requests_running": ("Requests being computed (vLLM name)", stats.num_running),
            "vllm:num_requests_waiting": ("Requests queued (vLLM name)", stats.num_waiting),
            "vllm:kv_cache_usage_perc": ("KV cache usage, 1 = full (vLLM name)", stats.kv_cache_usage),
        }
        for name, (documentation, value) in gauges.items():
            yield GaugeMetricFamily(name, documentation, value=value)
        counters = {
            "pdserve_prefix_cache_queries": ("Prompt tokens looked up in the prefix cache", stats.prefix_cache_queries),
            "pdserve_prefix_cache_hits": ("Prompt tokens served from the prefix cache", stats.prefix_cache_hits),
            "pdserve_preemptions": ("Requests preempted (recomputed later)", stats.num_preemptions),
            "pdserve_kv_transfer_bytes": ("KV bytes pulled from remote engines", remote_kv.kv_transfer_bytes),
            "pdserve_kv_transfer_failures": (
                "KV pulls that failed (handshake, transfer, stale or expired blocks)",
                remote_kv.kv_transfer_failures,
            ),
            "pdserve_kv_lease_expirations": (
                "Held KV blocks freed because no decode engine took them in time",
                remote_kv.kv_lease_expirations,
            ),
            "pdserve_kv_release_failures": (
                "Release notifications to prefill engines that could not be sent (their leases free the blocks)",
                remote_kv.kv_release_failures,
            ),
            "pdserve_kv_holds_refused": (
                "Finished prefill legs whose blocks were not held (the held share was at --kv-max-held-fraction)",
                remote_kv.kv_holds_refused,
            ),
            "pdserve_kv_peer_served_bytes": (
                "KV bytes this engine served to peer reads",
                remote_kv.kv_peer_served_bytes,
            ),
            "pdserve_grammar_compile_failures": (
                "Structured-output grammars that failed to compile or ran out of time (their requests got a 400)",
                stats.grammar_compile_failures,
            ),
            "pdserve_kv_loads_abandoned": (
                "KV loads the scheduler's watchdog failed because the transfer agent never reported them",
                remote_kv.kv_loads_abandoned,
            ),
            "pdserve_kv_quarantines_overdue": (
                "Quarantines of abandoned KV loads still unreported past 3 x --kv-transfer-timeout: their blocks stay "
                "out of use (leaked) until the transfer agent reports the load, since a late write may still land",
                remote_kv.kv_quarantines_overdue,
            ),
        }
        for name, (documentation, value) in counters.items():
            yield CounterMetricFamily(name, documentation, value=value)
        rejected = CounterMetricFamily(
            "pdserve_kv_side_channel_rejected",
            "Side-channel frames refused (oversized, malformed, misaddressed, stale, unauthenticated, replayed, "
            "unexpected), by reason",
            labels=["reason"],
        )
        for reason, count in sorted(remote_kv.kv_side_channel_rejected.items()):
            rejected.add_metric([reason], count)
        yield rejected
        dropped = CounterMetricFamily(
            "pdserve_kv_peer_holds_dropped",
            "Holds for peer reads ended before their time, by reason (room: a request needed the blocks; cap: the "
            "held share was full; too_large: one request's blocks alone were over the share)",
            labels=["reason"],
        )
        for reason, count in sorted(remote_kv.kv_peer_holds_dropped.items()):
            dropped.add_metric([reason], count)
        yield dropped
        yield from _tier_metrics(stats)
        yield InfoMetricFamily("vllm:cache_config", "KV cache configuration (vLLM name)", value=self._cache_config)


def _tier_metrics(stats: SchedulerStats) -> Iterator[Metric]:
    """Each KV tier's series, labelled by medium (none without tiers)."""
    tiers = sorted(stats.kv_tiers.items())
    gauges = (
        ("pdserve_kv_tier_blocks", "KV blocks a tier holds", "num_blocks"),
        ("pdserve_kv_tier_bytes", "Bytes of KV blocks a tier holds", "num_bytes"),
        ("pdserve_kv_tier_capacity_bytes", "A tier's size bound", "capacity_bytes"),
    )
    for name, documentation, attribute in gauges:
        gauge = GaugeMetricFamily(name, documentation, labels=["medium"])
        for medium, tier in tiers:
            gauge.add_metric([medium], getattr(tier, attribute))
        yield gauge
    counters = (
        ("pdserve_kv_tier_hit_tokens", "Prompt tokens loaded from a tier instead of computed", "hit_tokens"),
        ("pdserve_kv_tier_stored_bytes", "KV bytes stored into a tier", "stored_bytes"),
        ("pdserve_kv_tier_loaded_bytes", "KV bytes loaded from a tier", "loaded_bytes"),
        ("pdserve_kv_tier_evictions", "Blocks a tier dropped for room or past --kv-tier-max-age", "evictions"),
        (
            "pdserve_kv_tier_loads_declined",
            "Tier hits not loaded because recomputing them was estimated faster",
            "loads_declined",
        ),
    )
    for name, documentation, attribute in counters:
        counter = CounterMetricFamily(name, documentation, labels=["medium"])
        for medium, tier in tiers:
            counter.add_metric([medium], getattr(tier, attribute))
        yield counter
    by_reason = (
        (
            "pdserve_kv_tier_blocks_skipped",
            "Tier blocks not served (corrupt, truncated, foreign, missing, io; peer: read_failed): their requests "
            "recomputed",
            "skipped",
        ),
        (
            "pdserve_kv_tier_store_failures",
            "Tier stores that did not happen (disk_full, io, backlog)",
            "store_failures",
        ),
    )
    for name, documentation, attribute in by_reason:
        counter = CounterMetricFamily(name, documentation, labels=["medium", "reason"])
        for medium, tier in tiers:
            for reason, count in sorted(getattr(tier, attribute).items()):
                counter.add_metric([medium, reason], count)
        yield counter


class EngineMetrics:
    def __init__(
        self,
        stats: Callable[[], SchedulerStats | None],
        cache_config: dict[str, str],
        cpu: CpuShare | None = None,
        startup: tuple[list[tuple[str, float]], float] = ([], 0.0),
    ) -> None:
        """``startup``: the engine's start-up phases, (name, seconds) in order, and its whole start's seconds."""
        self.registry = CollectorRegistry()
        self.requests = Counter("pdserve_requests", "Finished requests", ["finish_reason"], registry=self.registry)
        self.kv_params_rejected = Counter(
            "pdserve_kv_params_rejected",
            "Decode legs whose kv_transfer_params could not be used (the prompt was computed here), by reason",
            ["reason"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "pdserve_time_to_first_token_seconds",
            "Time to first token",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tpot = Histogram(
            "pdserve_time_per_output_token_seconds",
            "Time per output token after the first",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "pdserve_e2e_request_latency_seconds",
            "End-to-end request latency",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.kv_transfer_seconds = Histogram(
            "pdserve_kv_transfer_seconds",
            "Duration of one request's KV pull",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.kv_tier_load_seconds = Histogram(
            "pdserve_kv_tier_load_seconds",
            "Time to load one request's blocks from one tier (one rank's share)",
            ["medium"],
            buckets=_FAST_BUCKETS + (0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
            registry=self.registry,
        )
        self.grammar_compile_seconds = Histogram(
            "pdserve_grammar_compile_seconds",
            "Time to compile one structured-output grammar (a cached one is not compiled again)",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.grammar_bitmask_seconds = Histogram(
            "pdserve_grammar_bitmask_seconds",
            "Time to fill one step's token bitmask (overlapped with the step's forward)",
            buckets=_FAST_BUCKETS,
            registry=self.registry,
        )
        self.structured_requests = Counter(
            "pdserve_structured_output_requests",
            "Requests with a structured-output constraint, by kind (json, json_object, regex, choice, grammar)",
            ["kind"],
            registry=self.registry,
        )
        self.gateway_prefill = Counter(
            "pdserve_gateway_prefill",
            "Prefill legs this decode engine sent itself behind a gateway, by outcome: disagg (params used), "
            "fallback (computed here), rejected (the prefill's 4xx went to the client)",
            ["outcome"],
            registry=self.registry,
        )
        self.streams_handed_off = Counter(
            "pdserve_streams_handed_off",
            "Streams a draining engine handed back to the router to continue on another decode engine",
            registry=self.registry,
        )
        self.structured_length_capped = Counter(
            "pdserve_structured_output_length_capped",
            "Structured-output choices that reached max_tokens before their grammar was complete",
            registry=self.registry,
        )
        # Request lengths (what a planner or autoscaler needs to size the pools), under our names and
        # vLLM's; every finished request, a P/D prefill leg included (its generation is its one token).
        # (Ours with finer buckets, shared with the router's; vLLM's with vLLM's 1-2-5 buckets.)
        self.prompt_tokens = [
            Histogram(name, "Prompt tokens of a finished request", buckets=buckets, registry=self.registry)
            for name, buckets in (
                ("pdserve_request_prompt_tokens", TOKEN_BUCKETS),
                ("vllm:request_prompt_tokens", _VLLM_TOKEN_BUCKETS),
            )
        ]
        self.generation_tokens = [
            Histogram(name, "Tokens generated for a finished request", buckets=buckets, registry=self.registry)
            for name, buckets in (
                ("pdserve_request_generation_tokens", TOKEN_BUCKETS),
                ("vllm:request_generation_tokens", _VLLM_TOKEN_BUCKETS),
            )
        ]
        self.registry.register(_SchedulerCollector(stats, cache_config, cpu, startup))

    def observe_stats(self, stats: SchedulerStats) -> None:
        """Called with every stats snapshot from the core: records what happened since the last one."""
        for seconds in stats.remote_kv.kv_transfer_seconds:
            self.kv_transfer_seconds.observe(seconds)
        for medium, tier in stats.kv_tiers.items():
            for seconds in tier.load_seconds:
                self.kv_tier_load_seconds.labels(medium).observe(seconds)
        for seconds in stats.grammar_compile_seconds:
            self.grammar_compile_seconds.observe(seconds)
        for seconds in stats.grammar_bitmask_seconds:
            self.grammar_bitmask_seconds.observe(seconds)

    def observe(
        self,
        finish_reason: str,
        arrival: float,
        first_token: float | None,
        end: float,
        num_output_tokens: int,
        num_prompt_tokens: int,
    ) -> None:
        self.requests.labels(finish_reason).inc()
        for histogram in self.prompt_tokens:
            histogram.observe(num_prompt_tokens)
        for histogram in self.generation_tokens:
            histogram.observe(num_output_tokens)
        self.e2e.observe(end - arrival)
        if first_token is not None:
            self.ttft.observe(first_token - arrival)
            if num_output_tokens > 1:
                self.tpot.observe((end - first_token) / (num_output_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
