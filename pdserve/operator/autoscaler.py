"""The autoscaler: sizes a PDService's prefill and decode pools together, from measured traffic
and the planner's simulation of the real scheduler (docs/operator.md, "Autoscaling").

Every `intervalSeconds`, for a PDService with `spec.autoscaling.enabled`:
1. It reads the window of traffic the routers saw (`load`): arrival rate, prompt and output
   length histograms, measured TTFT and TPOT.
2. It corrects the profile: the current deployment is simulated on that traffic, and each pool's
   step times are multiplied by measured over predicted p50 (TTFT for prefill, TPOT for decode),
   the factors kept between decisions and clamped to `correction.min..max`.
3. It plans (`planner.search.plan_disaggregated`, bounded by the pools' min/max replicas): the
   cheapest pair that meets the SLOs on `horizonSeconds` of such traffic.
4. It moves both pools toward the plan in one decision: growth at once, shrinking only to the
   largest size of the last `scaleDownDecisions` plans (hysteresis), by at most `maxStep`
   replicas per pool, never within `cooldownSeconds` of its last change and never while a
   Deployment is still rolling out.
While enabled it is the only writer of the PDPools' replicas: a value it did not write (kubectl
scale, an HPA) is put back at the next decision, with a Warning event `ScaleOverridden`; an HPA
found targeting a pool sets the condition `ScalingConflict=True`. The last decision, its inputs
and the predicted SLOs are in `status.autoscaling`.
"""

from __future__ import annotations

import collections
import datetime
import json
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import kopf
import kubernetes

from pdserve.operator import reconcile
from pdserve.operator.kube import Kube
from pdserve.operator.load import PrometheusQuery, RouterScraper, Window, default_selector
from pdserve.operator.names import DECODE, ENGINE_ROLES, PREFILL, ROUTER, object_name, selector_string
from pdserve.operator.spec import problems, with_defaults
from pdserve.operator.status import SCALING_CONFLICT
from pdserve.planner.profile import Profile
from pdserve.planner.search import plan_disaggregated
from pdserve.planner.simulator import SLO, Deployment, simulate
from pdserve.planner.workload import WorkloadSpec

logger = logging.getLogger(__name__)

MIN_MEASURED = 20  # requests measured in a window before their latencies correct the profile
HPA = "HorizontalPodAutoscaler"


@dataclass
class Settings:
    """spec.autoscaling, read."""

    interval_s: float
    cooldown_s: float
    scale_down_decisions: int
    max_step: int
    horizon_s: float
    correction: tuple[float, float]
    slo: SLO
    bounds: dict[str, tuple[int, int]]

    @classmethod
    def of(cls, autoscaling: Mapping[str, Any]) -> Settings:
        """From a valid spec.autoscaling with its defaults filled in."""
        slo = autoscaling["slo"]
        return cls(
            interval_s=float(autoscaling["intervalSeconds"]),
            cooldown_s=float(autoscaling["cooldownSeconds"]),
            scale_down_decisions=int(autoscaling["scaleDownDecisions"]),
            max_step=int(autoscaling["maxStep"]),
            horizon_s=float(autoscaling["horizonSeconds"]),
            correction=(float(autoscaling["correction"]["min"]), float(autoscaling["correction"]["max"])),
            slo=SLO(float(slo["ttftSeconds"]), float(slo["tpotSeconds"]), float(slo["attainment"])),
            bounds={
                role: (autoscaling[role]["minReplicas"], autoscaling[role]["maxReplicas"]) for role in ENGINE_ROLES
            },
        )


@dataclass
class Memory:
    """What the autoscaler of one PDService keeps between decisions (in the operator's memory: a
    restarted operator starts from a new baseline and neutral corrections; the cooldown and the
    replicas it wrote are in the status)."""

    scraper: RouterScraper = field(default_factory=RouterScraper)
    written: dict[str, int] | None = None  # the replicas of its last decision (None: none made yet)
    recent: collections.deque[dict[str, int]] = field(default_factory=collections.deque)
    correction: dict[str, float] = field(default_factory=lambda: {PREFILL: 1.0, DECODE: 1.0})


@dataclass
class Decision:
    replicas: dict[str, int]  # what the pools get now
    reason: str  # Scaled, Steady, Cooldown, RolloutInProgress, CollectingBaseline, ...
    message: str
    target: dict[str, int] | None = None  # the plan's pair (before hysteresis and steps)
    predicted: dict[str, Any] | None = None  # the plan's simulated SLO figures
    correction: dict[str, float] = field(default_factory=dict)

    @property
    def scaled(self) -> bool:
        return self.reason == "Scaled"


def _clamp(value: float, low: float, high: float) -> float:
    return max(low, min(high, value))


def _corrected(profiles: Mapping[str, Profile], correction: Mapping[str, float]) -> dict[str, Profile]:
    return {role: profiles[role].scaled(correction[role]) for role in ENGINE_ROLES}


def _update_correction(
    settings: Settings, memory: Memory, current: Mapping[str, int], window: Window, profiles: Mapping[str, Profile]
) -> None:
    """Measured over predicted p50, for the deployment that served the window, folded into the factors."""
    if min(window.ttft.total, window.tpot.total) < MIN_MEASURED or window.rate <= 0:
        return
    corrected = _corrected(profiles, memory.correction)
    arrivals = _arrivals(settings, window, corrected[PREFILL])
    if not arrivals:
        return
    deployment = Deployment(prefill=current[PREFILL], decode=current[DECODE])
    served = simulate(deployment, arrivals, corrected[PREFILL], corrected[DECODE])
    low, high = settings.correction
    for role, metric, measured in ((PREFILL, "ttft", window.ttft), (DECODE, "tpot", window.tpot)):
        predicted = served.percentile(metric, 0.5)
        if 0 < predicted < math.inf:
            memory.correction[role] = _clamp(memory.correction[role] * measured.quantile(0.5) / predicted, low, high)


def _arrivals(settings: Settings, window: Window, profile: Profile) -> list[Any]:
    workload = WorkloadSpec(
        rate=window.rate,
        prompt=window.prompt,
        output=window.generation,
        duration_s=settings.horizon_s,
        max_model_len=profile.engine.max_model_len,
    )
    return workload.arrivals()


def decide(
    settings: Settings,
    memory: Memory,
    current: Mapping[str, int],
    window: Window | None,
    profiles: Mapping[str, Profile],
    rolling: bool,
    cooling: bool,
) -> Decision:
    """The replicas both pools get now, and why (pure but for `memory`, which it updates)."""
    hold = dict(current)
    if rolling:
        return Decision(hold, "RolloutInProgress", "a Deployment is still rolling out", correction=memory.correction)
    if window is None:
        return Decision(
            hold, "CollectingBaseline", "the first read of the routers' counters", correction=memory.correction
        )
    if window.arrivals > 0 and not (window.prompt.total and window.generation.total):
        return Decision(hold, "NoLengths", "requests arrived but none was answered yet", correction=memory.correction)
    if window.arrivals > 0:
        _update_correction(settings, memory, current, window, profiles)
    if cooling:
        return Decision(
            hold, "Cooldown", f"within {settings.cooldown_s:g} s of the last change", correction=memory.correction
        )
    target, predicted = _plan(settings, memory, window, profiles)
    # Hysteresis: shrink only as far as every one of the last plans allows.
    memory.recent.append(target)
    while len(memory.recent) > settings.scale_down_decisions:
        memory.recent.popleft()
    replicas = {}
    for role in ENGINE_ROLES:
        floor = max(plan[role] for plan in memory.recent)
        if target[role] > current[role]:
            replicas[role] = min(target[role], current[role] + settings.max_step)
        elif floor < current[role]:
            replicas[role] = max(floor, current[role] - settings.max_step)
        else:
            replicas[role] = current[role]
    reason = "Scaled" if replicas != dict(current) else "Steady"
    message = (
        f"{current[PREFILL]}P{current[DECODE]}D -> {replicas[PREFILL]}P{replicas[DECODE]}D "
        f"(plan {target[PREFILL]}P{target[DECODE]}D at {window.rate:.3g} req/s)"
    )
    return Decision(replicas, reason, message, target, predicted, dict(memory.correction))


def _plan(
    settings: Settings, memory: Memory, window: Window, profiles: Mapping[str, Profile]
) -> tuple[dict[str, int], dict[str, Any] | None]:
    """The plan's pair within the bounds, and its predicted figures (None: no traffic to simulate)."""
    lowest = {role: settings.bounds[role][0] for role in ENGINE_ROLES}
    if window.arrivals <= 0:
        return lowest, None
    corrected = _corrected(profiles, memory.correction)
    arrivals = _arrivals(settings, window, corrected[PREFILL])
    if not arrivals:
        return lowest, None
    plan = plan_disaggregated(
        arrivals,
        settings.slo,
        corrected[PREFILL],
        corrected[DECODE],
        max_prefill=settings.bounds[PREFILL][1],
        max_decode=settings.bounds[DECODE][1],
    )
    if plan.deployment is None:  # nothing within the bounds meets the SLOs: the most it may have
        target = {role: settings.bounds[role][1] for role in ENGINE_ROLES}
        predicted = plan.tried[-1] if plan.tried else None
    else:
        target = {PREFILL: plan.deployment.prefill, DECODE: plan.deployment.decode}
        predicted = plan.result.summary() if plan.result is not None else None
    return {role: int(_clamp(target[role], *settings.bounds[role])) for role in ENGINE_ROLES}, predicted


# ----- against the API server ---------------------------------------------------------------


def settled(deployment: Mapping[str, Any] | None, replicas: int) -> bool:
    """Whether the Deployment runs `replicas` pods of its current template, all available."""
    if deployment is None:
        return False
    wanted = deployment["spec"].get("replicas", 1)
    counts = deployment.get("status") or {}
    return (
        wanted == replicas
        and counts.get("observedGeneration", 0) >= deployment["metadata"].get("generation", 0)
        and counts.get("replicas", 0) == wanted
        and counts.get("updatedReplicas", 0) == wanted
        and counts.get("availableReplicas", 0) == wanted
    )


def load_profiles(kube: Kube, namespace: str, profile: Mapping[str, Any]) -> dict[str, Profile]:
    """The prefill and decode pools' profiles from the ConfigMap spec.autoscaling.profile names."""
    config_map = kube.get("ConfigMap", namespace, profile["configMap"])
    if config_map is None:
        raise ValueError(f"ConfigMap {profile['configMap']} not found")
    data = config_map.get("data") or {}
    found = {}
    for role, key in ((PREFILL, profile["key"]), (DECODE, profile.get("decodeKey", profile["key"]))):
        if key not in data:
            raise ValueError(f"ConfigMap {profile['configMap']} has no key {key}")
        try:
            found[role] = Profile.from_dict(json.loads(data[key]))
        except json.JSONDecodeError as error:
            raise ValueError(f"ConfigMap {profile['configMap']} key {key}: not JSON ({error})") from None
    return found


def conflicting_hpas(kube: Kube, namespace: str, name: str) -> list[str]:
    """The HorizontalPodAutoscalers that scale one of the PDService's pools (none where autoscaling/v2
    is not served: then none can be seen)."""
    if not kube.served(HPA):
        return []
    pools = {object_name(name, role) for role in ENGINE_ROLES}
    return sorted(
        hpa["metadata"]["name"]
        for hpa in kube.list(HPA, namespace, "")
        if (hpa.get("spec") or {}).get("scaleTargetRef", {}).get("kind") == "PDPool"
        and hpa["spec"]["scaleTargetRef"].get("name") in pools
    )


def _conflict_condition(hpas: list[str], previous: Mapping[str, Any] | None) -> dict[str, Any]:
    state = "True" if hpas else "False"
    if hpas:
        message = (
            f"HorizontalPodAutoscaler {', '.join(hpas)} targets a pool the autoscaler sizes: its writes are reverted"
        )
    else:
        message = "no HorizontalPodAutoscaler targets the pools"
    since = previous.get("lastTransitionTime") if previous and previous.get("status") == state else None
    return {
        "type": SCALING_CONFLICT,
        "status": state,
        "reason": "HPATargetsPool" if hpas else "NoConflict",
        "message": message,
        "lastTransitionTime": since or _timestamp(time.time()),
    }


def _timestamp(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _seconds(stamp: str | None) -> float | None:
    if not stamp:
        return None
    return datetime.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC).timestamp()


def _window(
    kube: Kube, namespace: str, name: str, metrics: Mapping[str, Any], memory: Memory, now: float, interval_s: float
) -> Window | None:
    if metrics["source"] == "prometheus":
        selector = metrics.get("selector") or default_selector(namespace, name)
        return PrometheusQuery(metrics["prometheusURL"], selector).window(interval_s)
    return memory.scraper.window(kube.list("Pod", namespace, selector_string(name, ROUTER)), now)


def decide_once(kube: Kube, namespace: str, name: str, memory: Memory, now: float | None = None) -> float | None:
    """One decision for the PDService; returns the seconds until the next (None: autoscaling is off,
    or the PDService is gone or invalid)."""
    now = time.time() if now is None else now
    service = kube.get("PDService", namespace, name)
    if service is None or service["metadata"].get("deletionTimestamp") or problems(name, service.get("spec") or {}):
        return None
    spec = with_defaults(service["spec"])
    if not spec["autoscaling"]["enabled"]:
        return None
    settings = Settings.of(spec["autoscaling"])
    pools = {role: kube.get("PDPool", namespace, object_name(name, role)) for role in ENGINE_ROLES}
    if any(pool is None for pool in pools.values()):
        return settings.interval_s  # being created or restored: the next decision sees them
    previous = (service.get("status") or {}).get("autoscaling") or {}
    # Sizes found before its first decision (at start, or autoscaling just turned on) are adopted.
    written = memory.written or {}
    in_pools = {role: pool["spec"]["replicas"] for role, pool in pools.items() if pool is not None}
    # A size the autoscaler did not write goes back to the one it did.
    overridden = [role for role in ENGINE_ROLES if role in written and in_pools[role] != written[role]]
    current = {role: written[role] if role in overridden else in_pools[role] for role in ENGINE_ROLES}
    deployments = {role: kube.get("Deployment", namespace, object_name(name, role)) for role in ENGINE_ROLES}
    rolling = not all(settled(deployments[role], in_pools[role]) for role in ENGINE_ROLES)
    last_change = _seconds(previous.get("lastScaleTime"))
    cooling = last_change is not None and now - last_change < settings.cooldown_s
    try:
        profiles = load_profiles(kube, namespace, spec["autoscaling"]["profile"])
        window = _window(kube, namespace, name, spec["autoscaling"]["metrics"], memory, now, settings.interval_s)
        decision = decide(settings, memory, current, window, profiles, rolling, cooling)
    except (OSError, ValueError) as error:
        window = None
        decision = Decision(current, "InputsUnavailable", str(error), correction=dict(memory.correction))
    _write(kube, namespace, name, service, pools, overridden, decision, window, now, last_change)
    memory.written = dict(decision.replicas)
    return settings.interval_s


def _write(
    kube: Kube,
    namespace: str,
    name: str,
    service: Mapping[str, Any],
    pools: Mapping[str, Any],
    overridden: list[str],
    decision: Decision,
    window: Window | None,
    now: float,
    last_change: float | None,
) -> None:
    hpas = conflicting_hpas(kube, namespace, name)
    body = kopf.Body(cast(kopf.RawBody, service))  # what events are about
    with reconcile.service_lock(namespace, name):
        # Both pools in one pass: the pair the plan chose, never one without the other.
        for role in ENGINE_ROLES:
            if pools[role]["spec"]["replicas"] != decision.replicas[role]:
                kube.patch(
                    "PDPool", namespace, object_name(name, role), {"spec": {"replicas": decision.replicas[role]}}
                )
        for role in overridden:
            kopf.warn(
                body,
                reason="ScaleOverridden",
                message=f"{object_name(name, role)} was set to {pools[role]['spec']['replicas']} while autoscaling "
                f"is enabled; put back to {decision.replicas[role]}",
            )
        if decision.scaled:
            kopf.info(body, reason="Scaled", message=decision.message)
            last_change = now
        latest = kube.get("PDService", namespace, name)
        if latest is None:
            return
        conditions = [
            c for c in (latest.get("status") or {}).get("conditions") or [] if c.get("type") != SCALING_CONFLICT
        ]
        earlier = next(
            (c for c in (latest.get("status") or {}).get("conditions") or [] if c.get("type") == SCALING_CONFLICT), None
        )
        status = {
            "autoscaling": {
                "replicas": decision.replicas,
                "lastDecisionTime": _timestamp(now),
                "lastScaleTime": _timestamp(last_change) if last_change is not None else None,
                "reason": decision.reason,
                "message": decision.message,
                "target": decision.target,
                "inputs": window.summary() if window is not None else None,
                "predicted": _predicted(decision.predicted),
                "correction": decision.correction,
            },
            "conditions": [*conditions, _conflict_condition(hpas, earlier)],
        }
        kube.patch("PDService", namespace, name, {"status": status}, status=True)


def _predicted(summary: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The plan's simulated figures the status shows (seconds, rounded)."""
    if not summary:
        return None
    keys = ("ttft_p50_s", "ttft_p90_s", "tpot_p50_s", "tpot_p90_s")
    found: dict[str, Any] = {key: round(summary[key], 4) for key in keys if math.isfinite(summary.get(key, math.inf))}
    found["deployment"] = summary.get("deployment")
    found["utilisation"] = {pool: round(share, 3) for pool, share in (summary.get("utilisation") or {}).items()}
    return found


class Stopping(Protocol):
    """What tells the loop to end (kopf's DaemonStopped; a threading.Event in tests)."""

    def is_set(self) -> bool: ...
    def wait(self, timeout: float | None = None) -> Any: ...


def run(kube: Kube, namespace: str, name: str, stopped: Stopping) -> None:
    """Decide every interval until `stopped` (autoscaling turned off, or the operator stopping)."""
    memory = Memory()
    while not stopped.is_set():
        try:
            interval = decide_once(kube, namespace, name, memory)
        except kubernetes.client.ApiException as error:
            logger.warning(
                "autoscaler of %s/%s: the API server answered %s; trying again", namespace, name, error.status
            )
            interval = 10.0
        if interval is None:
            return
        stopped.wait(interval)
