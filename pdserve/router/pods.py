"""The router's view of its pods: which exist, how many requests this router has in flight on each, and
whether each answers. Owns the pick among pods once each has a score (highest score, then least-loaded, then
round-robin among ties; failed pods last), the plain least-loaded and round-robin picks, passive failure
counting, and the health checking that takes pods out of rotation, puts them back and reads where each pod
publishes its KV-cache events.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import aiohttp
import msgspec

from pdserve.api.protocol import ProtocolError

logger = logging.getLogger(__name__)


class PeerSource(msgspec.Struct, frozen=True):
    """Where an engine serves peer reads of the turns it holds (its /health's ``kv_peer_source``)."""

    host: str
    ports: list[int]
    hold_seconds: float


@dataclass(eq=False)
class Pod:
    url: str
    role: str  # "prefill" or "decode", for logs
    healthy: bool = True  # optimistic until the first check, so a router serves at once
    in_flight: int = 0  # requests this router has running on the pod (its load, as this replica sees it)
    failures: int = 0  # consecutive failed requests (connection broken, 5xx other than 503)
    # The engine's KV compatibility hash (from /health): a prefill and a decode pair only when
    # theirs are equal, so during a rollout old pairs with old and new with new.
    compat_hash: str | None = None
    kv_cache_dtype: str | None = None  # what its KV cache stores (from /health), to name a refused pairing
    # The engine's id for its current run (from /health, or from an engine that refused a leg signed for
    # another): what the router signs P/D legs for, and the engine its KV events must name.
    engine_id: str | None = None
    # That run's leg key (hex X25519, from /health or beside the id): the router MACs legs for it instead of
    # signing them (pdserve/api/auth.py); None: signed.
    leg_key: str | None = None
    # Where it serves peer reads of finished turns (from /health; None: it serves none).
    peer_source: PeerSource | None = None
    # Prompt tokens a second its prefill legs have run at (a moving average; None until measured).
    prefill_speed: float | None = None
    # Called when the pod leaves rotation: legs waiting on it for a first byte give up then, since a pod
    # that stopped answering its health probe may never answer them.
    on_leave: set[Callable[[], None]] = field(default_factory=set)
    # time.monotonic() when this router last sent it a request (or, as a picker, routed one to it): its load
    # signals from before then do not count that request yet (flow control's saturation).
    sent_at: float = 0.0

    def take(self) -> None:
        """Count one more request in flight on the pod, from now."""
        self.in_flight += 1
        self.sent_at = time.monotonic()


class PodSet:
    """The pods of one role."""

    def __init__(self, role: str, urls: Sequence[str]) -> None:
        self.role = role
        self.pods = [Pod(url.rstrip("/"), role) for url in urls]
        self._cursor = 0  # where the next scan starts: rotating it makes ties go round-robin

    def set_urls(self, urls: Sequence[str]) -> None:
        """Replace the pod list (discovery); pods that stay keep their load and health."""
        known = {pod.url: pod for pod in self.pods}
        self.pods = [known.get(url.rstrip("/")) or Pod(url.rstrip("/"), self.role) for url in urls]
        self._cursor = 0

    def __len__(self) -> int:
        return len(self.pods)

    def any_healthy(self) -> bool:
        return any(pod.healthy for pod in self.pods)

    def choose(
        self,
        exclude: Collection[Pod] = (),
        healthy_only: bool = False,
        score: Callable[[Pod], float] | None = None,
        round_robin: bool = False,
    ) -> Pod | None:
        """The pod with the highest ``score`` (when given), then the least-loaded (unless ``round_robin``), the
        scan order breaking ties so they go round-robin. Healthy pods first; an unhealthy one only when no
        healthy pod is left (a stale health view must not turn into refusing every request) and
        ``healthy_only`` is not set. None when nothing is left."""
        pods = self.pods
        count = len(pods)
        best: Pod | None = None
        best_key: tuple[bool, float, int] = (True, 0.0, 0)
        best_index = 0
        for step in range(count):
            index = (self._cursor + step) % count
            pod = pods[index]
            if pod in exclude or (healthy_only and not pod.healthy):
                continue
            key = (not pod.healthy, 0.0 if score is None else -score(pod), 0 if round_robin else pod.in_flight)
            if best is None or key < best_key:
                best, best_key, best_index = pod, key, index
        if best is not None:
            self._cursor = (best_index + 1) % count
        return best

    def healthy(self, exclude: Collection[Pod] = ()) -> list[Pod]:
        return [pod for pod in self.pods if pod.healthy and pod not in exclude]

    def failed(self, pod: Pod, reason: str, threshold: int) -> bool:
        """Count a failed request; at ``threshold`` in a row the pod leaves rotation (True: an ejection) until a
        health probe brings it back."""
        pod.failures += 1
        return pod.failures >= threshold and self.mark(pod, False, f"{pod.failures} failures in a row: {reason}")

    def mark(self, pod: Pod, healthy: bool, reason: str = "") -> bool:
        """Record a health observation; True when it took the pod out of rotation."""
        if pod.healthy == healthy:
            return False
        pod.healthy = healthy
        if not healthy:
            for leave in list(pod.on_leave):
                leave()
        if healthy:
            pod.failures = 0
            logger.info("%s pod %s is back", pod.role, pod.url)
            return False
        logger.warning("%s pod %s is out of rotation: %s", pod.role, pod.url, reason)
        return True


class _Health(msgspec.Struct):
    kv_events_port: int | None = None  # where the engine publishes KV-cache events (None: it does not)
    kv_compat_hash: str | None = None
    kv_cache_dtype: str | None = None
    engine_id: str | None = None
    leg_key: str | None = None
    kv_peer_source: PeerSource | None = None


class HealthChecker:
    """GETs every pod's /health each ``interval`` seconds; a pod that fails or answers non-200 is skipped
    until it answers 200 again. Each 200 answer's ``kv_events_port`` goes to ``on_health``."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        podsets: Sequence[PodSet],
        interval: float,
        on_ejection: Callable[[], None],
        on_health: Callable[[Pod, int | None], None] | None = None,
    ) -> None:
        self.session = session
        self.podsets = podsets
        self.interval = interval
        # Short, but not so short that a busy pod on a loaded host flaps.
        self.timeout = aiohttp.ClientTimeout(total=max(0.5, min(interval, 2.0)))
        self.on_ejection = on_ejection
        self.on_health = on_health
        self._task: asyncio.Task[None] | None = None

    async def check_all(self) -> None:
        await asyncio.gather(*(self._probe(podset, pod) for podset in self.podsets for pod in podset.pods))

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.check_all()

    async def _probe(self, podset: PodSet, pod: Pod) -> None:
        try:
            async with self.session.get(pod.url + "/health", timeout=self.timeout) as response:
                payload = await response.read()
                healthy, reason = response.status == 200, f"/health answered {response.status}"
        except (aiohttp.ClientError, TimeoutError) as error:
            healthy, reason = False, f"/health failed: {type(error).__name__}: {error}"
        if podset.mark(pod, healthy, reason):
            self.on_ejection()
        if healthy:
            try:
                health = msgspec.json.decode(payload, type=_Health)
            except msgspec.MsgspecError:
                health = _Health()  # not an engine's JSON (an older engine, a proxy): no events, no hash
            pod.compat_hash = health.kv_compat_hash
            pod.kv_cache_dtype = health.kv_cache_dtype
            pod.engine_id = health.engine_id
            pod.leg_key = health.leg_key
            pod.peer_source = health.kv_peer_source
            if self.on_health is not None:
                self.on_health(pod, health.kv_events_port)


def no_decode_pod(health_interval: float) -> ProtocolError:
    """The 503 for a request no decode pod can take now; ``Retry-After`` is one health probe away, when a pod that
    left rotation (hung, restarting) may be back."""
    return ProtocolError(
        "no decode pod is reachable",
        503,
        error_type="service_unavailable",
        retry_after=max(1, math.ceil(health_interval)),
    )
