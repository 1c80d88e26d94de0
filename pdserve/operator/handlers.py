"""The kopf handlers: when the operator acts. What it does lives in `reconcile`.

- PDService created, changed, or found at start-up: validate, create or patch its objects, sync status.
- PDPool created, found at start-up, or spec.replicas changed (kubectl scale, an HPA): sync.
- A Deployment the operator manages changed (pods became ready, someone resized it): sync.
No finalizers: the owner references on everything the operator creates let the garbage collector
delete it with the PDService.
"""

from typing import Any

import kopf

from pdserve.operator import reconcile
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


@kopf.on.event("apps", "v1", "deployments", labels={LABEL_MANAGED_BY: OPERATOR, LABEL_SERVICE: kopf.PRESENT})
def deployment_changed(labels: kopf.Labels, namespace: str | None, memo: kopf.Memo, **_: Any) -> None:
    reconcile.sync(memo.kube, _namespaced(namespace), labels[LABEL_SERVICE])


def _namespaced(namespace: str | None) -> str:
    """Every resource the handlers watch is namespaced: kopf always passes its namespace."""
    if namespace is None:
        raise kopf.PermanentError("a namespaced resource arrived without a namespace")
    return namespace
