"""What the operator does for one PDService, whatever woke it up (the handlers only decide when).

`ensure_objects` creates or patches everything a valid PDService owns (the PDPool sizes and the
KV keys are written at creation only). `sync` is level-based and safe to call any
number of times: it makes each engine Deployment's size follow its PDPool (the one authoritative
count; before a scale-down it ranks the pool's pods, `scale_down`) and writes the PDPool and
PDService statuses from the Deployments. `restore` is both, for the PDService as stored: what
repairs an owned object someone deleted or edited.
"""

import collections
import threading
from collections.abc import Mapping
from typing import Any, cast

import kopf

from pdserve.api.keys import new_bundle
from pdserve.operator import manifests, scale_down, status
from pdserve.operator.kube import Kube, is_subset
from pdserve.operator.names import ENGINE_ROLES, ROLES, ROUTER, object_name, selector_string
from pdserve.operator.spec import EPP_SPEC, problems, with_defaults

# One pass at a time per PDService: kopf runs handlers of different objects in parallel threads; a
# sync that read older counts must not write after one that read newer ones, and two passes must
# not both create the same object. Reentrant: `restore` holds it across `ensure_objects` and `sync`.
_locks: collections.defaultdict[tuple[str, str], threading.RLock] = collections.defaultdict(threading.RLock)
_locks_lock = threading.Lock()


def service_lock(namespace: str, name: str) -> threading.RLock:
    with _locks_lock:
        return _locks[namespace, name]


def ensure_objects(kube: Kube, body: kopf.Body) -> None:
    """Create or patch the PDPools, KV Secret, NetworkPolicy, Deployments, Services and router RBAC
    of a valid PDService."""
    name, namespace = body["metadata"]["name"], body["metadata"]["namespace"]
    with service_lock(namespace, name):
        _ensure_objects(kube, body, name, namespace)


def _ensure_objects(kube: Kube, body: kopf.Body, name: str, namespace: str) -> None:
    spec = with_defaults(body["spec"])
    replicas = {}
    for role in ENGINE_ROLES:
        # A PDPool is seeded from the spec, or, when someone deleted it, from its Deployment: the
        # pool comes back at the size that runs.
        running = kube.get("Deployment", namespace, object_name(name, role))
        seed = running["spec"]["replicas"] if running is not None else spec[role]["replicas"]
        pool = manifests.pool(name, namespace, role, seed)
        kopf.adopt(pool, owner=body)
        pool_size = kube.apply(pool, create_only=manifests.POOL_CREATE_ONLY)["spec"]["replicas"]
        # A new Deployment starts at its pool's size; an existing one keeps its size here, because
        # resizing is `sync`'s alone (it ranks the pods before a scale-down).
        replicas[role] = running["spec"]["replicas"] if running is not None else pool_size
    # Fresh keys every pass: they are written only if the Secret does not exist yet. Before the
    # Deployments, so that no pod waits for its secret volume.
    secret = manifests.kv_keys(name, namespace, spec, new_bundle())
    if secret is not None:
        kopf.adopt(secret, owner=body)
        kube.apply(secret, create_only=manifests.KV_KEYS_CREATE_ONLY)
    objects = manifests.owned_objects(
        name,
        namespace,
        spec,
        replicas,
        disruption_budgets=kube.served(manifests.DISRUPTION_BUDGET[1]),
        inference_pools=spec[EPP_SPEC]["enabled"] is True and kube.served(manifests.INFERENCE_POOL[3]),
    )
    kopf.adopt(objects, owner=body)
    for obj in objects:
        kube.apply(obj)


def restore(kube: Kube, namespace: str, name: str) -> None:
    """Recreate or repair whatever a valid, live PDService owns, then sync: called when an owned
    object changed or went away. A PDService that is gone, being deleted or invalid is left alone
    (its own handler reports an invalid spec)."""
    with service_lock(namespace, name):
        service = kube.get("PDService", namespace, name)
        if service is None or service["metadata"].get("deletionTimestamp"):
            return
        if problems(name, service.get("spec") or {}):
            return
        _ensure_objects(kube, kopf.Body(cast(kopf.RawBody, service)), name, namespace)
        sync(kube, namespace, name)


def sync(kube: Kube, namespace: str, name: str) -> None:
    """Engine Deployments follow their PDPools; PDPool and PDService statuses follow the Deployments."""
    with service_lock(namespace, name):
        service = kube.get("PDService", namespace, name)
        if service is None or service["metadata"].get("deletionTimestamp"):
            return  # gone or going: the garbage collector removes the rest
        deployments = {role: kube.get("Deployment", namespace, object_name(name, role)) for role in ROLES}
        desired = {ROUTER: _router_size(service, deployments[ROUTER])}
        for role in ENGINE_ROLES:
            desired[role], deployments[role] = _follow_pool(kube, namespace, name, role, deployments[role])
        ready = {role: ((dep or {}).get("status") or {}).get("readyReplicas", 0) for role, dep in deployments.items()}
        found = problems(name, service.get("spec") or {})
        previous = service.get("status") or {}
        # The autoscaler's condition stays while it runs; turned off, its condition goes.
        autoscaling = with_defaults(service.get("spec") or {})["autoscaling"]
        kept = [status.SCALING_CONFLICT] if isinstance(autoscaling, dict) and autoscaling.get("enabled") is True else []
        not_served = _not_served(kube, with_defaults(service.get("spec") or {}))
        new = status.service_status(name, namespace, found, desired, ready, previous, not_served, kept)
        if not is_subset(new, service.get("status") or {}):
            kube.patch("PDService", namespace, name, {"status": new}, status=True)


def _rank_for_removal(kube: Kube, namespace: str, name: str, role: str) -> None:
    """Annotate the pool's pods with their deletion cost, so that a scale-down removes the cheapest."""
    for pod_name, cost in scale_down.costs(kube.list("Pod", namespace, selector_string(name, role))).items():
        annotation = {scale_down.DELETION_COST: str(cost)}
        kube.patch("Pod", namespace, pod_name, {"metadata": {"annotations": annotation}})


def _not_served(kube: Kube, spec: Mapping[str, Any]) -> list[str]:
    """The optional kinds the operator would create for this spec that this API server lacks (it says so once in
    its log)."""
    api_version, kind = manifests.DISRUPTION_BUDGET
    missing = [] if kube.served(kind) else [f"{api_version} {kind}"]
    picker = spec.get(EPP_SPEC)
    if isinstance(picker, Mapping) and picker.get("enabled") is True:
        group, version, _, pool_kind = manifests.INFERENCE_POOL
        if not kube.served(pool_kind):
            missing.append(f"{group}/{version} {pool_kind}")
    return missing


def _router_size(service: Mapping[str, Any], deployment: Mapping[str, Any] | None) -> int:
    replicas = with_defaults(service.get("spec") or {})[ROUTER]["replicas"]
    if isinstance(replicas, int) and not isinstance(replicas, bool):
        return replicas
    running: int = (deployment or {}).get("spec", {}).get("replicas", 0)  # spec unusable: report what runs
    return running


def _follow_pool(
    kube: Kube, namespace: str, name: str, role: str, deployment: dict[str, Any] | None
) -> tuple[int, dict[str, Any] | None]:
    """Scale the role's Deployment to its PDPool and write the PDPool's status; returns (desired, deployment)."""
    pool = kube.get("PDPool", namespace, object_name(name, role))
    if pool is None:
        return (deployment or {}).get("spec", {}).get("replicas", 0), deployment
    wanted = pool["spec"]["replicas"]
    if deployment is not None and deployment["spec"].get("replicas") != wanted:
        if wanted < deployment["spec"].get("replicas", 0):
            _rank_for_removal(kube, namespace, name, role)
        deployment = kube.patch("Deployment", namespace, object_name(name, role), {"spec": {"replicas": wanted}})
    pool_status = status.pool_status(name, role, deployment)
    if not is_subset(pool_status, pool.get("status") or {}):
        kube.patch("PDPool", namespace, object_name(name, role), {"status": pool_status}, status=True)
    return wanted, deployment
