"""The objects one PDService owns, built as plain dicts (pure functions; the handlers apply them).

Per PDService N: PDPools N-prefill and N-decode, Deployments and Services N-router, N-prefill,
N-decode, the router's ServiceAccount, Role and RoleBinding N-router, the NetworkPolicy N-engines
on the engine pods, a PodDisruptionBudget per engine pool (N-prefill, N-decode), and (unless
spec.kvTransfer.secretName names the user's own) the Secret N-kv-keys whose items the pods mount by role; with
spec.endpointPicker on, the picker's Deployment and Service N-epp and the Inference Extension's InferencePool N.
Owner references are not set here: the handlers adopt the objects into the live PDService.
"""

import base64
from typing import Any

from pdserve.operator.names import (
    API_VERSION,
    DECODE,
    ENGINE_ROLES,
    ENGINES,
    EPP,
    EPP_GRPC_PORT,
    INFERENCE_POOL,
    KV_KEYS,
    KV_SIDE_CHANNEL_PORT,
    LABEL_ROLE,
    LABEL_SERVICE,
    PORTS,
    ROUTER,
    engines_policy_name,
    kv_keys_name,
    labels,
    object_name,
    selector,
    service_labels,
)
from pdserve.operator.pods import engine_pod, router_pod
from pdserve.operator.spec import EPP_SPEC


def _meta(service: str, namespace: str, role: str) -> dict[str, Any]:
    return {"name": object_name(service, role), "namespace": namespace, "labels": labels(service, role)}


def pool(service: str, namespace: str, role: str, replicas: int) -> dict[str, Any]:
    """The PDPool of an engine pool; `replicas` only seeds it (see `POOL_CREATE_ONLY`)."""
    return {
        "apiVersion": API_VERSION,
        "kind": "PDPool",
        "metadata": _meta(service, namespace, role),
        "spec": {"service": service, "role": role, "replicas": replicas},
    }


# kubectl scale and HPAs own a PDPool's size once it exists; the operator never writes it again.
POOL_CREATE_ONLY = (("spec", "replicas"),)


def kv_keys(service: str, namespace: str, spec: dict[str, Any], bundle: dict[str, str]) -> dict[str, Any] | None:
    """The Secret holding `bundle` (`pdserve.api.keys.new_bundle`: key file name -> contents) as the PDService's
    keys (see `KV_KEYS_CREATE_ONLY`), or None when spec.kvTransfer.secretName names a Secret of the user's,
    which the operator never writes."""
    if spec["kvTransfer"].get("secretName"):
        return None
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": kv_keys_name(service),
            "namespace": namespace,
            "labels": service_labels(service, KV_KEYS),
        },
        "type": "Opaque",
        "data": {name: base64.b64encode(text.encode()).decode() for name, text in sorted(bundle.items())},
    }


# The keys are the user's to rotate once the Secret exists (docs/operator.md), so the operator writes them at
# creation only; `type` cannot change after creation (a patch of it would fail on every pass).
KV_KEYS_CREATE_ONLY = (("data",), ("type",))


def deployment(service: str, namespace: str, role: str, replicas: int, template: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(service, namespace, role),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector(service, role)},
            "template": template,
        },
    }


def service(service: str, namespace: str, role: str) -> dict[str, Any]:
    """ClusterIP for the router (the serving endpoint); headless for engines (for people and monitoring)."""
    ports = [{"name": "http", "port": PORTS[role], "targetPort": "http", "protocol": "TCP"}]
    spec: dict[str, Any] = {"selector": selector(service, role), "ports": ports}
    if role == EPP:  # the gateway's ext_proc calls, and /health and /metrics
        spec["type"] = "ClusterIP"
        ports.append({"name": "grpc", "port": EPP_GRPC_PORT, "targetPort": "grpc", "protocol": "TCP"})
    elif role == ROUTER:
        spec["type"] = "ClusterIP"
    else:
        spec["clusterIP"] = "None"
        ports.append({"name": "kv-side", "port": KV_SIDE_CHANNEL_PORT, "targetPort": "kv-side", "protocol": "TCP"})
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(service, namespace, role), "spec": spec}


def router_rbac(service: str, namespace: str) -> list[dict[str, Any]]:
    """ServiceAccount, Role and RoleBinding that let the router watch the pods it routes to (and the picker, which
    runs as the router, read the InferencePool of its decode pods)."""
    meta = _meta(service, namespace, ROUTER)
    name = meta["name"]
    rbac = "rbac.authorization.k8s.io/v1"
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": dict(meta)},
        {
            "apiVersion": rbac,
            "kind": "Role",
            "metadata": dict(meta),
            "rules": [
                {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
                {
                    "apiGroups": [INFERENCE_POOL[0]],
                    "resources": [INFERENCE_POOL[2]],
                    "resourceNames": [service],
                    "verbs": ["get"],
                },
            ],
        },
        {
            "apiVersion": rbac,
            "kind": "RoleBinding",
            "metadata": dict(meta),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
        },
    ]


def engines_policy(service: str, namespace: str) -> dict[str, Any]:
    """Ingress to the engine pods: their HTTP ports from anywhere (router, Prometheus, probes), every
    port (KV side channel, KV events, UCX) from this PDService's own pods only."""
    own_pods = {LABEL_SERVICE: service}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": engines_policy_name(service),
            "namespace": namespace,
            "labels": service_labels(service, ENGINES),
        },
        "spec": {
            "podSelector": {
                "matchLabels": own_pods,
                "matchExpressions": [{"key": LABEL_ROLE, "operator": "In", "values": list(ENGINE_ROLES)}],
            },
            "policyTypes": ["Ingress"],
            "ingress": [
                {"ports": [{"protocol": "TCP", "port": PORTS[role]} for role in ENGINE_ROLES]},
                # A pod selector without a namespace selector: pods of the policy's namespace only.
                {"from": [{"podSelector": {"matchLabels": dict(own_pods)}}]},
            ],
        },
    }


# The PodDisruptionBudget's apiVersion: policy/v1 is served from Kubernetes 1.21; older servers get
# none (the operator says so in a condition) rather than the deprecated v1beta1.
DISRUPTION_BUDGET = ("policy/v1", "PodDisruptionBudget")


def disruption_budget(service: str, namespace: str, role: str, max_unavailable: int | str) -> dict[str, Any]:
    """How many of a pool's pods voluntary disruptions (node drains, cluster upgrades) may take at once:
    an evicted decode pod ends its streams, an evicted prefill pod its held blocks."""
    api_version, kind = DISRUPTION_BUDGET
    return {
        "apiVersion": api_version,
        "kind": kind,
        "metadata": _meta(service, namespace, role),
        "spec": {"maxUnavailable": max_unavailable, "selector": {"matchLabels": selector(service, role)}},
    }


def inference_pool(service: str, namespace: str, failure_mode: str) -> dict[str, Any]:
    """The Inference Extension's pool of this PDService's decode pods (where requests go; a decode pod sends the
    prefill leg itself), with the picker as its endpoint picker."""
    group, version, _, kind = INFERENCE_POOL
    return {
        "apiVersion": f"{group}/{version}",
        "kind": kind,
        "metadata": {"name": service, "namespace": namespace, "labels": service_labels(service, EPP)},
        "spec": {
            "selector": {"matchLabels": selector(service, DECODE)},
            "targetPorts": [{"number": PORTS[DECODE]}],
            "endpointPickerRef": {
                "name": object_name(service, EPP),
                "port": {"number": EPP_GRPC_PORT},
                "failureMode": failure_mode,
            },
        },
    }


def owned_objects(
    service_name: str,
    namespace: str,
    spec: dict[str, Any],
    pool_replicas: dict[str, int],
    disruption_budgets: bool = True,
    inference_pools: bool = True,
) -> list[dict[str, Any]]:
    """Everything but the PDPools and the KV Secret, in creation order (the NetworkPolicy before
    any engine runs, RBAC before the router that needs it).

    `spec` has its defaults filled (`spec.with_defaults`); `pool_replicas` maps each engine role
    to its PDPool's spec.replicas, the authoritative size of that pool. `disruption_budgets`: False
    where the API server does not serve `DISRUPTION_BUDGET`; `inference_pools`: False where it does not serve the
    Inference Extension's InferencePool (the picker still runs: a gateway may be configured by hand).
    """
    objects = [engines_policy(service_name, namespace), *router_rbac(service_name, namespace)]
    for role in (ROUTER, *ENGINE_ROLES):
        objects.append(service(service_name, namespace, role))
    objects.append(
        deployment(service_name, namespace, ROUTER, spec[ROUTER]["replicas"], router_pod(service_name, namespace, spec))
    )
    for role in ENGINE_ROLES:
        template = engine_pod(service_name, role, spec)
        objects.append(deployment(service_name, namespace, role, pool_replicas[role], template))
        if disruption_budgets:
            objects.append(disruption_budget(service_name, namespace, role, spec[role]["maxUnavailable"]))
    picker = spec[EPP_SPEC]
    if picker["enabled"]:
        objects.append(service(service_name, namespace, EPP))
        template = router_pod(service_name, namespace, spec, EPP, inference_pools)
        objects.append(deployment(service_name, namespace, EPP, picker["replicas"], template))
        if inference_pools:
            objects.append(inference_pool(service_name, namespace, picker["failureMode"]))
    return objects
