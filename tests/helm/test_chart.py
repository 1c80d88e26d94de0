"""The Helm chart (helm/pdserve), rendered by the real Helm library (helm_python, offline).

Every rendered object, the CRDs and the examples' built-in kinds are validated against the
Kubernetes 1.30 OpenAPI schemas (kubernetes_validate, strict: unknown fields fail). Custom
resources are not in those schemas: the example PDServices are checked against the PDService
CRD's own openAPIV3Schema, the HPAs' target against the PDPool CRD, and the ServiceMonitor
(a Prometheus Operator kind) against a small schema of the fields the chart sets.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import helm_python
import jsonschema
import kubernetes_validate
import pytest
import yaml

CHART = Path(__file__).resolve().parents[2] / "helm" / "pdserve"
KUBE_VERSION = "1.30.0"
RELEASE, NAMESPACE = "pds", "pdserve-system"

CUSTOM = {
    "watchNamespace": "llm",
    "image": {"repository": "registry.example.com/ml/pdserve", "tag": "1.2.3-cpu", "pullPolicy": "Always"},
    "resources": {"requests": {"cpu": "200m", "memory": "256Mi"}, "limits": {"cpu": 1, "memory": "1Gi"}},
    "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}, "interval": "30s"},
    "extraArgs": ["--log-level", "debug"],
    "imagePullSecrets": [{"name": "regcred"}],
    "nodeSelector": {"kubernetes.io/os": "linux"},
    "podLabels": {"team": "ml"},
    "test": {"image": {"repository": "registry.example.com/busybox", "tag": "1.37"}},
}

# The operator's permissions (least privilege, docs/operator.md): (apiGroup, resource) -> verbs.
# Exactly what the operator calls (tests/operator records its requests against the emulator).
OPERATOR_RULES = {
    ("pdserve.io", "pdservices"): {"get", "list", "watch", "patch"},
    ("pdserve.io", "pdservices/status"): {"patch"},
    ("pdserve.io", "pdpools/status"): {"patch"},
    ("pdserve.io", "pdpools"): {"get", "list", "watch", "create", "patch"},
    ("pdserve.io", "pdservices/finalizers"): {"update"},
    ("apps", "deployments"): {"get", "list", "watch", "create", "patch"},
    ("", "services"): {"get", "list", "watch", "create", "patch"},
    ("", "serviceaccounts"): {"get", "list", "watch", "create", "patch"},
    ("rbac.authorization.k8s.io", "roles"): {"get", "list", "watch", "create", "patch"},
    ("rbac.authorization.k8s.io", "rolebindings"): {"get", "list", "watch", "create", "patch"},
    ("", "secrets"): {"get", "list", "watch", "create", "patch"},
    ("networking.k8s.io", "networkpolicies"): {"get", "list", "watch", "create", "patch"},
    ("policy", "poddisruptionbudgets"): {"get", "list", "watch", "create", "patch"},
    ("inference.networking.k8s.io", "inferencepools"): {"get", "list", "watch", "create", "patch"},
    ("", "pods"): {"get", "list", "watch", "patch"},
    ("", "events"): {"create"},
    ("", "configmaps"): {"get"},
    ("autoscaling", "horizontalpodautoscalers"): {"list"},
}
# What the operator grants the router's Role: it must hold it itself (RBAC escalation check).
ROUTER_ROLE_RULES = {("", "pods"): {"get", "list", "watch"}}

SERVICE_MONITOR_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object", "required": ["name", "namespace"]},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "namespaceSelector", "endpoints"],
            "properties": {
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
                        "matchExpressions": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "required": ["key", "operator"],
                                "additionalProperties": False,
                                "properties": {
                                    "key": {"type": "string"},
                                    "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                                    "values": {"type": "array", "items": {"type": "string"}},
                                },
                            },
                        },
                    },
                },
                "namespaceSelector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "any": {"type": "boolean"},
                        "matchNames": {"type": "array", "items": {"type": "string"}},
                    },
                },
                "targetLabels": {"type": "array", "items": {"type": "string"}},
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["port", "path"],
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "scheme": {"enum": ["http", "https"]},
                            "interval": {"type": "string", "pattern": "^([0-9]+(ms|s|m|h))+$"},
                            "scrapeTimeout": {"type": "string", "pattern": "^([0-9]+(ms|s|m|h))+$"},
                        },
                    },
                },
            },
        },
    },
}


@pytest.fixture(scope="module")
def chart() -> helm_python.Chart:
    return helm_python.Chart.load(CHART)


def render(chart: helm_python.Chart, values: dict | None = None, namespace: str = NAMESPACE) -> list[dict]:
    manifests = chart.render(copy.deepcopy(values or {}), name=RELEASE, namespace=namespace)
    docs = []
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            continue
        docs.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return docs


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [doc for doc in docs if doc["kind"] == kind]


def one(docs: list[dict], kind: str) -> dict:
    (doc,) = by_kind(docs, kind)
    return doc


def crd(name: str) -> dict:
    return yaml.safe_load((CHART / "crds" / f"{name}.pdserve.io.yaml").read_text())


def example_docs(name: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all((CHART / "examples" / name).read_text()) if doc]


def pod_specs(docs: list[dict]) -> list[tuple[str, dict]]:
    specs = []
    for doc in docs:
        if doc["kind"] == "Pod":
            specs.append((doc["metadata"]["name"], doc["spec"]))
        elif doc["kind"] in {"Deployment", "StatefulSet", "DaemonSet", "Job"}:
            specs.append((doc["metadata"]["name"], doc["spec"]["template"]["spec"]))
    return specs


def operator_container(docs: list[dict]) -> dict:
    (container,) = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return container


def rule_map(role: dict) -> dict[tuple[str, str], set[str]]:
    """(apiGroup, resource) -> verbs; fails on a pair listed twice (the rule set must be plain)."""
    rules: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        assert set(rule) <= {"apiGroups", "resources", "verbs"}, rule  # no resourceNames / nonResourceURLs
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                assert (group, resource) not in rules, f"{group}/{resource} listed twice"
                rules[group, resource] = set(rule["verbs"])
    return rules


def unknown_fields(obj: Any, schema: dict, path: str = "") -> list[str]:
    """Fields the API server would prune from ``obj`` under a structural ``schema``."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    found = []
    if isinstance(obj, dict):
        properties, extra = schema.get("properties", {}), schema.get("additionalProperties")
        for key, value in obj.items():
            if not path and key in {"apiVersion", "kind", "metadata"}:  # ObjectMeta: not in the CRD schema
                continue
            if key in properties:
                found += unknown_fields(value, properties[key], f"{path}.{key}")
            elif isinstance(extra, dict):
                found += unknown_fields(value, extra, f"{path}.{key}")
            else:
                found.append(f"{path}.{key}")
    elif isinstance(obj, list) and "items" in schema:
        for index, item in enumerate(obj):
            found += unknown_fields(item, schema["items"], f"{path}[{index}]")
    return found


# --- chart metadata and lint -------------------------------------------------------------------


def test_chart_metadata(chart: helm_python.Chart) -> None:
    meta = chart.metadata
    assert meta["apiVersion"] == "v2"
    assert meta["appVersion"] and meta["version"]
    assert meta["kubeVersion"].startswith(">=1.25")
    crd_names = {yaml.safe_load(c["data"])["metadata"]["name"] for c in chart.crds}
    assert crd_names == {"pdservices.pdserve.io", "pdpools.pdserve.io"}
    assert chart.schema is not None and chart.schema.get("additionalProperties") is False


@pytest.mark.parametrize("values", [{}, CUSTOM], ids=["default", "custom"])
def test_lint_strict(values: dict) -> None:
    report = helm_python.lint(
        CHART, values=copy.deepcopy(values), strict=True, namespace=NAMESPACE, kube_version=f"v{KUBE_VERSION}"
    )
    assert report["errors"] == []
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert problems == []


# --- rendering -----------------------------------------------------------------------------------


def test_default_render(chart: helm_python.Chart) -> None:
    docs = render(chart)
    kinds = sorted(doc["kind"] for doc in docs)
    assert kinds == sorted(["ClusterRole", "ClusterRoleBinding", "Deployment", "Pod", "Service", "ServiceAccount"])
    for doc in docs:
        labels = doc["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "pdserve"
        assert labels["app.kubernetes.io/instance"] == RELEASE
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        if doc["kind"] not in {"ClusterRole", "ClusterRoleBinding"}:
            assert doc["metadata"]["namespace"] == NAMESPACE

    deployment = one(docs, "Deployment")
    spec = deployment["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
    container = operator_container(docs)
    assert container["image"] == f"pdserve:{chart.metadata['appVersion']}"
    assert container["command"] == ["pdserve", "operator"]
    assert "args" not in container  # no --namespace: every namespace
    probe = container["livenessProbe"]["httpGet"]
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert probe["path"] == "/healthz" and ports[probe["port"]] == 8080
    assert container["resources"] == chart.values["resources"]
    account = one(docs, "ServiceAccount")["metadata"]["name"]
    assert spec["template"]["spec"]["serviceAccountName"] == account


def test_watch_namespace_render(chart: helm_python.Chart) -> None:
    docs = render(chart, {"watchNamespace": "llm"})
    assert not by_kind(docs, "ClusterRole") and not by_kind(docs, "ClusterRoleBinding")
    role, binding = one(docs, "Role"), one(docs, "RoleBinding")
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == "llm"
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    (subject,) = binding["subjects"]
    assert subject == {
        "kind": "ServiceAccount",
        "name": one(docs, "ServiceAccount")["metadata"]["name"],
        "namespace": NAMESPACE,
    }
    assert operator_container(docs)["args"] == ["--namespace", "llm"]
    assert not by_kind(docs, "ServiceMonitor")


def test_custom_render(chart: helm_python.Chart) -> None:
    docs = render(chart, CUSTOM)
    container = operator_container(docs)
    assert container["image"] == "registry.example.com/ml/pdserve:1.2.3-cpu"
    assert container["imagePullPolicy"] == "Always"
    assert container["args"] == ["--namespace", "llm", "--log-level", "debug"]
    assert container["resources"] == CUSTOM["resources"]
    pod = one(docs, "Deployment")["spec"]["template"]
    assert pod["metadata"]["labels"]["team"] == "ml"
    assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["spec"]["nodeSelector"] == {"kubernetes.io/os": "linux"}
    assert one(docs, "Pod")["spec"]["containers"][0]["image"] == "registry.example.com/busybox:1.37"


def test_service_monitor(chart: helm_python.Chart) -> None:
    for values, namespace_selector in (
        (CUSTOM, {"matchNames": ["llm"]}),
        ({"serviceMonitor": {"enabled": True}}, {"any": True}),
    ):
        monitor = one(render(chart, values), "ServiceMonitor")
        jsonschema.validate(monitor, SERVICE_MONITOR_SCHEMA)
        spec = monitor["spec"]
        assert spec["selector"]["matchLabels"] == {"app.kubernetes.io/name": "pdserve"}
        (expression,) = spec["selector"]["matchExpressions"]
        assert expression == {"key": "pdserve.io/role", "operator": "In", "values": ["router", "prefill", "decode"]}
        assert spec["namespaceSelector"] == namespace_selector
        (endpoint,) = spec["endpoints"]
        assert endpoint["port"] == "http" and endpoint["path"] == "/metrics"
        assert set(spec["targetLabels"]) == {"app.kubernetes.io/instance", "pdserve.io/role"}
    monitor = one(render(chart, CUSTOM), "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["endpoints"][0]["interval"] == "30s"


def test_service_monitor_selects_serving_services_only(chart: helm_python.Chart) -> None:
    """The selector matches the Services the operator makes, never the chart's operator Service."""
    docs = render(chart, {"serviceMonitor": {"enabled": True}})
    selector = one(docs, "ServiceMonitor")["spec"]["selector"]

    def selected(labels: dict[str, str]) -> bool:
        return selector["matchLabels"].items() <= labels.items() and all(
            labels.get(e["key"]) in e["values"] for e in selector["matchExpressions"]
        )

    for role in ("router", "prefill", "decode"):
        assert selected(
            {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/instance": "demo", "pdserve.io/role": role}
        )
    assert not selected(one(docs, "Service")["metadata"]["labels"])


def test_health_service_and_test_hook(chart: helm_python.Chart) -> None:
    docs = render(chart)
    service, test_pod = one(docs, "Service"), one(docs, "Pod")
    pod_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    (port,) = service["spec"]["ports"]
    assert port["port"] == 8080 and port["targetPort"] == "health"
    assert test_pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert not service["spec"]["selector"].items() <= test_pod["metadata"]["labels"].items()
    command = test_pod["spec"]["containers"][0]["command"]
    assert command[-1] == f"http://{service['metadata']['name']}.{NAMESPACE}.svc:8080/healthz"


def test_operator_selector_ignores_serving_pods(chart: helm_python.Chart) -> None:
    """A PDService named like the release must not have its pods counted by the operator's Deployment."""
    selector = one(render(chart), "Deployment")["spec"]["selector"]["matchLabels"]
    serving_pod = {
        "app.kubernetes.io/name": "pdserve",
        "app.kubernetes.io/instance": RELEASE,
        "pdserve.io/role": "decode",
    }
    assert not selector.items() <= serving_pod.items()


def test_optional_objects(chart: helm_python.Chart) -> None:
    docs = render(chart, {"rbac": {"create": False}, "serviceAccount": {"create": False, "name": "mine"}})
    assert {doc["kind"] for doc in docs} == {"Deployment", "Service", "Pod"}
    assert one(docs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "mine"
    assert one(render(chart, {"replicaCount": 0}), "Deployment")["spec"]["replicas"] == 0


def test_notes(chart: helm_python.Chart) -> None:
    notes = chart.render({}, name=RELEASE, namespace=NAMESPACE)["pdserve/templates/NOTES.txt"]
    assert "kubectl scale pdpool/NAME-prefill --replicas=N" in notes
    assert "examples/pdservice.yaml" in notes and "NAME-router" in notes


# --- Kubernetes schemas --------------------------------------------------------------------------


@pytest.mark.parametrize("values", [{}, CUSTOM, {"watchNamespace": "llm"}], ids=["default", "custom", "namespaced"])
def test_rendered_objects_valid_for_kubernetes(chart: helm_python.Chart, values: dict) -> None:
    docs = render(chart, values)
    for doc in docs:
        if doc["kind"] == "ServiceMonitor":  # a CRD kind: not in the Kubernetes schemas (test_service_monitor)
            continue
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


def test_crds_valid_for_kubernetes() -> None:
    for name in ("pdservices", "pdpools"):
        kubernetes_validate.validate(crd(name), KUBE_VERSION, strict=True)


def test_examples_valid() -> None:
    """Built-in kinds against Kubernetes; PDServices against the CRD, as the API server would check them."""
    schema = crd("pdservices")["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    services = []
    for name in ("pdservice.yaml", "pdservice-cpu.yaml", "pdservice-tensor-parallel.yaml"):
        for doc in example_docs(name):
            if doc["kind"] == "PDService":
                assert doc["apiVersion"] == "pdserve.io/v1alpha1"
                jsonschema.validate(doc, schema)
                assert unknown_fields(doc, schema) == []
                services.append(doc)
            else:
                kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
    gpu, cpu, parallel = services
    assert gpu["spec"]["model"]["source"] == "pvc" and gpu["spec"]["model"]["claimName"]
    assert gpu["spec"]["router"]["replicas"] == gpu["spec"]["prefill"]["replicas"] == 1
    assert gpu["spec"]["decode"]["replicas"] == 1
    assert gpu["spec"]["prefill"]["gpus"] == gpu["spec"]["decode"]["gpus"] == 1
    assert cpu["spec"]["prefill"]["gpus"] == cpu["spec"]["decode"]["gpus"] == 0
    assert cpu["spec"]["kvTransfer"]["backend"] == "tcp"
    # Tensor parallelism per pool; gpus left to follow the size (one GPU per rank).
    assert parallel["spec"]["prefill"]["tensorParallelSize"] == 2
    assert parallel["spec"]["decode"]["tensorParallelSize"] == 4
    assert "gpus" not in parallel["spec"]["prefill"] and "gpus" not in parallel["spec"]["decode"]


def test_crd_schema_check_is_not_vacuous() -> None:
    """The same checks reject a broken PDService: wrong type, bad enum, a typo the server would prune."""
    schema = crd("pdservices")["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert schema["properties"]["spec"]["properties"]["decode"] == schema["properties"]["spec"]["properties"]["prefill"]
    (good,) = [doc for doc in example_docs("pdservice-cpu.yaml") if doc["kind"] == "PDService"]
    for path, value in (
        (("decode", "gpus"), "1"),
        (("kvTransfer", "backend"), "rdma"),
        (("prefill", "replicas"), -1),
        (("prefill", "tensorParallelSize"), 0),
        (("decode", "tensorParallelSize"), 65),
        (("decode", "tensorParallelSize"), "2"),
        (("decode", "shmSize"), "lots"),
    ):
        bad = copy.deepcopy(good)
        bad["spec"][path[0]][path[1]] = value
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    typo = copy.deepcopy(good)
    typo["spec"]["decode"]["replica"] = 2
    assert unknown_fields(typo, schema) == [".spec.decode.replica"]


def test_crd_schema_takes_kv_cache() -> None:
    """A pool's kvCache (KV tiers) as the example writes it passes the CRD's schema whole; bad values fail it."""
    schema = crd("pdservices")["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    docs = example_docs("pdservice-kv-tiers.yaml")
    (service,) = [doc for doc in docs if doc["kind"] == "PDService"]
    jsonschema.validate(service, schema)
    assert unknown_fields(service, schema) == []  # nothing of kvCache would be pruned
    prefill, decode = service["spec"]["prefill"]["kvCache"], service["spec"]["decode"]["kvCache"]
    assert {"hostMemory", "disk", "shared", "maxAge"} <= prefill.keys()
    assert decode["shared"]["readOnly"] is True
    for doc in docs:
        if doc["kind"] != "PDService":
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
    for path, value in (
        (("hostMemory",), "8GB"),
        (("disk",), {}),
        (("disk", "size"), 50),
        (("shared",), {"readOnly": True}),
        (("shared", "claimName"), "KV_Cache"),
        (("shared", "readOnly"), "yes"),
        (("shared", "size"), "lots"),
    ):
        bad = copy.deepcopy(service)
        parent = bad["spec"]["prefill"]["kvCache"]
        for key in path[:-1]:
            parent = parent[key]
        parent[path[-1]] = value
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    typo = copy.deepcopy(service)
    typo["spec"]["decode"]["kvCache"]["shared"]["readonly"] = True
    assert unknown_fields(typo, schema) == [".spec.decode.kvCache.shared.readonly"]


def test_hpa_example_targets_pdpools() -> None:
    pool_crd = crd("pdpools")
    (version,) = pool_crd["spec"]["versions"]
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"
    assert version["subresources"]["scale"]["labelSelectorPath"] == ".status.selector"
    hpas = example_docs("hpa.yaml")
    assert {hpa["spec"]["scaleTargetRef"]["name"] for hpa in hpas} == {"qwen3-prefill", "qwen3-decode"}
    for hpa in hpas:
        kubernetes_validate.validate(hpa, KUBE_VERSION, strict=True)
        target = hpa["spec"]["scaleTargetRef"]
        assert target["kind"] == pool_crd["spec"]["names"]["kind"]
        assert target["apiVersion"] == f"{pool_crd['spec']['group']}/{version['name']}"


# --- values.schema.json --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "values",
    [
        {"replicaCount": "1"},
        {"replicaCount": 2},
        {"image": {"repository": "pdserve", "pullPolicy": "Sometimes"}},
        {"image": {"repository": "pdserve", "tag": 1}},
        {"serviceMonitor": {"enabled": "yes"}},
        {"serviceMonitor": {"interval": "soon"}},
        {"watchNamespace": "Not_A_Namespace"},
        {"resources": {"limits": {"memory": "lots"}}},
        {"resources": {"limit": {"memory": "1Gi"}}},
        {"rbac": {"create": "true"}},
        {"extraArgs": "--log-level debug"},
        {"replicas": 1},
    ],
    ids=json.dumps,
)
def test_schema_rejects_bad_values(chart: helm_python.Chart, values: dict) -> None:
    key = next(iter(values))
    with pytest.raises(helm_python.HelmValuesError, match=f"{key}"):
        chart.render(copy.deepcopy(values), name=RELEASE, namespace=NAMESPACE)
    report = helm_python.lint(CHART, values=copy.deepcopy(values), strict=True)
    assert report["errors"] or any(m["severity"] == 3 for m in report["messages"])


def test_schema_accepts_good_values(chart: helm_python.Chart) -> None:
    chart.validate_schema(copy.deepcopy(CUSTOM))
    chart.validate_schema({"resources": {"limits": {"cpu": 0.5, "memory": "512Mi"}}, "replicaCount": 0})


# --- security ------------------------------------------------------------------------------------


@pytest.mark.parametrize("values", [{}, {"watchNamespace": "llm"}], ids=["cluster", "namespaced"])
def test_rbac_least_privilege(chart: helm_python.Chart, values: dict) -> None:
    docs = render(chart, values)
    kind = "Role" if values else "ClusterRole"
    role = one(docs, kind)
    for rule in role["rules"]:
        for field in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[field] and all("*" not in item for item in rule[field]), rule
    rules = rule_map(role)
    assert rules == OPERATOR_RULES
    for key, verbs in ROUTER_ROLE_RULES.items():
        assert verbs <= rules[key]
    binding = one(docs, f"{kind}Binding")
    assert binding["roleRef"]["kind"] == kind and binding["roleRef"]["name"] == role["metadata"]["name"]


@pytest.mark.parametrize("values", [{}, CUSTOM], ids=["default", "custom"])
def test_containers_non_root(chart: helm_python.Chart, values: dict) -> None:
    specs = pod_specs(render(chart, values))
    specs += pod_specs(example_docs("pdservice-cpu.yaml"))
    assert len(specs) == 3  # operator, helm test pod, demo-model Job
    for name, spec in specs:
        pod = spec.get("securityContext", {})
        assert pod.get("runAsNonRoot") is True and pod.get("runAsUser", 1000) != 0, name
        for container in spec["containers"] + spec.get("initContainers", []):
            context = container.get("securityContext", {})
            assert context.get("runAsNonRoot", True) is True, name
            assert context.get("runAsUser", pod.get("runAsUser")) != 0, name
            assert context.get("privileged", False) is False, name
            assert context["allowPrivilegeEscalation"] is False, name
            assert context["readOnlyRootFilesystem"] is True, name
            assert context["capabilities"]["drop"] == ["ALL"] and "add" not in context["capabilities"], name
