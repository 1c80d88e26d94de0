"""The operator under kopf against the emulated API server: create, scale, change, reject, restart, status.

The emulator runs no controllers and no garbage collector: Deployment readiness is set by patching
its status here, and deletion is checked through owner references.
"""

import base64
import re
import urllib.request

from pdserve.api.keys import new_bundle, rotate
from pdserve.launcher import free_port
from tests.operator.helpers import (
    DEPLOYMENTS,
    NETWORK_POLICIES,
    PDPOOLS,
    PDSERVICES,
    SECRETS,
    SERVICES,
    pdservice,
    running_operator,
)
from tests.operator.kmock_cluster import CRD_DIR, KubeCluster, wait_for

ROLES = ("router", "prefill", "decode")
OWNED = (
    [(DEPLOYMENTS, f"llm-{role}") for role in ROLES]
    + [(SERVICES, f"llm-{role}") for role in ROLES]
    + [
        (PDPOOLS, "llm-prefill"),
        (PDPOOLS, "llm-decode"),
        ("v1/serviceaccounts", "llm-router"),
        ("rbac.authorization.k8s.io/v1/roles", "llm-router"),
        ("rbac.authorization.k8s.io/v1/rolebindings", "llm-router"),
        (SECRETS, "llm-kv-keys"),
        (NETWORK_POLICIES, "llm-engines"),
        ("policy/v1/poddisruptionbudgets", "llm-prefill"),
        ("policy/v1/poddisruptionbudgets", "llm-decode"),
    ]
)


def deploy(cluster, namespace, **fields):
    """Create the PDService llm and wait until the operator has made all its objects."""
    service = cluster.create(PDSERVICES, pdservice(**fields), namespace)
    wait_for(lambda: all(cluster.get(resource, name, namespace) for resource, name in OWNED))
    return service


def replicas(cluster, namespace, role):
    return cluster.get(DEPLOYMENTS, f"llm-{role}", namespace)["spec"]["replicas"]


def ready_condition(cluster, namespace, name="llm"):
    conditions = (cluster.get(PDSERVICES, name, namespace).get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == "Ready"), None)


def test_create_makes_every_object_owned_by_the_pdservice(kube_cluster, kube_namespace, operator):
    service = deploy(kube_cluster, kube_namespace, prefill={"replicas": 2, "gpus": 1}, decode={"gpus": 0})
    for resource, name in OWNED:
        obj = kube_cluster.get(resource, name, kube_namespace)
        assert obj["metadata"]["ownerReferences"] == [
            {
                "apiVersion": "pdserve.io/v1alpha1",
                "kind": "PDService",
                "name": "llm",
                "uid": service["metadata"]["uid"],
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ], name
        component = name.removeprefix("llm-")
        assert obj["metadata"]["labels"]["app.kubernetes.io/component"] == component
        assert obj["metadata"]["labels"].get("pdserve.io/role") == (component if component in ROLES else None)
        assert obj["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "pdserve-operator"
    assert kube_cluster.get(PDPOOLS, "llm-prefill", kube_namespace)["spec"] == {
        "service": "llm",
        "role": "prefill",
        "replicas": 2,
    }
    assert [replicas(kube_cluster, kube_namespace, role) for role in ROLES] == [1, 2, 1]
    secret = kube_cluster.get(SECRETS, "llm-kv-keys", kube_namespace)
    assert secret["type"] == "Opaque"
    assert sorted(secret["data"]) == ["engine.key", "events.key", "router.key", "router.pub"]
    for name in secret["data"]:
        assert re.fullmatch("[0-9a-f]{64}\n", base64.b64decode(secret["data"][name]).decode()), name
    policy = kube_cluster.get(NETWORK_POLICIES, "llm-engines", kube_namespace)
    assert policy["spec"]["podSelector"]["matchLabels"] == {"pdserve.io/service": "llm"}
    prefill = kube_cluster.get(DEPLOYMENTS, "llm-prefill", kube_namespace)["spec"]["template"]["spec"]
    assert prefill["containers"][0]["command"][:2] == ["pdserve", "prefill"]
    assert prefill["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    decode = kube_cluster.get(DEPLOYMENTS, "llm-decode", kube_namespace)["spec"]["template"]["spec"]
    assert "limits" not in decode["containers"][0]["resources"]
    pool = wait_for(lambda: kube_cluster.get(PDPOOLS, "llm-decode", kube_namespace).get("status"))
    assert pool["selector"] == "app.kubernetes.io/instance=llm,pdserve.io/role=decode"
    got = wait_for(lambda: kube_cluster.get(PDSERVICES, "llm", kube_namespace).get("status"))
    assert got["routerURL"] == f"http://llm-router.{kube_namespace}.svc:8000"
    assert got["pools"]["prefill"]["summary"] == "0/2"
    # No finalizer: deleting the PDService is immediate, and the garbage collector (absent from the
    # emulator) deletes the rest by the owner references checked above.
    assert not kube_cluster.get(PDSERVICES, "llm", kube_namespace)["metadata"].get("finalizers")
    kube_cluster.delete(PDSERVICES, "llm", kube_namespace)
    assert kube_cluster.get(PDSERVICES, "llm", kube_namespace) is None


def test_scaling_a_pool_resizes_only_its_deployment(kube_cluster, kube_namespace, operator):
    deploy(kube_cluster, kube_namespace)
    # kubectl scale pdpool/llm-prefill --replicas=3 (an HPA writes the same subresource)
    kube_cluster.patch(PDPOOLS, "llm-prefill", {"spec": {"replicas": 3}}, kube_namespace, subresource="scale")
    wait_for(lambda: replicas(kube_cluster, kube_namespace, "prefill") == 3)
    assert replicas(kube_cluster, kube_namespace, "decode") == 1
    assert replicas(kube_cluster, kube_namespace, "router") == 1
    wait_for(lambda: kube_cluster.get(PDSERVICES, "llm", kube_namespace)["status"]["pools"]["prefill"]["replicas"] == 3)
    # The PDPool is authoritative: resizing its Deployment directly is undone.
    kube_cluster.patch(DEPLOYMENTS, "llm-prefill", {"spec": {"replicas": 7}}, kube_namespace)
    wait_for(lambda: replicas(kube_cluster, kube_namespace, "prefill") == 3)


def test_spec_change_updates_deployments_but_never_pool_sizes(kube_cluster, kube_namespace, operator):
    deploy(kube_cluster, kube_namespace)
    kube_cluster.patch(PDPOOLS, "llm-decode", {"spec": {"replicas": 2}}, kube_namespace)
    wait_for(lambda: replicas(kube_cluster, kube_namespace, "decode") == 2)
    change = {
        "image": "pdserve:2",
        "router": {"replicas": 3},
        "decode": {"replicas": 5, "engineArgs": ["--max-model-len", "8192"]},
    }
    kube_cluster.patch(PDSERVICES, "llm", {"spec": change}, kube_namespace)

    def decode_container():
        return kube_cluster.get(DEPLOYMENTS, "llm-decode", kube_namespace)["spec"]["template"]["spec"]["containers"][0]

    wait_for(lambda: decode_container()["command"][-2:] == ["--max-model-len", "8192"])
    for role in ROLES:
        deployment = kube_cluster.get(DEPLOYMENTS, f"llm-{role}", kube_namespace)
        assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == "pdserve:2"
    assert replicas(kube_cluster, kube_namespace, "router") == 3
    assert replicas(kube_cluster, kube_namespace, "decode") == 2  # the PDPool's, not spec.decode's 5
    assert kube_cluster.get(PDPOOLS, "llm-decode", kube_namespace)["spec"]["replicas"] == 2


def test_reconciling_again_keeps_the_kv_keys_and_a_users_rotation(kube_cluster, kube_namespace, operator):
    deploy(kube_cluster, kube_namespace)

    def value():
        return kube_cluster.get(SECRETS, "llm-kv-keys", kube_namespace)["data"]

    def image():  # of the decode Deployment, the last object a reconcile applies
        pod = kube_cluster.get(DEPLOYMENTS, "llm-decode", kube_namespace)["spec"]["template"]["spec"]
        return pod["containers"][0]["image"]

    first = value()
    kube_cluster.patch(PDSERVICES, "llm", {"spec": {"image": "pdserve:2"}}, kube_namespace)
    wait_for(lambda: image() == "pdserve:2")  # a second reconcile ran
    assert value() == first
    # A user rotates them (a step of `pdserve keys --rotate`): the next reconcile keeps theirs (pods re-read them).
    rotated = {name: base64.b64encode(text.encode()).decode() for name, text in rotate(new_bundle(), "add").items()}
    kube_cluster.patch(SECRETS, "llm-kv-keys", {"data": rotated}, kube_namespace)
    kube_cluster.patch(PDSERVICES, "llm", {"spec": {"image": "pdserve:3"}}, kube_namespace)
    wait_for(lambda: image() == "pdserve:3")
    assert value() == rotated


def test_a_named_secret_is_used_and_none_is_created(kube_cluster, kube_namespace, operator):
    kube_cluster.create(PDSERVICES, pdservice(kvTransfer={"secretName": "team-kv"}), kube_namespace)
    wait_for(lambda: all(kube_cluster.get(DEPLOYMENTS, f"llm-{role}", kube_namespace) for role in ROLES))
    assert kube_cluster.get(NETWORK_POLICIES, "llm-engines", kube_namespace)
    kube_cluster.wait_idle()
    assert kube_cluster.list(SECRETS, kube_namespace) == []
    for role in ROLES:
        pod = kube_cluster.get(DEPLOYMENTS, f"llm-{role}", kube_namespace)["spec"]["template"]["spec"]
        (volume,) = [v for v in pod["volumes"] if v["name"] == "kv-keys"]
        assert volume["secret"]["secretName"] == "team-kv"


def test_invalid_spec_creates_nothing_and_says_why(kube_cluster, kube_namespace, operator):
    bad = pdservice(model={"source": "pvc"}, prefill={"engineArgs": ["--port", "9000"]})
    kube_cluster.create(PDSERVICES, bad, kube_namespace)
    condition = wait_for(lambda: ready_condition(kube_cluster, kube_namespace))
    assert (condition["status"], condition["reason"]) == ("False", "InvalidSpec")
    assert "spec.model.claimName is required" in condition["message"]
    assert "--port" in condition["message"]
    events = wait_for(lambda: [e for e in kube_cluster.events(kube_namespace, "llm") if e["reason"] == "InvalidSpec"])
    assert events[0]["type"] == "Warning"
    for resource, name in OWNED:
        assert kube_cluster.get(resource, name, kube_namespace) is None
    # Alive, and not retrying the invalid spec: another PDService is served, no new InvalidSpec events.
    kube_cluster.create(PDSERVICES, pdservice("other"), kube_namespace)
    wait_for(lambda: kube_cluster.get(DEPLOYMENTS, "other-decode", kube_namespace))
    kube_cluster.wait_idle()
    assert len([e for e in kube_cluster.events(kube_namespace, "llm") if e["reason"] == "InvalidSpec"]) == 1
    # Fixed, it is served.
    kube_cluster.patch(
        PDSERVICES, "llm", {"spec": {"model": {"claimName": "models"}, "prefill": {"engineArgs": []}}}, kube_namespace
    )
    wait_for(lambda: all(kube_cluster.get(resource, name, kube_namespace) for resource, name in OWNED))
    wait_for(lambda: (ready_condition(kube_cluster, kube_namespace) or {}).get("reason") == "PoolsNotReady")


def test_restart_changes_nothing(kube_cluster, kube_namespace):
    with running_operator(kube_namespace):
        deploy(kube_cluster, kube_namespace)
        kube_cluster.patch(PDPOOLS, "llm-decode", {"spec": {"replicas": 2}}, kube_namespace)
        wait_for(lambda: replicas(kube_cluster, kube_namespace, "decode") == 2)
        kube_cluster.wait_idle()
    before = {(r, n): kube_cluster.get(r, n, kube_namespace) for r, n in [*OWNED, (PDSERVICES, "llm")]}
    mark = len(kube_cluster.requests())
    with running_operator(kube_namespace):
        wait_for(lambda: any("/pdservices/llm" in path for _, path in kube_cluster.requests()[mark:]))
        kube_cluster.wait_idle()
    writes = [(m, p) for m, p in kube_cluster.requests()[mark:] if m in ("POST", "PATCH", "PUT", "DELETE")]
    assert writes == []
    after = {(r, n): kube_cluster.get(r, n, kube_namespace) for r, n in [*OWNED, (PDSERVICES, "llm")]}
    assert after == before
    for resource in (DEPLOYMENTS, SERVICES, PDPOOLS):
        assert len(kube_cluster.list(resource, kube_namespace)) == len([r for r, _ in OWNED if r == resource])


def test_status_follows_deployment_readiness(kube_cluster, kube_namespace, operator):
    deploy(kube_cluster, kube_namespace, decode={"replicas": 2})

    def set_ready(role, ready, desired):
        counts = {"replicas": desired, "readyReplicas": ready, "updatedReplicas": desired}
        kube_cluster.patch(DEPLOYMENTS, f"llm-{role}", {"status": counts}, kube_namespace, subresource="status")

    set_ready("router", 1, 1)
    set_ready("prefill", 1, 1)
    set_ready("decode", 1, 2)
    wait_for(
        lambda: (
            (ready_condition(kube_cluster, kube_namespace) or {}).get("message")  # None before the first sync
            == "waiting for ready pods: decode 1/2"
        )
    )
    set_ready("decode", 2, 2)
    condition = wait_for(
        lambda: (
            ready_condition(kube_cluster, kube_namespace)["status"] == "True"
            and ready_condition(kube_cluster, kube_namespace)
        )
    )
    assert condition["reason"] == "AllPoolsReady"
    pools = kube_cluster.get(PDSERVICES, "llm", kube_namespace)["status"]["pools"]
    assert {role: pools[role]["summary"] for role in ROLES} == {"router": "1/1", "prefill": "1/1", "decode": "2/2"}
    pool = kube_cluster.get(PDPOOLS, "llm-decode", kube_namespace)["status"]
    assert (pool["replicas"], pool["readyReplicas"]) == (2, 2)
    set_ready("prefill", 0, 1)  # a pod fails its readiness probe
    wait_for(lambda: ready_condition(kube_cluster, kube_namespace)["status"] == "False")
    assert ready_condition(kube_cluster, kube_namespace)["message"] == "waiting for ready pods: prefill 0/1"


def test_all_namespaces_with_liveness_endpoint():
    # A cluster of its own: an operator of all namespaces would also serve the other tests' objects.
    port = free_port()
    with (
        KubeCluster(crds=[CRD_DIR]) as cluster,
        running_operator(None, "--liveness", f"http://127.0.0.1:{port}/healthz"),
    ):
        for namespace in ("team-a", "team-b"):
            cluster.create(PDSERVICES, pdservice(), namespace)
        wait_for(lambda: all(cluster.get(DEPLOYMENTS, "llm-decode", ns) for ns in ("team-a", "team-b")))
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as response:
            assert response.status == 200


def test_an_invalid_change_leaves_what_runs(kube_cluster, kube_namespace, operator):
    deploy(kube_cluster, kube_namespace)
    before = kube_cluster.get(DEPLOYMENTS, "llm-decode", kube_namespace)
    kube_cluster.patch(
        PDSERVICES, "llm", {"spec": {"image": "pdserve:2", "decode": {"engineArgs": ["--host=x"]}}}, kube_namespace
    )
    wait_for(lambda: (ready_condition(kube_cluster, kube_namespace) or {}).get("reason") == "InvalidSpec")
    kube_cluster.wait_idle()
    assert kube_cluster.get(DEPLOYMENTS, "llm-decode", kube_namespace) == before


def test_tensor_parallel_pools_and_too_few_gpus(kube_cluster, kube_namespace, operator):
    deploy(kube_cluster, kube_namespace, prefill={"tensorParallelSize": 2}, decode={"tensorParallelSize": 4})

    def template(role):
        return kube_cluster.get(DEPLOYMENTS, f"llm-{role}", kube_namespace)["spec"]["template"]

    for role, size in (("prefill", "2"), ("decode", "4")):
        pod = template(role)
        (engine,) = pod["spec"]["containers"]
        assert engine["command"][-2:] == ["--tensor-parallel-size", size]
        assert engine["resources"]["limits"] == {"nvidia.com/gpu": size}  # gpus follow the size
        assert {"name": "shm", "mountPath": "/dev/shm"} in engine["volumeMounts"]
        shm = {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{size}Gi"}}
        assert shm in pod["spec"]["volumes"]
        assert pod["metadata"]["annotations"]["pdserve.io/tensor-parallel-size"] == size
    # The API server's defaults leave gpus to the operator (they follow the size it fills in).
    stored = kube_cluster.get(PDSERVICES, "llm", kube_namespace)["spec"]
    assert stored["decode"]["tensorParallelSize"] == 4 and "gpus" not in stored["decode"]
    # Fewer GPUs than ranks: InvalidSpec, naming both fields, and what runs is left as it was.
    before = kube_cluster.get(DEPLOYMENTS, "llm-decode", kube_namespace)
    kube_cluster.patch(PDSERVICES, "llm", {"spec": {"decode": {"gpus": 2}}}, kube_namespace)
    condition = wait_for(
        lambda: (
            (ready_condition(kube_cluster, kube_namespace) or {}).get("reason") == "InvalidSpec"
            and ready_condition(kube_cluster, kube_namespace)
        )
    )
    assert "spec.decode.gpus (2) must be 0 (CPU) or at least spec.decode.tensorParallelSize (4)" in condition["message"]
    kube_cluster.wait_idle()
    assert kube_cluster.get(DEPLOYMENTS, "llm-decode", kube_namespace) == before
    # Back to one rank: no flag, no /dev/shm volume, the annotation says 1.
    kube_cluster.patch(PDSERVICES, "llm", {"spec": {"decode": {"tensorParallelSize": 1}}}, kube_namespace)
    wait_for(lambda: "--tensor-parallel-size" not in template("decode")["spec"]["containers"][0]["command"])
    pod = template("decode")
    assert [v["name"] for v in pod["spec"]["volumes"]] == ["model", "scratch", "kv-keys"]
    assert pod["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "2"}
    assert pod["metadata"]["annotations"] == {"pdserve.io/tensor-parallel-size": "1"}


def test_deleted_or_edited_objects_are_restored(kube_cluster, kube_namespace, operator):
    service = deploy(kube_cluster, kube_namespace)
    kube_cluster.patch(PDPOOLS, "llm-decode", {"spec": {"replicas": 3}}, kube_namespace, subresource="scale")
    wait_for(lambda: replicas(kube_cluster, kube_namespace, "decode") == 3)
    uid = service["metadata"]["uid"]
    for resource, name in OWNED:
        before = kube_cluster.get(resource, name, kube_namespace)
        kube_cluster.delete(resource, name, kube_namespace)
        again = wait_for(lambda: kube_cluster.get(resource, name, kube_namespace), timeout=5)  # noqa: B023
        assert again["metadata"]["uid"] != before["metadata"]["uid"], name
        assert again["metadata"]["ownerReferences"][0]["uid"] == uid, name
    # The deleted PDPool came back at the size that ran, not at spec.decode's seed.
    assert kube_cluster.get(PDPOOLS, "llm-decode", kube_namespace)["spec"]["replicas"] == 3
    assert replicas(kube_cluster, kube_namespace, "decode") == 3
    # Edits are undone: a Deployment's pod template, a Service's ports, a Role's rules.

    def engine_image():
        return kube_cluster.get(DEPLOYMENTS, "llm-prefill", kube_namespace)["spec"]["template"]["spec"]["containers"][0]

    containers = kube_cluster.get(DEPLOYMENTS, "llm-prefill", kube_namespace)["spec"]["template"]["spec"]["containers"]
    edited = [{**containers[0], "image": "someone-elses:1"}]
    kube_cluster.patch(
        DEPLOYMENTS, "llm-prefill", {"spec": {"template": {"spec": {"containers": edited}}}}, kube_namespace
    )
    wait_for(lambda: engine_image()["image"] == "pdserve:test", timeout=5)
    kube_cluster.patch(
        SERVICES, "llm-router", {"spec": {"ports": [{"name": "x", "port": 1, "targetPort": 1}]}}, kube_namespace
    )
    wait_for(
        lambda: kube_cluster.get(SERVICES, "llm-router", kube_namespace)["spec"]["ports"][0]["port"] == 8000, timeout=5
    )
    roles = "rbac.authorization.k8s.io/v1/roles"
    kube_cluster.patch(roles, "llm-router", {"rules": []}, kube_namespace)
    wait_for(lambda: kube_cluster.get(roles, "llm-router", kube_namespace)["rules"], timeout=5)
    # Deleting the PDService is not undone: nothing is recreated for a PDService that is gone.
    kube_cluster.wait_idle()
    kube_cluster.delete(PDSERVICES, "llm", kube_namespace)
    kube_cluster.delete(DEPLOYMENTS, "llm-router", kube_namespace)
    kube_cluster.wait_idle()
    assert kube_cluster.get(DEPLOYMENTS, "llm-router", kube_namespace) is None


def test_kv_tiers_mount_their_volumes_and_go_with_the_spec(kube_cluster, kube_namespace, operator):
    tiers = {
        "hostMemory": "8Gi",
        "disk": {"size": "50Gi"},
        "shared": {"claimName": "kv", "size": "1Ti"},
        "maxAge": "12h",
    }
    reader = {"shared": {"claimName": "kv", "readOnly": True}}
    deploy(kube_cluster, kube_namespace, prefill={"kvCache": tiers}, decode={"kvCache": reader})

    def pod(role):
        return kube_cluster.get(DEPLOYMENTS, f"llm-{role}", kube_namespace)["spec"]["template"]["spec"]

    def volumes(role):
        return [volume["name"] for volume in pod(role)["volumes"]]

    prefill = pod("prefill")
    assert prefill["volumes"][3:] == [
        {"name": "kv-disk", "emptyDir": {"sizeLimit": "50Gi"}},
        {"name": "kv-shared", "persistentVolumeClaim": {"claimName": "kv"}},
    ]
    (engine,) = prefill["containers"]
    assert engine["volumeMounts"][3:] == [
        {"name": "kv-disk", "mountPath": "/var/cache/pdserve/kv-disk"},
        {"name": "kv-shared", "mountPath": "/var/cache/pdserve/kv-shared"},
    ]
    flags = engine["command"][engine["command"].index("--kv-tier-host-bytes") :]
    assert flags == [
        "--kv-tier-host-bytes",
        str(8 << 30),
        "--kv-tier-disk",
        "/var/cache/pdserve/kv-disk",
        "--kv-tier-disk-bytes",
        str(45 << 30),
        "--kv-tier-shared",
        "/var/cache/pdserve/kv-shared",
        "--kv-tier-shared-bytes",
        str(1 << 40),
        "--kv-tier-max-age",
        "43200",
    ]
    decode = pod("decode")
    assert decode["volumes"][3:] == [
        {"name": "kv-shared", "persistentVolumeClaim": {"claimName": "kv", "readOnly": True}}
    ]
    (engine,) = decode["containers"]
    assert engine["volumeMounts"][3:] == [
        {"name": "kv-shared", "mountPath": "/var/cache/pdserve/kv-shared", "readOnly": True}
    ]
    assert engine["command"][-3:] == ["--kv-tier-shared", "/var/cache/pdserve/kv-shared", "--kv-tier-shared-read-only"]
    # The CRD's default, as the API server applies it.
    stored = kube_cluster.get(PDSERVICES, "llm", kube_namespace)["spec"]
    assert stored["prefill"]["kvCache"]["shared"]["readOnly"] is False
    # Host memory for a CPU pool: InvalidSpec before anything changes.
    before = kube_cluster.get(DEPLOYMENTS, "llm-decode", kube_namespace)
    kube_cluster.patch(
        PDSERVICES, "llm", {"spec": {"decode": {"gpus": 0, "kvCache": {"hostMemory": "8Gi"}}}}, kube_namespace
    )
    condition = wait_for(
        lambda: (
            (ready_condition(kube_cluster, kube_namespace) or {}).get("reason") == "InvalidSpec"
            and ready_condition(kube_cluster, kube_namespace)
        )
    )
    assert "spec.decode.kvCache.hostMemory needs GPUs" in condition["message"]
    kube_cluster.wait_idle()
    assert kube_cluster.get(DEPLOYMENTS, "llm-decode", kube_namespace) == before
    # Taken out of the spec: the volumes, mounts and flags go (merge patches replace the lists whole).
    removed = {"prefill": {"kvCache": None}, "decode": {"gpus": None, "kvCache": None}}
    kube_cluster.patch(PDSERVICES, "llm", {"spec": removed}, kube_namespace)
    for role in ("prefill", "decode"):
        wait_for(lambda: volumes(role) == ["model", "scratch", "kv-keys"])  # noqa: B023
        (engine,) = pod(role)["containers"]
        assert [mount["name"] for mount in engine["volumeMounts"]] == ["model", "scratch", "kv-keys"]
        assert not [arg for arg in engine["command"] if arg.startswith("--kv-tier")]
