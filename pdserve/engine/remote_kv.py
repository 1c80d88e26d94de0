"""RemoteKV: the core's ledger of KV transfers, which the scheduler asks and whose numbers the metrics read.

It owns what a request's blocks owe to, or await from, another engine, apart from the scheduler's queues:

- holds: finished prefill legs whose blocks (and state slot) are kept for a remote reader until the worker
  side reports the send done; a hold that would take the held share of the cache past the connector's
  ``max_held_fraction`` is refused (its answer then carries no params, and its decode computes the prompt).
  A hybrid model's prefill leg is known from its arrival (``hands_over``): the scheduler runs its last
  prompt token alone, so that the state it hands over is as of the token before;
- peer holds: finished requests whose blocks are served to peer reads (``kvtransfer.peer_side``) until the
  worker side says their time is up, at most ``peer_hold_fraction`` of the cache: a new hold first drops the
  oldest beyond that, and a running request that needs room drops the oldest before anyone is preempted
  (``drop_peer_hold``); each drop is counted by why;
- loads in flight: requests waiting for a pull, with the time by which the worker side must report it
  (the watchdog), loads that landed and wait to be promoted, and requests aborted mid-load, whose blocks
  wait for the load to drain (freeing them sooner could let a late write land in another request's KV);
- quarantines: the blocks of loads that failed while a write into them may still land (the watchdog
  gave up on them, or the worker side said so), kept out of use until the load is reported. Past an
  alarm they are counted overdue and logged, never released on a timer;
- the counters of all this (``stats``).

The scheduler's requests change state only in the scheduler: what a connector report or the watchdog means
for them comes back as a :class:`Settled` for the scheduler to apply.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request
from pdserve.kvtransfer.base import KVConnectorOutput, KVConnectorScheduler

logger = logging.getLogger(__name__)


@dataclass
class RemoteKVStats:
    """The ledger's numbers: gauges of now, cumulative counters, and the durations of the pulls finished
    since the last stats (each one a ``pdserve_kv_*`` or ``pdserve_state_slots_held_for_remote`` metric)."""

    num_blocks_held_for_remote: int = 0
    num_blocks_quarantined: int = 0  # blocks of failed loads, kept out of use until no write can land
    num_state_slots_held_for_remote: int = 0  # hybrid models: the state slots of held prefill legs
    kv_transfer_bytes: int = 0
    kv_transfer_failures: int = 0
    kv_lease_expirations: int = 0
    kv_transfer_seconds: list[float] = field(default_factory=list)
    kv_release_failures: int = 0  # "free these blocks" messages the worker side could not send
    # Side-channel frames the transfer agent refused, by reason.
    kv_side_channel_rejected: dict[str, int] = field(default_factory=dict)
    kv_loads_abandoned: int = 0  # loads the watchdog ended because the worker side never reported them
    kv_quarantines_overdue: int = 0  # their quarantines that outlived the alarm (blocks kept out of use: leaked)
    kv_holds_refused: int = 0  # finished prefill legs not held: the held share of the cache was at its cap
    num_blocks_held_for_peers: int = 0
    kv_peer_served_bytes: int = 0  # KV bytes this engine's peer reads served
    # Peer holds ended before their time: "room" (a running request needed the blocks), "cap" (the held share
    # was full: the oldest went), "too_large" (one request's blocks alone were over the share: never held).
    kv_peer_holds_dropped: dict[str, int] = field(default_factory=dict)


@dataclass
class Settled:
    """What a connector report or the watchdog means for the scheduler's requests."""

    freed: list[Request] = field(default_factory=list)  # finished: their blocks may be freed now
    quarantined: list[Request] = field(default_factory=list)  # finished: their blocks went to the quarantine
    # Waiting for a load that failed (their blocks, if a write may still land, quarantined): recompute or fail.
    failed: list[Request] = field(default_factory=list)


class RemoteKV:
    def __init__(
        self, connector: KVConnectorScheduler, kv_cache_manager: KVCacheManager, num_blocks: int, num_state_slots: int
    ) -> None:
        self.connector = connector
        self.kv = kv_cache_manager
        self.hands_over: set[str] = set()  # hybrid models: requests whose KV and state will be held when they finish
        self.held_for_remote: dict[str, Request] = {}
        self._num_held_blocks = 0  # owned by held_for_remote's requests
        self.max_held_blocks = int(connector.max_held_fraction * num_blocks)
        self.max_held_slots = int(connector.max_held_fraction * num_state_slots)
        self.held_for_peers: OrderedDict[str, Request] = OrderedDict()  # oldest first
        self._num_peer_held_blocks = 0
        self.max_peer_held_blocks = int(connector.peer_hold_fraction * num_blocks)
        self.kv_peer_holds_dropped: dict[str, int] = {}
        self.kv_peer_served_bytes = 0
        self.loading: dict[str, Request] = {}  # waiting for a load the worker side has not reported
        self.finished_recving: set[str] = set()  # loads landed, their requests not yet promoted
        self.aborted_while_loading: dict[str, Request] = {}
        # The watchdog: loads handed to the connector must be reported by these times; a quarantine is
        # counted overdue (once) past its alarm.
        self._load_deadlines: dict[str, float] = {}
        self._quarantine_alarms: dict[str, float] = {}
        self.kv_transfer_bytes = 0
        self.kv_transfer_failures = 0
        self.kv_lease_expirations = 0
        self.kv_release_failures = 0
        self.kv_side_channel_rejected: dict[str, int] = {}
        self.kv_loads_abandoned = 0
        self.kv_quarantines_overdue = 0
        self.kv_holds_refused = 0
        self._kv_transfer_seconds: list[float] = []

    # ----- holds for remote readers ---------------------------------------------------------

    def request_added(self, request: Request) -> None:
        """Note a hybrid model's prefill leg; ValueError if it would sample more than one token: what it hands
        over is the state before its last prompt token, and further tokens would build on that state, not on
        the one their prompt leaves."""
        if self.kv.state_slots is None or not self.connector.hands_over(request):
            return
        if request.max_output_tokens != 1:
            raise ValueError("a prefill leg (kv_transfer_params.do_remote_decode) of a hybrid model samples one token")
        self.hands_over.add(request.request_id)

    def hold(self, request: Request) -> bool:
        """Keep a finished request's blocks for a remote reader; False (the connector told, the refusal
        counted) when holding more would starve this engine's own requests."""
        request_id = request.request_id
        num_blocks = self.kv.num_owned_blocks(request_id)
        over_slots = self.kv.state_slots is not None and len(self.held_for_remote) >= self.max_held_slots
        if self._num_held_blocks + num_blocks > self.max_held_blocks or over_slots:
            self.connector.hold_cancelled(request_id)
            self.kv_holds_refused += 1
            return False
        self.held_for_remote[request_id] = request
        self._num_held_blocks += num_blocks
        return True

    def hold_for_peers(self, request: Request) -> tuple[bool, list[Request]]:
        """Keep a finished request's blocks for peer reads: (held, the older holds dropped to make room, whose
        blocks the scheduler frees). Not held (the connector told) when its blocks alone are over the share."""
        num_blocks = self.kv.num_owned_blocks(request.request_id)
        if num_blocks > self.max_peer_held_blocks:
            self.connector.peer_hold_dropped(request.request_id)
            self._count_drop("too_large")
            return False, []
        dropped = []
        while self._num_peer_held_blocks + num_blocks > self.max_peer_held_blocks:
            oldest = self._drop_oldest_peer_hold("cap")
            assert oldest is not None  # the share holds this request alone
            dropped.append(oldest)
        self.held_for_peers[request.request_id] = request
        self._num_peer_held_blocks += num_blocks
        return True, dropped

    def num_blocks_only_held_for_peers(self) -> int:
        """Blocks no one but peer holds owns (a block a running request shares is in use)."""
        if not self.held_for_peers:
            return 0
        blocks = self.kv.req_to_blocks
        return sum(1 for request_id in self.held_for_peers for block in blocks[request_id] if block.ref_cnt == 1)

    def drop_peer_hold(self) -> Request | None:
        """The oldest peer hold, ended for a running request that needs room (its blocks are the scheduler's to
        free); None when there is none."""
        return self._drop_oldest_peer_hold("room")

    def _drop_oldest_peer_hold(self, reason: str) -> Request | None:
        if not self.held_for_peers:
            return None
        request_id = next(iter(self.held_for_peers))
        request = self._end_peer_hold(request_id)
        self.connector.peer_hold_dropped(request_id)
        self._count_drop(reason)
        return request

    def _count_drop(self, reason: str) -> None:
        self.kv_peer_holds_dropped[reason] = self.kv_peer_holds_dropped.get(reason, 0) + 1

    def _end_peer_hold(self, request_id: str) -> Request | None:
        request = self.held_for_peers.pop(request_id, None)
        if request is not None:
            self._num_peer_held_blocks -= self.kv.num_owned_blocks(request_id)
        return request

    def cancel_hold(self, request_id: str) -> Request | None:
        """End a hold nobody will read (its caller left before it could hand the params on): the held
        request, whose blocks need not wait for the lease; None if it held nothing."""
        request = self._end_hold(request_id)
        if request is not None:
            self.connector.hold_cancelled(request_id)
        return request

    def _end_hold(self, request_id: str) -> Request | None:
        request = self.held_for_remote.pop(request_id, None)
        if request is not None:
            self._num_held_blocks -= self.kv.num_owned_blocks(request_id)
        return request

    # ----- loads ----------------------------------------------------------------------------

    def load_started(self, request: Request, now: float) -> None:
        """``request`` now waits for its blocks to be loaded from elsewhere."""
        self.loading[request.request_id] = request
        if self.connector.load_report_timeout is not None:
            self._load_deadlines[request.request_id] = now + self.connector.load_report_timeout

    def finished_while_loading(self, request: Request) -> bool:
        """``request`` just finished: True if a load still writes into its blocks (it was aborted mid-load),
        which then wait here for the load to drain."""
        if self.loading.pop(request.request_id, None) is None:
            return False
        self.aborted_while_loading[request.request_id] = request
        return True

    def take_landed(self) -> set[str]:
        """The loads landed since the last call (their requests may run)."""
        landed, self.finished_recving = self.finished_recving, set()
        return landed

    def update(self, report: KVConnectorOutput, now: float) -> Settled:
        """Take in what the worker side finished: counters, ended holds, and each load's end."""
        for num_bytes, seconds in report.transfers:
            self.kv_transfer_bytes += num_bytes
            self._kv_transfer_seconds.append(seconds)
        self.kv_transfer_failures += report.num_failed_transfers
        self.kv_lease_expirations += report.num_expired_leases
        self.kv_release_failures += report.num_failed_releases
        self.kv_peer_served_bytes += sum(report.peer_reads_served)
        for reason, count in report.rejected_messages.items():
            self.kv_side_channel_rejected[reason] = self.kv_side_channel_rejected.get(reason, 0) + count
        settled = Settled()
        for request_id in report.finished_sending:
            held = self._end_hold(request_id) or self._end_peer_hold(request_id)
            if held is not None:
                settled.freed.append(held)
        for request_id in report.failed_recving_in_flight:
            # Failed, but a write into its blocks may still land: reported again (below, now or later) once it drained.
            self._load_deadlines.pop(request_id, None)
            if self._quarantine(request_id, now, settled):
                logger.warning("request %s: its KV load failed while still writing; its blocks quarantined", request_id)
        for request_id in report.finished_recving:
            if self._load_ended(request_id, settled) is not None:
                self.finished_recving.add(request_id)
        for request_id in report.failed_recving:
            request = self._load_ended(request_id, settled)
            if request is not None:
                settled.failed.append(request)
        return settled

    def _load_ended(self, request_id: str, settled: Settled) -> Request | None:
        """A load's last report came in: the request that waited for it (None: none does any more; a late
        report changes nothing)."""
        self._load_deadlines.pop(request_id, None)
        if request_id in self._quarantine_alarms:
            # Abandoned before: the report only says no write can land in its old blocks any more.
            del self._quarantine_alarms[request_id]
            self.kv.release_quarantine(request_id)
            return None
        aborted = self.aborted_while_loading.pop(request_id, None)
        if aborted is not None:
            settled.freed.append(aborted)
            return None
        return self.loading.pop(request_id, None)

    # ----- the watchdog -----------------------------------------------------------------------

    @property
    def watching(self) -> bool:
        return bool(self._load_deadlines or self._quarantine_alarms)

    def watchdog(self, now: float) -> Settled:
        """Fail loads the worker side never reported, quarantining their blocks (a write into them may still
        land); count and log quarantines that outlived their alarm."""
        for request_id, alarm in list(self._quarantine_alarms.items()):
            if alarm <= now:
                self._quarantine_alarms[request_id] = float("inf")  # counted once
                self.kv_quarantines_overdue += 1
                logger.error(
                    "request %s: its abandoned KV load is still not reported; its blocks stay quarantined "
                    "(leaked until the transfer agent reports it; pdserve_kv_quarantines_overdue_total)",
                    request_id,
                )
        settled = Settled()
        for request_id, deadline in list(self._load_deadlines.items()):
            if deadline <= now:
                del self._load_deadlines[request_id]
                if self._quarantine(request_id, now, settled):
                    logger.warning(
                        "request %s: its KV load was not reported within %.0f s; failed, its blocks quarantined",
                        request_id,
                        self.connector.load_report_timeout,
                    )
                    self.kv_transfer_failures += 1
                    self.kv_loads_abandoned += 1
        return settled

    def _quarantine(self, request_id: str, now: float, settled: Settled) -> bool:
        """Fail a load whose blocks a write may still reach: the blocks leave the request for the quarantine
        (until the load is reported; overdue past ``quarantine_alarm_seconds``). False if no request waits
        for that load any more."""
        request = self.aborted_while_loading.pop(request_id, None)
        if request is not None:
            settled.quarantined.append(request)
        else:
            request = self.loading.pop(request_id, None)
            if request is None:
                return False
            settled.failed.append(request)
        self.kv.quarantine(request)
        self._quarantine_alarms[request_id] = now + self.connector.quarantine_alarm_seconds
        return True

    # ----- observation ------------------------------------------------------------------------

    def has_work(self) -> bool:
        """Blocks still waiting on the worker side (held, draining, quarantined)."""
        return bool(self.held_for_remote or self.aborted_while_loading or self._quarantine_alarms)

    @property
    def num_blocks_held_for_remote(self) -> int:
        return self._num_held_blocks

    def stats(self) -> RemoteKVStats:
        """The counters, and the transfer durations since the last call (handed over: each is counted once)."""
        transfer_seconds, self._kv_transfer_seconds = self._kv_transfer_seconds, []
        slots = self.kv.state_slots
        return RemoteKVStats(
            num_blocks_held_for_remote=self.num_blocks_held_for_remote,
            num_blocks_quarantined=self.kv.num_quarantined_blocks,
            num_state_slots_held_for_remote=(
                0 if slots is None else sum(1 for request_id in self.held_for_remote if slots.has_slot(request_id))
            ),
            kv_transfer_bytes=self.kv_transfer_bytes,
            kv_transfer_failures=self.kv_transfer_failures,
            kv_lease_expirations=self.kv_lease_expirations,
            kv_transfer_seconds=transfer_seconds,
            kv_release_failures=self.kv_release_failures,
            kv_side_channel_rejected=dict(self.kv_side_channel_rejected),
            kv_loads_abandoned=self.kv_loads_abandoned,
            kv_quarantines_overdue=self.kv_quarantines_overdue,
            kv_holds_refused=self.kv_holds_refused,
            num_blocks_held_for_peers=self._num_peer_held_blocks,
            kv_peer_served_bytes=self.kv_peer_served_bytes,
            kv_peer_holds_dropped=dict(self.kv_peer_holds_dropped),
        )
