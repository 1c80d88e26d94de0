"""Flow control: which request goes to the fleet now, which waits, and which is told to come back later (429 with
``Retry-After``, never a timeout). One core, used by the router (and by anything else that admits requests to the
same pods).

- **Limits per tenant** (``tenants.py``): requests and tokens per minute, token buckets; each router replica
  applies ``1 / --router-replicas`` of the deployment's limit. Tokens are the prompt's when a request arrives and
  its output's when it ends, so a tenant that spent more than its minute's tokens waits until the debt is paid.
- **Saturation, from the pods' own signals** (their KV-event batches: queue depth and KV-cache usage): a pod is
  saturated when its waiting queue reaches ``--saturation-queue`` or its KV usage ``--saturation-kv``; the fleet is,
  when every decode pod is, or every prefill pod (when there are prefill pods). Requests admitted since the
  last signal of a pod that was sent requests after it count against the stage's headroom, so a burst between
  two signals cannot all go at once; a pod sent nothing since its last signal has nothing more to tell (engines
  publish each change of their queues), so a quiet pod's once-a-second beat never holds the others back. Without signals
  (engines publishing no KV events) nothing is saturated: only the limits apply.
- **Queues**, only while the fleet is saturated: one band per priority value (lower first, strictly), and in a
  band one queue per tenant, served by virtual token counters (VTC): the tenant with the fewest tokens served,
  weighed by its ``weight``, goes next; a tenant that comes back after its queue emptied starts at the least
  counter of those waiting, so idleness banks no credit. Queues are bounded per tenant (``max_queued``) and per
  band (``--max-queued``); a request that waits past its deadline (the tenant's ``queue_timeout``, or the
  request's ``X-PDServe-Queue-Timeout`` header in seconds, whichever is shorter) is refused before it costs a
  prefill.
- **More urgent than the rest**: a request whose priority is more urgent than every request of other priorities in
  flight goes to a saturated fleet at once (the engines, scheduling by priority, run it first), up to
  ``max_ahead`` of its priority in flight.
- **Ahead of its band**: a tenant's request that finds the tenant with under half the requests in flight (per
  weight) of every other tenant that has some at its priority (typically: a light tenant with none, beside a
  flood) goes at once, saturated or not, past the band's queue, marked ``ahead``: the router tells the engines
  (``AHEAD_HEADER``), which, scheduling by priority, run it before the others of its priority, preempting one if
  they must. Without it a light tenant's request, first in the router's queue, would still wait behind the
  flood's requests already in the engine's queue and for one of their seats to end. At most ``max_ahead`` such
  requests per band are in flight (tenant names may come from a gateway's header: unbounded); tenants near their
  shares (within 2x of each other) never go ahead of each other, so they do not preempt each other by turns.

A request admitted holds its place until ``done``; what a continuation (a migrated stream) does inside it never
passes through here again.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from pdserve.api.protocol import ProtocolError
from pdserve.router.kv_index import KVIndex
from pdserve.router.loop_metrics import Counter, CounterChild, Histogram, HistogramChild
from pdserve.router.pods import PodSet
from pdserve.router.tenants import Tenant

QUEUE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# While requests wait, how often the pods' signals are looked at again besides each new batch of them (admissions
# age out of the pending count with time too).
_DISPATCH_POLL_S = 0.025
# Admissions older than this are past every signal PodSignals reads (its max_age), so they count for nothing.
_PENDING_HORIZON_S = 5.0


class Overloaded(ProtocolError):
    """A 429 the client may retry after ``retry_after`` seconds."""

    def __init__(self, message: str, cause: str, retry_after: float) -> None:
        seconds = max(1, math.ceil(retry_after))
        super().__init__(message, 429, error_type="rate_limit_exceeded", headers={"Retry-After": str(seconds)})
        self.cause = cause


@dataclass
class Saturation:
    """Whether the fleet can take another request now: ``stage`` names the saturated P/D stage (None: it can)."""

    stage: str | None
    headroom: int  # requests it can take before it is saturated, as far as the signals tell (large: no signal)


class PodSignals:
    """Saturation from the pods' KV-event batches (``KVIndex``): a pod is saturated when its waiting queue reaches
    ``queue_limit`` or its KV usage ``kv_limit``; a stage, when each of its healthy pods is, or when the requests
    admitted since its pods' signals take the headroom they showed. A healthy pod without a signal younger than
    ``max_age`` leaves its stage unsaturated: there is nothing to go by (engines without KV events)."""

    UNKNOWN = 1 << 30  # the headroom of a stage nothing is known of

    def __init__(
        self, prefill: PodSet, decode: PodSet, index: KVIndex, queue_limit: int, kv_limit: float, max_age: float = 3.0
    ) -> None:
        self.prefill = prefill
        self.decode = decode
        self.index = index
        self.queue_limit = queue_limit
        self.kv_limit = kv_limit
        self.max_age = max_age

    def __call__(self, pending: Callable[[float], int]) -> Saturation:
        decode = self._stage(self.decode, pending)
        if decode.stage is not None or not self.prefill.pods:
            return decode
        prefill = self._stage(self.prefill, pending)
        return prefill if prefill.stage is not None else Saturation(None, min(decode.headroom, prefill.headroom))

    def _stage(self, podset: PodSet, pending: Callable[[float], int]) -> Saturation:
        now = time.monotonic()
        headroom = 0
        newest = 0.0  # the latest signal: requests admitted after it are in none
        unreflected: float | None = None  # the earliest signal of a pod sent requests after it
        considered = False
        for pod in podset.pods:
            if not pod.healthy:
                continue
            considered = True
            known = self.index.pods.get(pod.url)
            if known is None or known.load is None or now - known.updated > self.max_age:
                return Saturation(None, self.UNKNOWN)
            newest = max(newest, known.updated)
            if pod.sent_at >= known.updated:
                # A pod sent nothing since its signal has told all there is (its engine publishes each change of
                # its queues): only pods sent requests since hold the stage's pending admissions back.
                unreflected = known.updated if unreflected is None else min(unreflected, known.updated)
            load = known.load
            if load.num_waiting < self.queue_limit and load.kv_cache_usage < self.kv_limit:
                headroom += self.queue_limit - load.num_waiting
        if not considered:  # no pod up: the request is answered by what routing says of that, not queued
            return Saturation(None, self.UNKNOWN)
        left = headroom - pending(unreflected if unreflected is not None else newest)
        return Saturation(None if left > 0 else podset.role, left)


class TokenBucket:
    """``rate`` units a second up to ``capacity``; ``take`` may leave a debt (tokens spent after the fact)."""

    def __init__(self, per_minute: float) -> None:
        self.rate = per_minute / 60.0
        self.capacity = per_minute
        self.level = per_minute
        self.updated = time.monotonic()

    def _refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
        self.updated = now

    def wait_for(self, amount: float, now: float) -> float:
        """Seconds until ``amount`` is there (0: now)."""
        self._refill(now)
        return 0.0 if self.level >= amount else (amount - self.level) / self.rate

    def take(self, amount: float, now: float) -> None:
        self._refill(now)
        self.level -= amount


@dataclass(eq=False)
class Ticket:
    """One request at the door: queued until ``granted`` is set, then admitted until ``done``."""

    tenant: Tenant
    band: int
    cost: float  # tokens it is expected to cost (prompt + output bound), what VTC charges when it goes
    arrived: float
    deadline: float | None
    granted: asyncio.Future[None] | None = None  # made when it queues: set when it is admitted
    charged: float = 0.0  # what its tenant's counter was charged
    admitted: bool = False
    ahead: bool = False  # sent ahead of its band's others (its tenant under half the others' share in flight)
    ended: bool = False  # done() was called
    prompt_tokens: int = 0  # what it counts against its tenant's tokens per minute


@dataclass
class _Band:
    queues: dict[str, deque[Ticket]] = field(default_factory=dict)  # tenant name -> its waiting requests
    counters: dict[str, float] = field(default_factory=dict)  # virtual tokens served per tenant (VTC)
    queued: int = 0

    def next_ticket(self) -> Ticket:
        # The least served; between equals (a tenant that starts waiting is lifted to the least counter) the one
        # with less waiting, so a light tenant's request does not sit behind a flood's; then the oldest.
        queues, counters = self.queues, self.counters
        name = min(queues, key=lambda flow: (counters.get(flow, 0.0), len(queues[flow]), queues[flow][0].arrived))
        queue = self.queues[name]
        ticket = queue.popleft()
        if not queue:
            del self.queues[name]
        self.queued -= 1
        return ticket

    def remove(self, ticket: Ticket) -> None:
        queue = self.queues.get(ticket.tenant.name)
        if queue is None or ticket not in queue:
            return
        queue.remove(ticket)
        if not queue:
            del self.queues[ticket.tenant.name]
        self.queued -= 1


class FlowMetrics:
    """Per tenant label (configured tenants; others as ``other``) and band: admitted, rejected by cause, queue time,
    and waiting now."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.admitted = Counter(
            "pdserve_router_flow_admitted",
            "Requests admitted to the fleet, by tenant and priority band",
            ["tenant", "band"],
            registry=registry,
        )
        self.queued = Counter(
            "pdserve_router_flow_queued",
            "Requests that waited in the router's queue (the fleet was saturated), by tenant and band",
            ["tenant", "band"],
            registry=registry,
        )
        self.rejected = Counter(
            "pdserve_router_flow_rejected",
            "Requests answered 429, by tenant, band and cause",
            ["tenant", "band", "cause"],
            registry=registry,
        )
        self.queue_time = Histogram(
            "pdserve_router_flow_queue_seconds",
            "Time from arrival to admission, by tenant and band",
            ["tenant", "band"],
            buckets=QUEUE_BUCKETS,
            registry=registry,
        )
        self.saturated = Counter(
            "pdserve_router_flow_saturated",
            "Admissions that found the fleet saturated, by the P/D stage that was",
            ["stage"],
            registry=registry,
        )
        self.ahead = Counter(
            "pdserve_router_flow_ahead",
            "Requests sent at once, ahead of their band's others, because their tenant had under half the requests in "
            "flight (per weight) of every other tenant of the band (the engines run them first), by tenant and band",
            ["tenant", "band"],
            registry=registry,
        )
        self.preempting = Counter(
            "pdserve_router_flow_preempting",
            "Requests sent to a saturated fleet because their priority was more urgent than every other in flight "
            "(the engines run them first), by tenant and band",
            ["tenant", "band"],
            registry=registry,
        )
        self._admissions: dict[tuple[str, str], tuple[CounterChild, HistogramChild]] = {}

    def admission(self, tenant: str, band: str) -> tuple[CounterChild, HistogramChild]:
        """The admitted counter and queue-time histogram of a tenant label and band (labels() costs a lock and a
        lookup: once per pair, not per request)."""
        key = (tenant, band)
        children = self._admissions.get(key)
        if children is None:
            children = self._admissions[key] = (self.admitted.labels(*key), self.queue_time.labels(*key))
        return children


@dataclass
class FlowSettings:
    max_queued: int = 1024  # per band, in this replica
    replicas: int = 1  # router replicas sharing the tenants' limits
    # Requests per band in flight sent to a saturated fleet at once: ahead of the band's others (their tenant under
    # its share), or of a priority more urgent than every other in flight (0: none).
    max_ahead: int = 4


class Admission:
    """The door. ``saturation(pending)`` reads the pods' signals; ``pending`` is how many requests were admitted
    since the oldest signal it reads (it answers with the headroom left after them)."""

    def __init__(
        self,
        settings: FlowSettings,
        saturation: Callable[[Callable[[float], int]], Saturation],
        metrics: FlowMetrics,
    ) -> None:
        self.settings = settings
        self.saturation = saturation
        self.metrics = metrics
        self.bands: dict[int, _Band] = {}
        self.queued = 0
        self._grants: deque[float] = deque()  # when recent requests were admitted
        # Admitted and not done, by priority: per tenant name, [how many, the tenant's weight] (a priority or a
        # tenant with none has no entry).
        self._flows: dict[int, dict[str, list[float]]] = {}
        self._ahead: dict[int, int] = {}  # of those, sent ahead of their band, by priority
        self._buckets: dict[tuple[str, str], TokenBucket] = {}
        self._dispatcher: asyncio.Task[None] | None = None

    # ----- limits ----------------------------------------------------------------------------------------------

    def _bucket(self, tenant: Tenant, kind: str) -> TokenBucket | None:
        per_minute = tenant.spec.requests_per_minute if kind == "requests" else tenant.spec.tokens_per_minute
        if per_minute is None:
            return None
        key = (tenant.label, kind)  # tenants the table does not list share one (label "other")
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = TokenBucket(per_minute / self.settings.replicas)
        return bucket

    def _check_limits(self, tenant: Tenant, priority: int, prompt_tokens: int, now: float) -> None:
        if tenant.spec.requests_per_minute is None and tenant.spec.tokens_per_minute is None:
            return
        requests = self._bucket(tenant, "requests")
        tokens = self._bucket(tenant, "tokens")
        for bucket, amount, cause in ((requests, 1.0, "requests_per_minute"), (tokens, 1.0, "tokens_per_minute")):
            if bucket is None:
                continue
            wait = bucket.wait_for(amount, now)
            if wait > 0:
                self.metrics.rejected.labels(tenant.label, str(priority), cause).inc()
                raise Overloaded(f"tenant {tenant.label!r} is over its {cause.replace('_', ' ')}", cause, wait)
        self._charge(tenant, 1.0, prompt_tokens, now)

    def _charge(self, tenant: Tenant, requests: float, tokens: float, now: float) -> None:
        """Count a request and tokens against the tenant's per-minute limits (negative: give them back)."""
        if tenant.spec.requests_per_minute is None and tenant.spec.tokens_per_minute is None:
            return
        for kind, amount in (("requests", requests), ("tokens", tokens)):
            bucket = self._bucket(tenant, kind)
            if bucket is not None and amount:
                bucket.take(amount, now)

    # ----- admission -------------------------------------------------------------------------------------------

    def _pending(self, since: float) -> int:
        """Requests admitted after ``since`` (the oldest signal read). Admission times only grow: counted from the
        newest, stopping at the first older one; those past any signal's age are dropped."""
        grants = self._grants
        horizon = time.monotonic() - _PENDING_HORIZON_S
        while grants and grants[0] < horizon:
            grants.popleft()
        count = 0
        for granted in reversed(grants):
            if granted <= since:
                break
            count += 1
        return count

    async def admit(
        self, tenant: Tenant, priority: int, prompt_tokens: int, max_output_tokens: int, queue_timeout: float | None
    ) -> Ticket:
        """Wait until the request may go; Overloaded (429) when it may not. The caller calls ``done`` afterwards."""
        ticket = self.enter(tenant, priority, prompt_tokens, max_output_tokens, queue_timeout)
        if not ticket.admitted:
            await self.wait(ticket)
        return ticket

    def enter(
        self, tenant: Tenant, priority: int, prompt_tokens: int, max_output_tokens: int, queue_timeout: float | None
    ) -> Ticket:
        """A request at the door: admitted at once (``ticket.admitted``) or queued (then ``wait`` for it);
        Overloaded (429) when it may not wait. Without a coroutine, since most requests go at once."""
        now = time.monotonic()
        self._check_limits(tenant, priority, prompt_tokens, now)
        limit = tenant.spec.queue_timeout
        if queue_timeout is not None and (limit is None or queue_timeout < limit):
            limit = queue_timeout
        deadline = None if limit is None else now + limit
        ticket = Ticket(tenant, priority, prompt_tokens + max_output_tokens, now, deadline, prompt_tokens=prompt_tokens)
        if self._goes_ahead(tenant, priority):
            ticket.ahead = True
            self._ahead[priority] = self._ahead.get(priority, 0) + 1
            self.metrics.ahead.labels(tenant.label, str(priority)).inc()
            self._grant(ticket, now)
            return ticket
        if not self._ahead_of(priority):
            saturation = self.saturation(self._pending)
            if saturation.stage is None:
                self._grant(ticket, now)
                return ticket
            self.metrics.saturated.labels(saturation.stage).inc()
            bands = self._flows
            if (
                bands
                and min(bands) >= priority
                and max(bands) > priority
                and sum(flow[0] for flow in bands.get(priority, {}).values()) < self.settings.max_ahead
            ):
                # More urgent than every request of other priorities this replica has in flight: the engines,
                # scheduling by priority, run it first (preempting if they must), so waiting here for room would
                # only add to its TTFT. Up to max_ahead of its priority in flight: the next queues.
                self.metrics.preempting.labels(tenant.label, str(priority)).inc()
                self._grant(ticket, now)
                return ticket
        try:
            self._enqueue(ticket)
        except Overloaded:
            self._charge(tenant, -1.0, -prompt_tokens, time.monotonic())  # refused: it cost its tenant nothing
            raise
        return ticket

    async def wait(self, ticket: Ticket) -> None:
        """Until a queued ticket is admitted; Overloaded (429) when its deadline passes first."""
        assert ticket.granted is not None
        tenant, prompt_tokens = ticket.tenant, ticket.prompt_tokens
        try:
            if ticket.deadline is None:
                await ticket.granted
            else:
                async with asyncio.timeout(ticket.deadline - time.monotonic()):
                    await ticket.granted
        except TimeoutError:
            if ticket.admitted:
                return  # granted as its deadline came
            self._dequeue(ticket)
            self._charge(tenant, -1.0, -prompt_tokens, time.monotonic())
            self.metrics.rejected.labels(tenant.label, str(ticket.band), "deadline").inc()
            message = "the fleet is saturated and the request's queue deadline passed"
            raise Overloaded(message, "deadline", 1.0) from None
        except asyncio.CancelledError:
            if ticket.admitted:
                self.done(ticket)  # granted just as its client left
            else:
                self._dequeue(ticket)
            raise

    def _goes_ahead(self, tenant: Tenant, priority: int) -> bool:
        """Whether a request of this tenant and priority goes ahead of its band's others: the tenant has under half
        the requests in flight (per weight) of every other tenant that has some at this priority (none at all, the
        usual case of a light tenant), no more urgent request waits, and the band's requests sent ahead are fewer
        than ``max_ahead``. Half, so that tenants near their shares never preempt each other by turns."""
        flows = self._flows.get(priority)
        if not flows or self._ahead.get(priority, 0) >= self.settings.max_ahead:
            return False
        mine = flows.get(tenant.name)
        if mine is not None and len(flows) == 1:
            return False  # alone at its priority (one tenant, the usual deployment): nobody to be ahead of
        share = 0.0 if mine is None else mine[0] / mine[1]
        least_other = min((count / weight for name, (count, weight) in flows.items() if name != tenant.name), default=0)
        return 2 * share < least_other and not any(
            band < priority and queue.queued for band, queue in self.bands.items()
        )

    def _ahead_of(self, priority: int) -> bool:
        """Whether requests of this priority or a better one are waiting (a newcomer goes behind them)."""
        return any(band <= priority and queue.queued for band, queue in self.bands.items())

    def _enqueue(self, ticket: Ticket) -> None:
        tenant, label, band_label = ticket.tenant, ticket.tenant.label, str(ticket.band)
        band = self.bands.setdefault(ticket.band, _Band())
        queue = band.queues.get(tenant.name)
        if (queue is not None and len(queue) >= tenant.spec.max_queued) or tenant.spec.max_queued == 0:
            self.metrics.rejected.labels(label, band_label, "queue_full").inc()
            raise Overloaded(f"tenant {label!r} has too many requests waiting", "queue_full", 1.0)
        if band.queued >= self.settings.max_queued:
            self.metrics.rejected.labels(label, band_label, "queue_full").inc()
            raise Overloaded("too many requests are waiting at this priority", "queue_full", 1.0)
        if queue is None:
            queue = band.queues[tenant.name] = deque()
            # VTC: a tenant that starts waiting again starts no lower than the least counter of those waiting.
            waiting = [band.counters.get(name, 0.0) for name in band.queues if name != tenant.name]
            if waiting:
                band.counters[tenant.name] = max(band.counters.get(tenant.name, 0.0), min(waiting))
        ticket.granted = asyncio.get_running_loop().create_future()
        queue.append(ticket)
        band.queued += 1
        self.queued += 1
        self.metrics.queued.labels(label, band_label).inc()
        if self._dispatcher is None or self._dispatcher.done():
            self._dispatcher = asyncio.get_running_loop().create_task(self._dispatch_while_waiting())

    def _dequeue(self, ticket: Ticket) -> None:
        band = self.bands.get(ticket.band)
        if band is not None and band.queued:
            before = band.queued
            band.remove(ticket)
            self.queued -= before - band.queued

    def _grant(self, ticket: Ticket, now: float) -> None:
        self._grants.append(now)
        admitted, queue_time = self.metrics.admission(ticket.tenant.label, str(ticket.band))
        admitted.inc()
        queue_time.observe(now - ticket.arrived)
        ticket.admitted = True
        flows = self._flows.setdefault(ticket.band, {})
        flow = flows.get(ticket.tenant.name)
        if flow is None:
            flows[ticket.tenant.name] = [1, ticket.tenant.spec.weight]
        else:
            flow[0] += 1
        if ticket.granted is not None and not ticket.granted.done():
            ticket.granted.set_result(None)

    def dispatch(self) -> None:
        """Admit waiting requests while the fleet has room: the best band first, in it the tenant VTC picks."""
        while self.queued:
            saturation = self.saturation(self._pending)
            if saturation.stage is not None:
                return
            band_value = min(value for value, band in self.bands.items() if band.queued)
            band = self.bands[band_value]
            ticket = band.next_ticket()
            self.queued -= 1
            if ticket.granted is None or ticket.granted.done():  # its client left; already counted out
                continue
            charge = ticket.cost / ticket.tenant.spec.weight
            band.counters[ticket.tenant.name] = band.counters.get(ticket.tenant.name, 0.0) + charge
            ticket.charged = charge
            if not band.queues:
                band.counters.clear()  # nobody waits at this priority: no unfairness left to remember
            self._grant(ticket, time.monotonic())

    def signals_changed(self) -> None:
        """A pod reported its load: requests waiting may go now."""
        if self.queued:
            self.dispatch()

    async def _dispatch_while_waiting(self) -> None:
        while self.queued:
            self.dispatch()
            if self.queued:
                await asyncio.sleep(_DISPATCH_POLL_S)

    def done(self, ticket: Ticket, output_tokens: int | None = None, prompt_tokens: int | None = None) -> None:
        """An admitted request ended: its tokens count against its tenant's per-minute tokens, and its VTC charge is
        corrected from the expected cost to the real one (when the decode engine reported it)."""
        if not ticket.admitted or ticket.ended:
            return
        ticket.ended = True
        flows = self._flows[ticket.band]
        flow = flows[ticket.tenant.name]
        flow[0] -= 1
        if not flow[0]:
            del flows[ticket.tenant.name]
            if not flows:
                del self._flows[ticket.band]
        if ticket.ahead:
            left = self._ahead[ticket.band] - 1
            if left:
                self._ahead[ticket.band] = left
            else:
                del self._ahead[ticket.band]
        tenant = ticket.tenant
        if output_tokens is not None:
            self._charge(tenant, 0.0, output_tokens, time.monotonic())
            band = self.bands.get(ticket.band)
            if band is not None and ticket.charged and tenant.name in band.counters:
                real = ((prompt_tokens or 0) + output_tokens) / tenant.spec.weight
                band.counters[tenant.name] += real - ticket.charged
        if self.queued:
            self.dispatch()
