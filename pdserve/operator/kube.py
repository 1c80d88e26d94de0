"""Reading and writing the operator's objects through the `kubernetes` client, as plain JSON dicts.

Owns the create-or-patch rule: read the object; create it when absent; otherwise send a JSON merge
patch only when some wanted field differs from what the server holds, so a second pass over an
unchanged PDService writes nothing. Merge patches (not strategic ones) work on every API server and
for custom resources; they replace lists whole, which suits objects the operator fully owns.
"""

import json
import logging
from collections.abc import Iterable, Mapping
from typing import Any

import kubernetes

from pdserve.operator.names import GROUP, INFERENCE_POOL, PDPOOLS, PDSERVICES, VERSION

logger = logging.getLogger(__name__)

MERGE_PATCH = "application/merge-patch+json"

# kind -> (API class, method suffix, apiVersion) for the built-in kinds the operator writes or reads.
_BUILTIN: dict[str, tuple[Any, str, str]] = {
    "Deployment": (kubernetes.client.AppsV1Api, "namespaced_deployment", "apps/v1"),
    "Pod": (kubernetes.client.CoreV1Api, "namespaced_pod", "v1"),
    "Service": (kubernetes.client.CoreV1Api, "namespaced_service", "v1"),
    "Secret": (kubernetes.client.CoreV1Api, "namespaced_secret", "v1"),
    "ConfigMap": (kubernetes.client.CoreV1Api, "namespaced_config_map", "v1"),
    "ServiceAccount": (kubernetes.client.CoreV1Api, "namespaced_service_account", "v1"),
    "Role": (kubernetes.client.RbacAuthorizationV1Api, "namespaced_role", "rbac.authorization.k8s.io/v1"),
    "RoleBinding": (
        kubernetes.client.RbacAuthorizationV1Api,
        "namespaced_role_binding",
        "rbac.authorization.k8s.io/v1",
    ),
    "NetworkPolicy": (kubernetes.client.NetworkingV1Api, "namespaced_network_policy", "networking.k8s.io/v1"),
    "PodDisruptionBudget": (kubernetes.client.PolicyV1Api, "namespaced_pod_disruption_budget", "policy/v1"),
    "HorizontalPodAutoscaler": (
        kubernetes.client.AutoscalingV2Api,
        "namespaced_horizontal_pod_autoscaler",
        "autoscaling/v2",
    ),
}
# kind -> (group, version, plural) of the custom resources the operator writes or reads.
_CUSTOM = {
    "PDService": (GROUP, VERSION, PDSERVICES),
    "PDPool": (GROUP, VERSION, PDPOOLS),
    INFERENCE_POOL[3]: INFERENCE_POOL[:3],
}


def is_subset(wanted: Any, actual: Any) -> bool:
    """Whether `actual` already holds `wanted`: extra keys in `actual` (server defaults) do not count.

    A None in `wanted` means "absent" (what a merge patch's null makes of a key).
    """
    if isinstance(wanted, Mapping):
        return isinstance(actual, Mapping) and all(
            actual.get(key) is None if value is None else key in actual and is_subset(value, actual[key])
            for key, value in wanted.items()
        )
    if isinstance(wanted, list):
        return isinstance(actual, list) and len(wanted) == len(actual) and all(map(is_subset, wanted, actual))
    return wanted == actual


def without_nulls(obj: Any) -> Any:
    """The object as a create request wants it: the nulls that mean "remove" in patches left out."""
    if isinstance(obj, Mapping):
        return {key: without_nulls(value) for key, value in obj.items() if value is not None}
    if isinstance(obj, list):
        return [without_nulls(item) for item in obj]
    return obj


def _dropped(obj: Mapping[str, Any], paths: Iterable[tuple[str, ...]]) -> dict[str, Any]:
    """A deep copy of obj without the given key paths."""
    copy = json.loads(json.dumps(obj))
    for path in paths:
        parent = copy
        for key in path[:-1]:
            parent = parent.get(key, {})
        parent.pop(path[-1], None)
    return copy


class Kube:
    """The operator's view of the API: get, create, merge-patch and apply objects given as dicts."""

    def __init__(self, client: kubernetes.client.ApiClient | None = None) -> None:
        self.client = client or kubernetes.client.ApiClient()
        self._served: dict[str, bool] = {}

    def served(self, kind: str) -> bool:
        """Whether the API server serves this kind (built-in, or another project's custom resource) at the
        apiVersion the operator writes (API discovery, asked once; the answer is logged when it is no)."""
        if kind not in self._served:
            api_version = f"{_CUSTOM[kind][0]}/{_CUSTOM[kind][1]}" if kind in _CUSTOM else _BUILTIN[kind][2]
            # The group version's discovery document, asked as kubectl asks (the client's generated
            # get_api_resources adds a trailing slash that not every server takes).
            path = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
            try:
                request = self.client.param_serialize(
                    "GET", path, header_params={"Accept": "application/json"}, auth_settings=["BearerToken"]
                )
                response = self.client.call_api(*request)
                response.read()
                if not 200 <= response.status < 300:
                    raise kubernetes.client.ApiException(http_resp=response)
                resources = json.loads(response.data or b"{}").get("resources", [])
                self._served[kind] = any(r.get("kind") == kind for r in resources)
            except kubernetes.client.ApiException as e:
                if e.status != 404:
                    raise
                self._served[kind] = False
            if not self._served[kind]:
                logger.warning("the API server does not serve %s at the version the operator uses", kind)
        return self._served[kind]

    @classmethod
    def from_environment(cls) -> "Kube":
        """In a pod: its service account; elsewhere: the kubeconfig ($KUBECONFIG or ~/.kube/config)."""
        try:
            kubernetes.config.load_incluster_config()
        except kubernetes.config.ConfigException:
            kubernetes.config.load_kube_config()
        return cls()

    def _call(self, kind: str, verb: str, *args: Any, status: bool = False, **kwargs: Any) -> dict[str, Any]:
        if kind in _CUSTOM:
            api: Any = kubernetes.client.CustomObjectsApi(self.client)
            suffix = "namespaced_custom_object" + ("_status" if status else "")
            method = getattr(api, f"{'get' if verb == 'read' else verb}_{suffix}")
            group, version, plural = _CUSTOM[kind]
            args = (group, version, args[0], plural, *args[1:])
        else:
            api_class, suffix, _ = _BUILTIN[kind]
            method = getattr(api_class(self.client), f"{verb}_{suffix}{'_status' if status else ''}")
        # Raw JSON, not the client's models: the dicts compare directly with the manifests.
        response = method(*args, _preload_content=False, **kwargs)
        return json.loads(response.data)

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The object, or None when there is none."""
        try:
            if kind in _CUSTOM:
                return self._call(kind, "read", namespace, name)
            return self._call(kind, "read", name, namespace)
        except kubernetes.client.ApiException as e:
            if e.status == 404:
                return None
            raise

    def list(self, kind: str, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        """The objects of a built-in kind in the namespace that match the label selector."""
        api_class, suffix, _ = _BUILTIN[kind]
        method = getattr(api_class(self.client), f"list_{suffix}")
        response = method(namespace, label_selector=label_selector, _preload_content=False)
        items: list[dict[str, Any]] = json.loads(response.data)["items"]
        return items

    def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        body = without_nulls(obj)
        return self._call(obj["kind"], "create", obj["metadata"]["namespace"], body=body)

    def patch(
        self, kind: str, namespace: str, name: str, patch: Mapping[str, Any], status: bool = False
    ) -> dict[str, Any]:
        """JSON merge patch of the object, or of its status subresource."""
        if kind in _CUSTOM:
            return self._call(kind, "patch", namespace, name, body=patch, status=status, _content_type=MERGE_PATCH)
        return self._call(kind, "patch", name, namespace, body=patch, status=status, _content_type=MERGE_PATCH)

    def apply(self, obj: Mapping[str, Any], create_only: Iterable[tuple[str, ...]] = ()) -> dict[str, Any]:
        """Create obj, or patch the existing object where it differs; returns the object as stored.

        Fields on the `create_only` key paths are written at creation and never patched.
        """
        meta = obj["metadata"]
        current = self.get(obj["kind"], meta["namespace"], meta["name"])
        if current is None:
            return self.create(obj)
        wanted = _dropped(obj, create_only)
        if is_subset(wanted, current):
            return current
        return self.patch(obj["kind"], meta["namespace"], meta["name"], wanted)
