"""The manifest builders: commands, environment, probes, resources, volumes, labels, RBAC, the KV
Secret and the engines' NetworkPolicy."""

import argparse
import base64
import pathlib

import jsonschema
import pytest
import yaml

from pdserve.api.keys import new_bundle
from pdserve.cli import build_parser
from pdserve.kvtransfer.tiers.config import KVTierConfig
from pdserve.operator import manifests
from pdserve.operator.kube import without_nulls
from pdserve.operator.pods import engine_pod, router_pod
from pdserve.operator.spec import problems, with_defaults
from tests.operator.helpers import spec

HELM = pathlib.Path(__file__).resolve().parents[2] / "helm/pdserve"
LABELS = {
    "app.kubernetes.io/name": "pdserve",
    "app.kubernetes.io/instance": "llm",
    "app.kubernetes.io/component": "prefill",
    "app.kubernetes.io/managed-by": "pdserve-operator",
    "pdserve.io/role": "prefill",
    "pdserve.io/service": "llm",
}
SERVICE_LABELS = {key: value for key, value in LABELS.items() if key != "pdserve.io/role"}


def full(**fields):
    return with_defaults(spec(**fields))


def container(pod):
    (only,) = pod["spec"]["containers"]
    return only


def objects(**fields):
    return manifests.owned_objects("llm", "ns", full(**fields), {"prefill": 2, "decode": 3})


def by_kind_name(objs):
    return {(obj["kind"], obj["metadata"]["name"]): obj for obj in objs}


def test_engine_command_has_the_cli_flags_then_the_users():
    fields = {
        "model": {"source": "pvc", "claimName": "m", "path": "qwen/", "servedModelName": "Qwen/Qwen3"},
        "kvTransfer": {"leaseSeconds": 2.5, "transferTimeoutSeconds": 10, "loadFailure": "fail"},
        "prefill": {"engineArgs": ["--max-model-len", "8192"]},
    }
    assert container(engine_pod("llm", "prefill", full(**fields)))["command"] == [
        "pdserve",
        "prefill",
        "--host",
        "0.0.0.0",
        "--port",
        "8100",
        "--model",
        "/models/model/qwen",
        "--served-model-name",
        "Qwen/Qwen3",
        "--kv-transfer",
        "nixl",
        "--kv-side-channel-port",
        "5600",
        "--kv-lease-seconds",
        "2.5",
        "--kv-transfer-timeout",
        "10",
        "--kv-load-failure",
        "fail",
        "--kv-keys",
        "/etc/pdserve/kv-keys",
        "--scheduling-policy",
        "priority",
        "--max-model-len",
        "8192",
    ]
    decode = container(engine_pod("llm", "decode", full()))["command"]
    assert decode[:8] == ["pdserve", "decode", "--host", "0.0.0.0", "--port", "8200", "--model", "/models/model"]
    assert decode[decode.index("--served-model-name") + 1] == "llm"


def test_engine_command_passes_the_tensor_parallel_size_before_the_users_flags():
    fields = {"prefill": {"tensorParallelSize": 2, "engineArgs": ["--max-model-len", "8192"]}}
    command = container(engine_pod("llm", "prefill", full(**fields)))["command"]
    assert command[-4:] == ["--tensor-parallel-size", "2", "--max-model-len", "8192"]
    assert command[command.index("--scheduling-policy") + 2] == "--tensor-parallel-size"
    # Size 1 is the engine's default: the command stays as it was.
    decode = container(engine_pod("llm", "decode", full(**fields)))["command"]
    assert "--tensor-parallel-size" not in decode and "-tp" not in decode


def test_router_command_discovers_its_own_pods():
    pod = router_pod("llm", "ns", full(router={"args": ["--routing", "prefix-load"]}))
    assert container(pod)["command"] == [
        "pdserve",
        "router",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
        "--discovery",
        "kubernetes",
        "--namespace",
        "ns",
        "--selector",
        "app.kubernetes.io/instance=llm",
        "--kv-keys",
        "/etc/pdserve/kv-keys",
        "--router-replicas",
        "1",
        "--tokenizer",
        "/models/model",
        "--routing",
        "prefix-load",
    ]
    assert pod["spec"]["serviceAccountName"] == "llm-router"
    # The tokenizer (prefix-aware routing) comes from the model volume, mounted read-only.
    assert {"name": "model", "mountPath": "/models/model", "readOnly": True} in container(pod)["volumeMounts"]
    downloaded = router_pod("llm", "ns", full(model={"source": "huggingface", "repo": "org/model"}))
    assert "--tokenizer" not in container(downloaded)["command"]  # a per-pod download: routes by load


def test_engine_environment_ports_and_probes():
    engine = container(engine_pod("llm", "prefill", full(kvTransfer={"ucxTransports": "rc,tcp"})))
    env = {item["name"]: item for item in engine["env"]}
    assert env["PDSERVE_KV_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert env["UCX_TLS"]["value"] == "rc,tcp"
    assert env["OMP_WAIT_POLICY"]["value"] == "PASSIVE"
    assert {(p["name"], p["containerPort"]) for p in engine["ports"]} == {("http", 8100), ("kv-side", 5600)}
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert engine[probe]["httpGet"] == {"path": "/health", "port": "http"}
    startup = engine["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 20 * 60  # room to load a model


def test_gpus_and_rdma_merge_into_the_users_resources():
    fields = {
        "decode": {"gpus": 2, "resources": {"requests": {"cpu": "4"}, "limits": {"memory": "32Gi"}}},
        "kvTransfer": {"rdmaResource": "rdma/hca_shared_devices_a"},
    }
    assert container(engine_pod("llm", "decode", full(**fields)))["resources"] == {
        "requests": {"cpu": "4"},
        "limits": {"memory": "32Gi", "nvidia.com/gpu": "2", "rdma/hca_shared_devices_a": "1"},
    }
    assert container(engine_pod("llm", "decode", full(decode={"gpus": 0})))["resources"] == {}


def test_gpus_follow_the_tensor_parallel_size():
    pod = engine_pod("llm", "decode", full(decode={"tensorParallelSize": 4}))
    assert container(pod)["resources"] == {"limits": {"nvidia.com/gpu": "4"}}
    cpu = engine_pod("llm", "decode", full(decode={"tensorParallelSize": 4, "gpus": 0}))
    assert container(cpu)["resources"] == {}
    assert "--tensor-parallel-size" in container(cpu)["command"]  # CPU ranks: processes, no GPUs


def shm(pod):
    """The pod's /dev/shm volume and the engine's mount of it (None, None when it has none)."""
    volumes = [v for v in pod["spec"]["volumes"] if v["name"] == "shm"]
    mounts = [m for m in container(pod)["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    assert len(volumes) == len(mounts) <= 1
    return (volumes[0], mounts[0]) if volumes else (None, None)


@pytest.mark.parametrize(
    ("pool", "size"),
    [
        ({"tensorParallelSize": 2}, "2Gi"),
        ({"tensorParallelSize": 4, "gpus": 0}, "4Gi"),
        ({"tensorParallelSize": 8, "shmSize": "512Mi"}, "512Mi"),
        ({"shmSize": "256Mi"}, "256Mi"),  # size 1: only when asked for
        ({}, None),
        ({"tensorParallelSize": 1, "gpus": 2}, None),
    ],
)
def test_tensor_parallel_pods_get_a_memory_backed_dev_shm(pool, size):
    pod = engine_pod("llm", "decode", full(decode=pool))
    volume, mount = shm(pod)
    if size is None:
        assert volume is None  # the runtime's 64 MiB /dev/shm: one rank has no peer to share it with
        return
    assert volume == {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": size}}
    assert mount == {"name": "shm", "mountPath": "/dev/shm"}
    assert shm(engine_pod("llm", "prefill", full(decode=pool))) == (None, None)  # per pool


def test_engine_pods_are_annotated_with_their_tensor_parallel_size():
    fields = {"prefill": {"tensorParallelSize": 2}, "decode": {"tensorParallelSize": 4}}
    objs = by_kind_name(objects(**fields))
    for role, size in (("prefill", "2"), ("decode", "4")):
        template = objs["Deployment", f"llm-{role}"]["spec"]["template"]
        assert template["metadata"]["annotations"] == {"pdserve.io/tensor-parallel-size": size}
    # Size 1 is said too, so that a pool set back to 1 does not keep an old value.
    pod = engine_pod("llm", "prefill", full())
    assert pod["metadata"]["annotations"] == {"pdserve.io/tensor-parallel-size": "1"}
    assert "annotations" not in router_pod("llm", "ns", full())["metadata"]


def test_grace_period_covers_the_kv_lease_on_prefill_and_the_drain_on_decode():
    assert engine_pod("llm", "prefill", full())["spec"]["terminationGracePeriodSeconds"] == 60
    pod = engine_pod("llm", "prefill", full(kvTransfer={"leaseSeconds": 2.5}))
    assert pod["spec"]["terminationGracePeriodSeconds"] == 33
    # A decode pod hands its streams to the router instead of waiting for them: its drain is short.
    decode = engine_pod("llm", "decode", full(kvTransfer={"leaseSeconds": 120}))
    assert decode["spec"]["terminationGracePeriodSeconds"] == 35
    command = decode["spec"]["containers"][0]["command"]
    assert command[command.index("--drain-timeout") + 1] == "30"
    assert "--drain-timeout" not in engine_pod("llm", "prefill", full())["spec"]["containers"][0]["command"]


@pytest.mark.parametrize(
    ("model", "volume"),
    [
        ({"source": "pvc", "claimName": "m"}, {"persistentVolumeClaim": {"claimName": "m", "readOnly": True}}),
        ({"source": "hostPath", "hostPath": "/data"}, {"hostPath": {"path": "/data", "type": "Directory"}}),
        ({"source": "huggingface", "repo": "Qwen/Qwen3-0.6B"}, {"emptyDir": {}}),
    ],
)
def test_model_volume_is_mounted_read_only_at_models_model(model, volume):
    pod = engine_pod("llm", "decode", full(model=model))
    assert pod["spec"]["volumes"][0] == {"name": "model", **volume}
    assert {"name": "model", "mountPath": "/models/model", "readOnly": True} in container(pod)["volumeMounts"]
    if model["source"] != "huggingface":
        assert pod["spec"]["initContainers"] is None  # a merge patch removes a download left from before


def test_huggingface_model_is_downloaded_by_an_init_container():
    model = {"source": "huggingface", "repo": "Qwen/Qwen3-0.6B", "revision": "abc123"}
    (init,) = engine_pod("llm", "prefill", full(model=model))["spec"]["initContainers"]
    assert init["command"][:2] == ["python", "-c"]
    assert "snapshot_download" in init["command"][2]
    assert init["command"][3:] == ["Qwen/Qwen3-0.6B", "abc123", "/models/model"]
    assert {"name": "model", "mountPath": "/models/model"} in init["volumeMounts"]
    assert init["image"] == "pdserve:test"


def test_node_placement_is_per_pool():
    toleration = {"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}
    fields = {"prefill": {"nodeSelector": {"pool": "h100"}, "tolerations": [toleration]}}
    prefill = engine_pod("llm", "prefill", full(**fields))["spec"]
    assert prefill["nodeSelector"] == {"pool": "h100"}
    assert prefill["tolerations"] == [toleration]
    decode = engine_pod("llm", "decode", full(**fields))["spec"]
    assert decode["nodeSelector"] is None and decode["tolerations"] is None


def test_pods_run_as_non_root_without_privilege_escalation():
    for pod in (engine_pod("llm", "prefill", full()), router_pod("llm", "ns", full())):
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
        assert pod["spec"]["securityContext"]["runAsUser"] == 1000
        assert container(pod)["securityContext"]["allowPrivilegeEscalation"] is False


def all_pods(**fields):
    return {
        "router": router_pod("llm", "ns", full(**fields)),
        **{role: engine_pod("llm", role, full(**fields)) for role in ("prefill", "decode")},
    }


@pytest.mark.parametrize("fields", [{}, {"model": {"source": "huggingface", "repo": "Qwen/Qwen3-0.6B"}}])
def test_every_pod_reads_its_roles_keys_from_the_keys_volume(fields):
    # Before, one secret in every pod: an engine pod could sign as the router. Now no engine pod mounts router.key.
    files = {
        "router": ["router.key", "events.key"],
        "prefill": ["router.pub", "engine.key", "events.key"],
        "decode": ["router.pub", "engine.key", "events.key"],
    }
    for role, pod in all_pods(**fields).items():
        command = container(pod)["command"]
        assert command[command.index("--kv-keys") + 1] == "/etc/pdserve/kv-keys", role
        mount = {"name": "kv-keys", "mountPath": "/etc/pdserve/kv-keys", "readOnly": True}
        assert mount in container(pod)["volumeMounts"], role
        secret = {
            "secretName": "llm-kv-keys",
            "defaultMode": 0o400,
            "items": [{"key": name, "path": name} for name in files[role]],
        }
        assert {"name": "kv-keys", "secret": secret} in pod["spec"]["volumes"], role
        # Secret volumes belong to root; fsGroup makes the 0400 file readable by the pod's user (1000).
        assert pod["spec"]["securityContext"]["fsGroup"] == pod["spec"]["securityContext"]["runAsUser"] == 1000


def test_the_operators_kv_keys():
    bundle = new_bundle()
    secret = manifests.kv_keys("llm", "ns", full(), bundle)
    assert secret == {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": "llm-kv-keys",
            "namespace": "ns",
            "labels": SERVICE_LABELS | {"app.kubernetes.io/component": "kv-keys"},
        },
        "type": "Opaque",
        "data": {name: base64.b64encode(bundle[name].encode()).decode() for name in sorted(bundle)},
    }
    assert sorted(bundle) == sorted(["router.key", "router.pub", "engine.key", "events.key"])
    # Applied apart, create-only: rotating it is the user's (test_kube.py, test_operator.py).
    assert "Secret" not in [obj["kind"] for obj in objects()]


def test_a_named_secret_replaces_the_operators():
    fields = {"kvTransfer": {"secretName": "team-kv.v2"}}
    assert manifests.kv_keys("llm", "ns", full(**fields), new_bundle()) is None
    for role, pod in all_pods(**fields).items():
        (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "kv-keys"]
        assert volume["secret"]["secretName"] == "team-kv.v2", role
        assert "engine.key" in [item["key"] for item in volume["secret"]["items"]] or role == "router", role


def test_the_engines_network_policy():
    policy = by_kind_name(objects())["NetworkPolicy", "llm-engines"]
    assert policy["apiVersion"] == "networking.k8s.io/v1"
    assert policy["metadata"]["labels"] == SERVICE_LABELS | {"app.kubernetes.io/component": "engines"}
    assert policy["spec"] == {
        "podSelector": {
            "matchLabels": {"pdserve.io/service": "llm"},
            "matchExpressions": [{"key": "pdserve.io/role", "operator": "In", "values": ["prefill", "decode"]}],
        },
        "policyTypes": ["Ingress"],
        "ingress": [
            # The engines' HTTP ports from anywhere: router, Prometheus, kubelet probes.
            {"ports": [{"protocol": "TCP", "port": 8100}, {"protocol": "TCP", "port": 8200}]},
            # Every port (side channel, KV events, UCX) from this PDService's pods, in its namespace.
            {"from": [{"podSelector": {"matchLabels": {"pdserve.io/service": "llm"}}}]},
        ],
    }
    kinds = [obj["kind"] for obj in objects()]
    assert kinds.index("NetworkPolicy") < kinds.index("Deployment")  # no engine runs unprotected


def test_every_object_is_labelled_and_selects_its_own_pods():
    objs = objects()
    assert len(objs) == 12
    for obj in objs:
        assert obj["metadata"]["namespace"] == "ns"
        if obj["kind"] == "NetworkPolicy":
            continue  # of the whole PDService, no role (test_the_engines_network_policy)
        role = obj["metadata"]["name"].removeprefix("llm-")
        assert obj["metadata"]["labels"] == {**LABELS, "app.kubernetes.io/component": role, "pdserve.io/role": role}
        if obj["kind"] in ("Deployment", "PodDisruptionBudget"):
            selector = obj["spec"]["selector"]["matchLabels"]
            assert selector == {"app.kubernetes.io/instance": "llm", "pdserve.io/role": role}
        if obj["kind"] == "Deployment":
            assert obj["spec"]["template"]["metadata"]["labels"] == obj["metadata"]["labels"]


def test_deployment_sizes_come_from_the_pools_and_the_router_spec():
    objs = by_kind_name(objects(router={"replicas": 4}, prefill={"replicas": 9}))
    assert objs["Deployment", "llm-router"]["spec"]["replicas"] == 4
    assert objs["Deployment", "llm-prefill"]["spec"]["replicas"] == 2  # the PDPool's, not spec.prefill's
    assert objs["Deployment", "llm-decode"]["spec"]["replicas"] == 3


def test_services():
    objs = by_kind_name(objects())
    router = objs["Service", "llm-router"]["spec"]
    assert router["type"] == "ClusterIP"
    assert router["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}]
    assert router["selector"] == {"app.kubernetes.io/instance": "llm", "pdserve.io/role": "router"}
    prefill = objs["Service", "llm-prefill"]["spec"]
    assert prefill["clusterIP"] == "None"
    assert [(p["name"], p["port"]) for p in prefill["ports"]] == [("http", 8100), ("kv-side", 5600)]


def test_router_rbac_reads_pods_and_its_own_inference_pool_in_its_namespace_only():
    objs = by_kind_name(objects())
    role = objs["Role", "llm-router"]
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
        {
            "apiGroups": ["inference.networking.k8s.io"],
            "resources": ["inferencepools"],
            "resourceNames": ["llm"],
            "verbs": ["get"],
        },
    ]
    binding = objs["RoleBinding", "llm-router"]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "llm-router"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "llm-router", "namespace": "ns"}]
    kinds = [obj["kind"] for obj in objects()]
    assert kinds.index("RoleBinding") < kinds.index("Deployment")  # the router can list pods at start


def test_pool_matches_the_crd_schema():
    crd = yaml.safe_load((HELM / "crds/pdpools.pdserve.io.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    pool = manifests.pool("llm", "ns", "decode", 3)
    jsonschema.validate(pool, schema)
    assert pool["spec"] == {"service": "llm", "role": "decode", "replicas": 3}
    assert pool["metadata"]["name"] == "llm-decode"


def test_objects_pass_the_kubernetes_schemas():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    model = {"source": "huggingface", "repo": "Qwen/Qwen3-0.6B"}
    fields = {"model": model, "prefill": {"nodeSelector": {"a": "b"}, "tolerations": [{"operator": "Exists"}]}}
    secret = manifests.kv_keys("llm", "ns", full(), new_bundle())
    parallel = {"prefill": {"tensorParallelSize": 2}, "decode": {"tensorParallelSize": 4, "shmSize": "1.5Gi"}}
    tiers = {
        "prefill": {"kvCache": {"hostMemory": "8Gi", "disk": {"size": "1.5Gi"}, "maxAge": "12h"}},
        "decode": {"kvCache": {"shared": {"claimName": "kv", "readOnly": True}}},
    }
    placed = {
        "apiKeySecret": {"name": "team-api"},
        "decode": {
            "maxUnavailable": "25%",
            "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}},
            "topologySpreadConstraints": [
                {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway"}
            ],
        },
    }
    for obj in [*objects(**fields), *objects(), *objects(**parallel), *objects(**placed), *objects(**tiers), secret]:
        kubernetes_validate.validate(without_nulls(obj), "1.30", strict=True)


def test_the_charts_examples_are_valid():
    docs = [doc for path in sorted((HELM / "examples").glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text())]
    services = [doc for doc in docs if doc and doc["kind"] == "PDService"]
    assert services
    for doc in services:
        assert problems(doc["metadata"]["name"], doc["spec"]) == []


def test_pod_commands_parse_with_the_real_cli():
    # The operator writes `pdserve ...` command lines; the CLI (docs/contracts.md) must accept them as written.
    parser = build_parser()
    fields = {"prefill": {"engineArgs": ["--max-model-len", "8192"]}, "kvTransfer": {"leaseSeconds": 2.5}}
    for role in ("prefill", "decode"):
        args = parser.parse_args(container(engine_pod("llm", role, full(**fields)))["command"][1:])
        assert (args.host, args.port, args.model, args.kv_side_channel_port) == (
            "0.0.0.0",
            8100 if role == "prefill" else 8200,
            "/models/model",
            5600,
        )
        assert args.kv_lease_seconds == 2.5
        assert args.kv_keys == "/etc/pdserve/kv-keys"
    parallel = full(prefill={"tensorParallelSize": 2}, decode={"tensorParallelSize": 4, "gpus": 0})
    for role, size in (("prefill", 2), ("decode", 4)):
        args = parser.parse_args(container(engine_pod("llm", role, parallel))["command"][1:])
        assert args.tensor_parallel_size == size
    assert parser.parse_args(container(engine_pod("llm", "decode", full()))["command"][1:]).tensor_parallel_size == 1
    args = parser.parse_args(container(router_pod("llm", "ns", full()))["command"][1:])
    assert (args.discovery, args.namespace, args.selector) == ("kubernetes", "ns", "app.kubernetes.io/instance=llm")
    assert args.kv_keys == "/etc/pdserve/kv-keys"
    # With kvCache: every --kv-tier-* flag the operator writes is one `pdserve prefill|decode` takes, and it
    # reads back as the tiers the spec asked for (before the user's engineArgs, which still parse after them).
    tiered = full(
        prefill={"kvCache": TIERS, "engineArgs": ["--max-model-len", "8192"]},
        decode={"kvCache": {"shared": {"claimName": "kv-cache", "readOnly": True}, "maxAge": "12h"}},
    )
    wanted = {
        "prefill": KVTierConfig(
            host_bytes=8 << 30,
            disk_path="/var/cache/pdserve/kv-disk",
            disk_bytes=45 << 30,
            shared_path="/var/cache/pdserve/kv-shared",
            shared_bytes=100 << 30,
            max_age_s=5400.0,
        ),
        "decode": KVTierConfig(shared_path="/var/cache/pdserve/kv-shared", shared_read_only=True, max_age_s=43200.0),
    }
    for role, tiers in wanted.items():
        command = container(engine_pod("llm", role, tiered))["command"]
        assert command[1] == role
        args = parser.parse_args(command[1:])
        assert KVTierConfig.from_cli_args(args) == tiers
        assert args.kv_keys == "/etc/pdserve/kv-keys"
    assert parser.parse_args(container(engine_pod("llm", "prefill", tiered))["command"][1:]).max_model_len == 8192


def test_a_disruption_budget_per_engine_pool():
    objs = by_kind_name(objects(decode={"maxUnavailable": "25%"}))
    assert objs["PodDisruptionBudget", "llm-prefill"]["apiVersion"] == "policy/v1"
    assert objs["PodDisruptionBudget", "llm-prefill"]["spec"]["maxUnavailable"] == 1
    assert objs["PodDisruptionBudget", "llm-decode"]["spec"]["maxUnavailable"] == "25%"
    assert ("PodDisruptionBudget", "llm-router") not in objs
    # Where the API server lacks policy/v1 (Kubernetes < 1.21): none, never the old v1beta1.
    full = with_defaults(spec())
    without = manifests.owned_objects("llm", "ns", full, {"prefill": 1, "decode": 1}, disruption_budgets=False)
    assert [obj for obj in without if obj["kind"] == "PodDisruptionBudget"] == []


def test_placement_per_pool():
    affinity = {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}}
    spread = [{"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "ScheduleAnyway"}]
    objs = by_kind_name(objects(decode={"affinity": affinity, "topologySpreadConstraints": spread}))
    decode = objs["Deployment", "llm-decode"]["spec"]["template"]["spec"]
    assert (decode["affinity"], decode["topologySpreadConstraints"]) == (affinity, spread)
    prefill = objs["Deployment", "llm-prefill"]["spec"]["template"]["spec"]
    # None: a merge patch removes what the user took out of the spec.
    assert (prefill["affinity"], prefill["topologySpreadConstraints"]) == (None, None)


def test_the_api_key_comes_from_the_users_secret():
    objs = by_kind_name(objects(apiKeySecret={"name": "team-api"}))
    wanted = {"name": "PDSERVE_API_KEY", "valueFrom": {"secretKeyRef": {"name": "team-api", "key": "api-key"}}}
    for role in ("router", "prefill", "decode"):
        (runs,) = objs["Deployment", f"llm-{role}"]["spec"]["template"]["spec"]["containers"]
        assert wanted in runs["env"], role
        assert not any("api" in arg for arg in runs["command"])  # never on a command line
    plain = by_kind_name(objects())
    (runs,) = plain["Deployment", "llm-router"]["spec"]["template"]["spec"]["containers"]
    assert all(variable["name"] != "PDSERVE_API_KEY" for variable in runs["env"])


TIERS = {
    "hostMemory": "8Gi",
    "disk": {"size": "50Gi"},
    "shared": {"claimName": "kv-cache", "size": "100Gi"},
    "maxAge": "1h30m",
}


def tier_config(command):
    """The KVTierConfig the engine builds from a pod's command (its own flags' parser; the rest is left)."""
    parser = argparse.ArgumentParser()
    KVTierConfig.add_cli_args(parser)
    args, _ = parser.parse_known_args(command[2:])
    return KVTierConfig.from_cli_args(args)


def test_without_kv_cache_the_pods_are_as_before():
    for role in ("prefill", "decode"):
        assert engine_pod("llm", role, full(**{role: {"kvCache": {}}})) == engine_pod("llm", role, full())
        assert tier_config(container(engine_pod("llm", role, full()))["command"]) is None


def test_kv_tiers_are_mounted_and_passed_to_the_engine():
    pod = engine_pod("llm", "prefill", full(prefill={"kvCache": TIERS, "engineArgs": ["--max-model-len", "8192"]}))
    assert pod["spec"]["volumes"][3:] == [
        {"name": "kv-disk", "emptyDir": {"sizeLimit": "50Gi"}},
        {"name": "kv-shared", "persistentVolumeClaim": {"claimName": "kv-cache"}},
    ]
    assert container(pod)["volumeMounts"][3:] == [
        {"name": "kv-disk", "mountPath": "/var/cache/pdserve/kv-disk"},
        {"name": "kv-shared", "mountPath": "/var/cache/pdserve/kv-shared"},
    ]
    command = container(pod)["command"]
    assert command[command.index("--scheduling-policy") + 2 :] == [
        "--kv-tier-host-bytes",
        str(8 << 30),
        "--kv-tier-disk",
        "/var/cache/pdserve/kv-disk",
        "--kv-tier-disk-bytes",
        str(45 << 30),  # 90% of the emptyDir's sizeLimit: outgrowing it would get the pod evicted
        "--kv-tier-shared",
        "/var/cache/pdserve/kv-shared",
        "--kv-tier-shared-bytes",
        str(100 << 30),
        "--kv-tier-max-age",
        "5400",
        "--max-model-len",
        "8192",
    ]
    assert tier_config(command) == KVTierConfig(
        host_bytes=8 << 30,
        disk_path="/var/cache/pdserve/kv-disk",
        disk_bytes=45 << 30,
        shared_path="/var/cache/pdserve/kv-shared",
        shared_bytes=100 << 30,
        max_age_s=5400.0,
    )
    assert engine_pod("llm", "decode", full(prefill={"kvCache": TIERS})) == engine_pod("llm", "decode", full())


def test_a_read_only_shared_tier_is_mounted_read_only():
    pod = engine_pod("llm", "decode", full(decode={"kvCache": {"shared": {"claimName": "kv", "readOnly": True}}}))
    assert pod["spec"]["volumes"][3:] == [
        {"name": "kv-shared", "persistentVolumeClaim": {"claimName": "kv", "readOnly": True}}
    ]
    assert container(pod)["volumeMounts"][3:] == [
        {"name": "kv-shared", "mountPath": "/var/cache/pdserve/kv-shared", "readOnly": True}
    ]
    config = tier_config(container(pod)["command"])
    assert config == KVTierConfig(shared_path="/var/cache/pdserve/kv-shared", shared_read_only=True)


def test_each_tier_alone():
    host = container(engine_pod("llm", "decode", full(decode={"kvCache": {"hostMemory": "1.5Gi"}})))
    assert tier_config(host["command"]) == KVTierConfig(host_bytes=3 << 29)
    assert [mount["name"] for mount in host["volumeMounts"]] == ["model", "scratch", "kv-keys"]
    disk = engine_pod("llm", "decode", full(decode={"gpus": 0, "kvCache": {"disk": {"size": "10G"}, "maxAge": 60}}))
    assert [volume["name"] for volume in disk["spec"]["volumes"]] == ["model", "scratch", "kv-keys", "kv-disk"]
    config = tier_config(container(disk)["command"])
    assert (config.disk_bytes, config.max_age_s, config.host_bytes) == (9 * 10**9, 60.0, 0)


def test_a_tenants_secret_is_mounted_into_the_router_and_passed_as_its_table():
    pod = router_pod("llm", "ns", full(router={"tenantsSecret": {"name": "llm-tenants", "key": "table.yaml"}}))
    command = container(pod)["command"]
    assert command[command.index("--tenants") + 1] == "/etc/pdserve/tenants/table.yaml"
    assert {"name": "tenants", "mountPath": "/etc/pdserve/tenants", "readOnly": True} in container(pod)["volumeMounts"]
    assert {"name": "tenants", "secret": {"secretName": "llm-tenants"}} in pod["spec"]["volumes"]
    assert "--tenants" not in container(router_pod("llm", "ns", full()))["command"]


def test_an_endpoint_picker_runs_as_the_router_beside_an_inference_pool_of_the_decode_pods():
    fields = {"endpointPicker": {"enabled": True, "replicas": 2, "failureMode": "FailOpen"}}
    found = by_kind_name(objects(**fields))
    picker = found[("Deployment", "llm-epp")]
    command = container(picker["spec"]["template"])["command"]
    assert command[:9] == [
        "pdserve",
        "epp",
        "--host",
        "0.0.0.0",
        "--port",
        "9003",
        "--grpc-port",
        "9002",
        "--discovery",
    ]
    assert command[command.index("--router-replicas") + 1] == "2" and picker["spec"]["replicas"] == 2
    assert command[command.index("--inference-pool") + 1] == "llm"  # its decode pods: what the pool selects
    assert picker["spec"]["template"]["spec"]["serviceAccountName"] == "llm-router"  # the router's principal
    ports = {port["name"]: port["port"] for port in found[("Service", "llm-epp")]["spec"]["ports"]}
    assert ports == {"http": 9003, "grpc": 9002}
    pool = found[("InferencePool", "llm")]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["spec"] == {
        "selector": {"matchLabels": {"app.kubernetes.io/instance": "llm", "pdserve.io/role": "decode"}},
        "targetPorts": [{"number": 8200}],
        "endpointPickerRef": {"name": "llm-epp", "port": {"number": 9002}, "failureMode": "FailOpen"},
    }
    without_pools = manifests.owned_objects(
        "llm", "ns", full(**fields), {"prefill": 2, "decode": 3}, inference_pools=False
    )
    assert ("InferencePool", "llm") not in by_kind_name(without_pools)
    unpooled = by_kind_name(without_pools)[("Deployment", "llm-epp")]
    assert "--inference-pool" not in container(unpooled["spec"]["template"])["command"]
    assert not any(obj["metadata"]["name"] == "llm-epp" for obj in objects())  # off by default
