"""The kopf handlers: when the operator acts. What it does lives in `reconcile`.

- PDService created, changed, or found at start-up: validate, create or patch its objects, sync status.
- PDPool created, found at start-up, or spec.replicas changed (kubectl scale, an HPA): sync.
- PDService with spec.autoscaling.enabled: a daemon decides the pools' sizes every interval (`autoscaler`).
- Anything else the operator created (Deployment, Service, ServiceAccount, Role, RoleBinding,
  Secret, NetworkPolicy, PodDisruptionBudget, PDPool) changed or was deleted: restore it from the PDService, then sync.
  So a deleted or edited object is back within seconds, not at the PDService's next change.
No finalizers: the owner references on everything the operator creates let the garbage collector
delete it with the PDService.
"""

from collections.abc import Mapping
from typing import Any

import kopf

from pdserve.operator import autoscaler, reconcile
from pdserve.operator.kube import Kube
from pdserve.operator.names import (
    GROUP,
    LABEL_MANAGED_BY,
    LABEL_SERVICE,
    OPERATOR,
    PDPOOLS,
    PDSERVICES,
    VERSION,
)
from pdserve.operator.spec import problems


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.peering.standalone = True  # one replica; no KopfPeering objects or RBAC for them
    # Serve the CRDs present at start and the namespaces given: no cluster-wide list/watch of
    # CustomResourceDefinitions or Namespaces, so the operator's RBAC stays small.
    settings.scanning.disabled = True
    # Our own annotation prefix, and no `status.kopf` (the PDPool status schema has no room for it).
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    settings.posting.reporting_component = OPERATOR
    # API servers drop idle watches silently; asking for a server-side timeout renews them.
    settings.watching.server_timeout = 300
    memo.kube = Kube.from_environment()


@kopf.on.resume(GROUP, VERSION, PDSERVICES, backoff=10)
@kopf.on.create(GROUP, VERSION, PDSERVICES, backoff=10)
@kopf.on.update(GROUP, VERSION, PDSERVICES, backoff=10)
def reconcile_service(body: kopf.Body, name: str, namespace: str | None, memo: kopf.Memo, **_: Any) -> None:
    namespace = _namespaced(namespace)
    found = problems(name, body.get("spec") or {})
    if found:
        reconcile.sync(memo.kube, namespace, name)  # Ready=False, reason InvalidSpec
        message = "; ".join(found)
        kopf.warn(body, reason="InvalidSpec", message=message)
        raise kopf.PermanentError(f"invalid spec: {message}")  # retried only when the spec changes
    reconcile.ensure_objects(memo.kube, body)
    reconcile.sync(memo.kube, namespace, name)


@kopf.on.resume(GROUP, VERSION, PDPOOLS)
@kopf.on.create(GROUP, VERSION, PDPOOLS)
@kopf.on.field(GROUP, VERSION, PDPOOLS, field="spec.replicas")
def follow_pool(spec: kopf.Spec, namespace: str | None, memo: kopf.Memo, **_: Any) -> None:
    reconcile.sync(memo.kube, _namespaced(namespace), spec["service"])


def _autoscaling_enabled(spec: kopf.Spec, **_: Any) -> bool:
    autoscaling = spec.get("autoscaling")
    return isinstance(autoscaling, Mapping) and autoscaling.get("enabled") is True


@kopf.daemon(GROUP, VERSION, PDSERVICES, when=_autoscaling_enabled, cancellation_timeout=10)
def autoscale(stopped: kopf.DaemonStopped, name: str, namespace: str | None, memo: kopf.Memo, **_: Any) -> None:
    """Runs while spec.autoscaling.enabled is true: kopf stops it when that turns false."""
    autoscaler.run(memo.kube, _namespaced(namespace), name, stopped)


# (group, version, plural) of every kind the operator creates for a PDService.
OWNED_RESOURCES = (
    ("apps", "v1", "deployments"),
    ("", "v1", "services"),
    ("", "v1", "serviceaccounts"),
    ("", "v1", "secrets"),
    ("rbac.authorization.k8s.io", "v1", "roles"),
    ("rbac.authorization.k8s.io", "v1", "rolebindings"),
    ("networking.k8s.io", "v1", "networkpolicies"),
    ("policy", "v1", "poddisruptionbudgets"),  # where served: kopf leaves out kinds it cannot find
    (GROUP, VERSION, PDPOOLS),
)


def owned_object_changed(labels: kopf.Labels, namespace: str | None, memo: kopf.Memo, **_: Any) -> None:
    reconcile.restore(memo.kube, _namespaced(namespace), labels[LABEL_SERVICE])


for _group, _version, _plural in OWNED_RESOURCES:
    kopf.on.event(_group, _version, _plural, labels={LABEL_MANAGED_BY: OPERATOR, LABEL_SERVICE: kopf.PRESENT})(
        owned_object_changed
    )


def _namespaced(namespace: str | None) -> str:
    """Every resource the handlers watch is namespaced: kopf always passes its namespace."""
    if namespace is None:
        raise kopf.PermanentError("a namespaced resource arrived without a namespace")
    return namespace
