"""The scheduler side of a KV connector: the hooks through which a core loads KV from elsewhere
and hands its own KV to others.

The scheduler asks the connector at three moments; beyond them the core only keeps the ledger of
what blocks owe to or await from other engines (``engine.remote_kv``). So the colocated role differs
from the P/D roles in the connector it uses (``NoKVConnector``), and the prefill and decode roles run the same
connector and differ only in whether the engine hands its blocks to peers (``serves_blocks``):

1. ``get_num_new_matched_tokens``: before allocating a waiting request, how many of its tokens
   beyond the local prefix-cache hit can be loaded from elsewhere, and whether that load is
   asynchronous (the request then waits in ``WAITING_FOR_REMOTE_KVS``).
2. ``update_state_after_alloc``: blocks now exist for those tokens; record where to load them.
3. ``request_finished``: a request ended; should its blocks be held for someone to read
   (delay freeing), and what transfer parameters go back to the caller.

The store side (the KV tiers, ``kvtransfer.tiers``) has two moments, both with no-op defaults:
``blocks_cached`` (blocks became full and hashed this step: a write-through tier stores them) and
``blocks_evicted`` (free cached blocks are being taken for new data this step: a write-back tier saves them
first). The worker side carries each out in the step it was ordered: a store after that step's forward has
written the blocks, a save before that step's forward overwrites them. ``take_tier_events`` reports what
entered and left the tiers, for the KV-event stream.

More moments have default no-op hooks: ``request_added`` (a decode connector starts renewing
the remote lease of a request as soon as it is queued), ``release_remote`` (a request refused at
the door still frees its remote blocks), and ``hold_cancelled`` (held blocks nobody can read any
more).
A load the worker side could not complete comes back as failed; ``recompute_failed_loads``
says whether the request is then recomputed locally or finished with an error.

Each step ``build_connector_meta`` drains what the worker side must start. The worker side
reports completed sends and loads through ``KVConnectorOutput`` (below).

This module sits below the engine (imports point down), so requests are described by the
small protocol below rather than by the engine's Request class.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Protocol

from pdserve.api.kv_events import TierEvents
from pdserve.api.peer_kv import PeerKV
from pdserve.kvtransfer.params import RemotePrefill

if TYPE_CHECKING:
    from pdserve.kvtransfer.connectors import ConnectorContext


class ConnectorRequest(Protocol):
    """What a connector may read of a request."""

    request_id: str
    prompt_token_ids: list[int]
    block_hashes: list[bytes]  # of the request's full blocks so far (the prefix cache's chained hashes)
    # A P/D decode leg's remote blocks, screened by the API process (usable for this engine and prompt).
    remote_prefill: RemotePrefill | None
    remote_decode: bool  # a P/D prefill leg: its prompt's KV is to be held for a decode engine
    peer: PeerKV | None  # peer reads: hold its blocks for peers when it ends, or read its prefix from one
    num_computed_tokens: int

    @property
    def num_tokens(self) -> int: ...


@dataclass(slots=True)
class KVConnectorOutput:
    """What the worker side of the KV connector finished since it was last asked."""

    finished_sending: set[str] = field(default_factory=set)  # held blocks that may now be freed
    finished_recving: set[str] = field(default_factory=set)  # remote loads that have landed
    # Remote loads that failed (no write into their blocks is in flight any more). For a load
    # reported in ``failed_recving_in_flight`` before, this is the later word that its write drained.
    failed_recving: set[str] = field(default_factory=set)
    # Remote loads that failed while a write into their blocks may still land (a NIXL read that
    # timed out and could not be cancelled): the blocks stay quarantined until the load is reported
    # again in ``failed_recving`` (the read ended, or its peer's connection was torn down).
    failed_recving_in_flight: set[str] = field(default_factory=set)
    # Completed pulls as (bytes, seconds), and counts of failed pulls and expired leases.
    transfers: list[tuple[int, float]] = field(default_factory=list)
    num_failed_transfers: int = 0
    num_expired_leases: int = 0
    num_failed_releases: int = 0  # "free these blocks" messages that could not be sent (the lease frees them)
    # Side-channel frames refused (unauthenticated, replayed, from an old incarnation, malformed), by reason.
    rejected_messages: dict[str, int] = field(default_factory=dict)
    # KV tiers: (medium, hash) of blocks now stored; (medium, hash, reason) of stores and block loads that
    # failed (a failed block load fails its request's load, which is recomputed); (medium, bytes, seconds) of
    # each tier's part of a landed load; (tokens, seconds) of timed forwards.
    tier_stored: list[tuple[str, bytes]] = field(default_factory=list)
    tier_store_failures: list[tuple[str, bytes, str]] = field(default_factory=list)
    tier_load_failures: list[tuple[str, bytes, str]] = field(default_factory=list)
    tier_loads: list[tuple[str, int, float]] = field(default_factory=list)
    step_times: list[tuple[int, float]] = field(default_factory=list)
    peer_loads: list[tuple[int, float]] = field(default_factory=list)  # (bytes, seconds) of landed peer reads
    peer_reads_served: list[int] = field(default_factory=list)  # bytes of each read this engine served a peer

    def merge(self, other: KVConnectorOutput) -> None:
        """Add ``other``'s reports to these (two worker sides of one rank: the multi-connector's parts)."""
        for item in fields(self):
            mine, theirs = getattr(self, item.name), getattr(other, item.name)
            if isinstance(mine, int):
                setattr(self, item.name, mine + theirs)
            elif isinstance(mine, dict):
                for key, count in theirs.items():
                    mine[key] = mine.get(key, 0) + count
            elif isinstance(mine, set):
                mine |= theirs
            else:
                mine.extend(theirs)

    def says_anything(self) -> bool:
        """Whether anything at all is reported."""
        return bool(
            self.finished_sending
            or self.finished_recving
            or self.failed_recving
            or self.failed_recving_in_flight
            or self.transfers
            or self.num_failed_transfers
            or self.num_expired_leases
            or self.num_failed_releases
            or self.rejected_messages
            or self.tier_stored
            or self.tier_store_failures
            or self.tier_load_failures
            or self.tier_loads
            or self.step_times
            or self.peer_loads
            or self.peer_reads_served
        )


@dataclass
class TierStats:
    """One KV tier's numbers (each a ``pdserve_kv_tier_*`` metric, labelled by medium): gauges of now,
    cumulative counters, and the durations of the loads finished since the last stats."""

    num_blocks: int = 0
    num_bytes: int = 0
    capacity_bytes: int = 0
    hit_tokens: int = 0  # prompt tokens loaded from the tier instead of computed
    stored_bytes: int = 0
    loaded_bytes: int = 0
    evictions: int = 0  # blocks dropped for room, or past their age
    skipped: dict[str, int] = field(default_factory=dict)  # blocks not served, by reason (corrupt, truncated, ...)
    store_failures: dict[str, int] = field(default_factory=dict)  # stores that did not happen, by reason
    loads_declined: int = 0  # hits not loaded because recomputing was estimated faster
    load_seconds: list[float] = field(default_factory=list)


class KVConnectorWorker(Protocol):
    """The worker side of a KV connector: the data plane next to the KV-cache tensors."""

    def submit(self, work: Any) -> None:
        """Start the work order the scheduler side built this step (``build_connector_meta``)."""

    def collect(self) -> KVConnectorOutput | None:
        """What finished since the last call (None: nothing); never blocks."""
        ...

    def close(self) -> None:
        """Stop moving blocks and release the transfer resources."""


class KVConnectorScheduler(ABC):
    # What a failed remote load does: True recomputes the prompt locally, False fails the request.
    recompute_failed_loads: bool = True
    # What must match for this engine's KV blocks to be valid in another's (None: it moves none).
    compat_hash: str | None = None
    # Seconds within which the worker side reports every load it was given (landed or failed);
    # past it the scheduler's watchdog fails the load itself. None: loads need no watchdog.
    load_report_timeout: float | None = None
    # After how long an abandoned load's quarantine that the worker side has not ended (by reporting the load)
    # is counted overdue and logged. It is never ended on a timer: a write into its blocks might still land.
    quarantine_alarm_seconds: float = 0.0
    # The share of the KV cache that may be held for remote readers at once; a hold beyond it is
    # refused (the request's answer carries no params, so the decode computes the prompt itself).
    max_held_fraction: float = 1.0
    # The share of the KV cache that finished requests may hold for peer reads (0: none is held for peers).
    peer_hold_fraction: float = 0.0

    @classmethod
    def from_context(cls, context: ConnectorContext) -> KVConnectorScheduler:
        """The connector an engine with this context runs (``kvtransfer.connectors``)."""
        raise NotImplementedError(f"{cls.__name__} is not built from a connector context")

    def request_added(self, request: ConnectorRequest) -> None:
        """A request entered the scheduler's queue."""
        return None

    def recompute_failed_load(self, request: ConnectorRequest) -> bool:
        """Whether the failed load of ``request`` is recomputed here (else the request fails)."""
        return self.recompute_failed_loads

    def note_step(self, num_tokens: int) -> None:
        """The step being scheduled computes ``num_tokens`` tokens (called before ``build_connector_meta``)."""
        return None

    def release_remote(self, remote: RemotePrefill | None) -> None:
        """A request naming ``remote`` blocks was refused before it was queued: free them."""
        return None

    def hold_cancelled(self, request_id: str) -> None:
        """A finished request's held blocks are freed without being read (its caller left before
        it could learn where they were)."""
        return None

    def has_pending_work(self) -> bool:
        """Work for the worker side that needs a step even when nothing is scheduled."""
        return False

    def peer_hold_dropped(self, request_id: str) -> None:
        """The scheduler freed the blocks a finished request held for peer reads before their time was up."""
        return None

    def peer_source(self) -> tuple[str, list[int], float] | None:
        """(host, each rank's side-channel port, hold seconds) where and how long this engine serves peer reads of
        the turns it holds; None: it serves none."""
        return None

    # Whether the scheduler reports ``blocks_cached`` / ``blocks_evicted`` (collecting them costs a list per step).
    wants_cached_blocks: bool = False
    wants_evicted_blocks: bool = False

    def blocks_cached(self, blocks: list[tuple[int, bytes]]) -> None:
        """(block id, hash) of blocks that became full and hashed this step; their KV is written by this
        step's forward."""
        return None

    def blocks_evicted(self, blocks: list[tuple[int, bytes]]) -> None:
        """(block id, hash) of free cached blocks taken for new data this step, before this step's forward
        overwrites them."""
        return None

    def worker_reported(self, report: KVConnectorOutput) -> None:
        """What the worker side reported this step, before the scheduler's ledger takes its loads' ends."""
        return None

    def tier_stats(self) -> dict[str, TierStats]:
        """Each KV tier's numbers, by medium (none without tiers); load durations are handed over once."""
        return {}

    def take_tier_events(self, snapshot: bool) -> list[TierEvents]:
        """What entered and left each KV tier since the last call (with every held hash when ``snapshot``)."""
        return []

    def hands_over(self, request: ConnectorRequest) -> bool:
        """The request's KV is to be held for a remote reader when it finishes (a P/D prefill leg)."""
        return False

    def expects_remote_kv(self, request: ConnectorRequest) -> bool:
        """The request's prompt KV may come from elsewhere when it is admitted (its pull can
        start before it can compute, e.g. while its grammar compiles)."""
        return False

    @abstractmethod
    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> tuple[int, bool]:
        """(tokens loadable from elsewhere past ``num_computed_tokens``, whether the load is async)."""

    @abstractmethod
    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """Blocks were allocated for a request this connector was asked about."""

    @abstractmethod
    def build_connector_meta(self) -> Any:
        """The worker side's work order for this step (None when there is nothing to do)."""

    @abstractmethod
    def request_finished(
        self, request: ConnectorRequest, block_ids: list[int], finish_reason: str
    ) -> tuple[bool, dict[str, Any] | None]:
        """(hold the blocks until the worker reports the send finished, params to return)."""


class NoKVConnector(KVConnectorScheduler):
    """The colocated role: nothing is loaded from or handed to another engine."""

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        return None

    def build_connector_meta(self) -> Any:
        return None

    def request_finished(
        self, request: ConnectorRequest, block_ids: list[int], finish_reason: str
    ) -> tuple[bool, dict[str, Any] | None]:
        return False, None
