"""What a PDService's and a PDPool's status say, computed from counts (pure functions).

PDService: `pools.{router,prefill,decode}` (replicas desired, readyReplicas, "ready/desired" summary
for the printer columns), `routerURL`, a `Ready` condition, and an `ObjectsSkipped` condition
where the API server lacks a kind the operator would create. PDPool: what its scale
subresource reads (`replicas`, `selector`) plus `readyReplicas`.
"""

import datetime
from collections.abc import Mapping, Sequence
from typing import Any

from pdserve.operator.names import ROLES, router_url, selector_string

SKIPPED = "ObjectsSkipped"
SCALING_CONFLICT = "ScalingConflict"  # written by the autoscaler


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def pool(desired: int, ready: int) -> dict[str, Any]:
    return {"replicas": desired, "readyReplicas": ready, "summary": f"{ready}/{desired}"}


def ready_condition(
    problems: list[str], desired: Mapping[str, int], ready: Mapping[str, int], previous: Mapping[str, Any] | None
) -> dict[str, Any]:
    """Ready is True when the spec is valid and every pool that should have pods has them all ready."""
    lagging = [f"{role} {ready[role]}/{desired[role]}" for role in ROLES if ready[role] < desired[role]]
    if problems:
        state, reason, message = "False", "InvalidSpec", "; ".join(problems)
    elif lagging:
        state, reason, message = "False", "PoolsNotReady", "waiting for ready pods: " + ", ".join(lagging)
    else:
        state, reason, message = "True", "AllPoolsReady", "every pool has its desired pods ready"
    # The transition time moves only when the status flips, as Kubernetes conditions do.
    since = previous.get("lastTransitionTime") if previous and previous.get("status") == state else None
    return {
        "type": "Ready",
        "status": state,
        "reason": reason,
        "message": message,
        "lastTransitionTime": since or now(),
    }


def service_status(
    name: str,
    namespace: str,
    problems: list[str],
    desired: Mapping[str, int],
    ready: Mapping[str, int],
    previous: Mapping[str, Any],
    not_served: Sequence[str] = (),
    kept: Sequence[str] = (),
) -> dict[str, Any]:
    """The PDService status; `previous` is the current status (keeps the conditions' transition
    times); `not_served` names the kinds ("policy/v1 PodDisruptionBudget") the server lacks; `kept`
    names conditions others write (the autoscaler's), carried over as they are."""
    old = {c.get("type"): c for c in previous.get("conditions") or []}
    conditions = [ready_condition(problems, desired, ready, old.get("Ready"))]
    if not_served:
        earlier = old.get(SKIPPED)
        conditions.append(
            {
                "type": SKIPPED,
                "status": "True",
                "reason": "KindNotServed",
                "message": f"the API server does not serve {', '.join(not_served)}: not created",
                "lastTransitionTime": earlier["lastTransitionTime"] if earlier else now(),
            }
        )
    conditions += [old[kind] for kind in kept if kind in old]
    return {
        "pools": {role: pool(desired[role], ready[role]) for role in ROLES},
        "routerURL": router_url(name, namespace),
        "conditions": conditions,
    }


def pool_status(service: str, role: str, deployment: Mapping[str, Any] | None) -> dict[str, Any]:
    """The PDPool status from its Deployment's: current and ready pods, and the pods' selector."""
    counts = (deployment or {}).get("status") or {}
    return {
        "replicas": counts.get("replicas", 0),
        "readyReplicas": counts.get("readyReplicas", 0),
        "selector": selector_string(service, role),
    }
