"""SchedulerStats: what an engine core reports about itself at each stats interval (queues, KV-cache usage,
prefix-cache hits, the remote-KV ledger's counters, structured outputs' timings), for the API process's
metrics and the router's load view."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.remote_kv import RemoteKVStats
from pdserve.kvtransfer.base import TierStats


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_waiting_for_remote_kvs: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    remote_kv: RemoteKVStats = field(default_factory=RemoteKVStats)  # KV transfer (holds, loads, quarantines)
    # Hybrid models: state slots owned by requests (running, loading, held or quarantined).
    num_state_slots_used: int = 0
    kv_tiers: dict[str, TierStats] = field(default_factory=dict)  # each KV tier's numbers, by medium
    # Structured outputs (set by the engine core): grammars compiling now, compiles failed (cumulative),
    # and since the last stats the compile time of each grammar and the bitmask fill time of each step.
    num_waiting_for_grammar: int = 0
    grammar_compile_failures: int = 0
    grammar_compile_seconds: list[float] = field(default_factory=list)
    grammar_bitmask_seconds: list[float] = field(default_factory=list)
    # CPU engines: the compute threads the runner (rank 0) ran its last step with (its ThreadGovernor's count).
    compute_threads: int | None = None
