"""The chart and the operator against a real kube-apiserver, controller-manager and scheduler.

What the kmock tests (tests/operator) cannot show: the CRDs and every chart object pass the real
server's validation; the operator works under its own ServiceAccount with RBAC enforced; the real
controllers turn its Deployments into ReplicaSets and Pods; the router, under its own
ServiceAccount, discovers those pods; owned objects come back when deleted; garbage collection
removes everything with the PDService. Pods run no containers (no runtime here): the fake kubelet
gives each a loopback IP and the test starts the pod's own command on it, as a kubelet would.
"""

from __future__ import annotations

import base64
import copy
import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.launcher import free_port
from pdserve.models.demo import ensure_demo_model
from pdserve.testing.processes import Process, cpu_engine_flags, server_env
from tests.k8s.conftest import CHART, NAMESPACE, RELEASE_NAMESPACE, Cluster, create_or_skip, render_chart, wait_for
from tests.k8s.fake_kubelet import FakeKubelet

pytestmark = pytest.mark.k8s

GROUP, VERSION = "pdserve.io", "v1alpha1"
ROLES = ("router", "prefill", "decode")


def test_every_chart_object_and_example_is_accepted(cluster: Cluster) -> None:
    for doc in render_chart():  # installed by the fixture, or listed as skipped
        resource = cluster.resource(doc["apiVersion"], doc["kind"])
        if resource is not None:
            where = {"namespace": RELEASE_NAMESPACE} if resource.namespaced else {}
            assert resource.get(name=doc["metadata"]["name"], **where), doc["metadata"]["name"]
    # The examples users apply, validated by the server (dry run: nothing is stored).
    examples = sorted((CHART / "examples").glob("*.yaml"))
    assert examples
    accepted = 0
    for path in examples:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                accepted += create_or_skip(cluster, doc, f"examples/{path.name}", namespace=NAMESPACE, dry_run=True)
    assert accepted >= 3


def _cpu_example(name: str) -> dict[str, Any]:
    """The chart's CPU example PDService (what a user applies), renamed, with a hostPath model."""
    docs = yaml.safe_load_all((CHART / "examples" / "pdservice-cpu.yaml").read_text())
    (service,) = [doc for doc in docs if doc and doc["kind"] == "PDService"]
    service = copy.deepcopy(service)
    service["metadata"] = {"name": name}
    service["spec"]["model"] = {"source": "hostPath", "hostPath": "/models"}
    return service


class PodProcesses:
    """Runs each engine pod's own command (from its spec) at its IP, as the kubelet would run the
    container; a pod's deletion stops its process with SIGTERM."""

    def __init__(self, cluster: Cluster, kubelet: FakeKubelet, folder: Path, service: str) -> None:
        self.cluster, self.kubelet, self.folder, self.service = cluster, kubelet, folder, service
        self.model = str(ensure_demo_model())
        self.processes: dict[str, Process] = {}
        kubelet.on_terminating = self.stop

    def secret_file(self) -> Path:
        """The PDService's KV secret, as the pods' secret volume holds it."""
        secret = self.cluster.core.read_namespaced_secret(f"{self.service}-kv-secret", NAMESPACE)
        path = self.folder / "kv-secret"
        path.write_bytes(base64.b64decode(secret.data["kv-secret"]))
        return path

    def start(self, pod: Any) -> Process:
        ip = wait_for(lambda: self.kubelet.ip_of(pod), what=f"an IP for {pod.metadata.name}")
        (container,) = pod.spec.containers
        argv = _substituted(
            container.command[1:],
            {"--host": ip, "--model": self.model, "--kv-secret-file": str(self.secret_file())},
        )
        env = dict(server_env(), PDSERVE_KV_HOST=ip)
        env.update({e.name: e.value for e in container.env or [] if e.value is not None})
        flags = cpu_engine_flags("8MiB", served_model_name=self.service)
        port = int(argv[argv.index("--port") + 1])
        log = self.folder / f"{pod.metadata.name}.log"
        process = Process(pod.metadata.name, [*argv, *flags], env, port, log, host=ip)
        process.start()
        self.processes[pod.metadata.uid] = process
        return process

    def stop(self, pod: Any) -> None:
        process = self.processes.pop(pod.metadata.uid, None)
        if process is not None:
            process.stop()

    def stop_all(self) -> None:
        for process in self.processes.values():
            process.stop()
        self.processes.clear()


def _substituted(argv: list[str], values: dict[str, str]) -> list[str]:
    """argv with the values of these flags replaced (each flag must be there)."""
    argv = list(argv)
    for flag, value in values.items():
        argv[argv.index(flag) + 1] = value
    return argv


def pods(cluster: Cluster, service: str, role: str) -> list[Any]:
    selector = f"app.kubernetes.io/instance={service},pdserve.io/role={role}"
    listed = cluster.core.list_namespaced_pod(NAMESPACE, label_selector=selector).items
    return [pod for pod in listed if not pod.metadata.deletion_timestamp]


def running_pods(cluster: Cluster, service: str, role: str, count: int) -> list[Any]:
    """Wait for exactly `count` live pods of the role, all Running (IP given)."""

    def check() -> list[Any] | None:
        found = pods(cluster, service, role)
        if len(found) == count and all(pod.status.phase == "Running" for pod in found):
            return found
        return None

    return wait_for(check, timeout=60, what=f"{count} running {role} pod(s)")


def get(cluster: Cluster, plural: str, name: str) -> dict[str, Any] | None:
    try:
        return cluster.custom.get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, plural, name)
    except Exception as error:
        if getattr(error, "status", None) == 404:
            return None
        raise


def completion(url: str, model: str) -> dict[str, Any]:
    body = json.dumps({"model": model, "prompt": "Hello from a real cluster", "max_tokens": 8}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def test_pdservice_lifecycle(cluster: Cluster, kubelet: FakeKubelet, operator: Any, tmp_path: Path) -> None:
    name = "llm"
    started = time.monotonic()
    cluster.create(_cpu_example(name), namespace=NAMESPACE)

    # The operator (as its ServiceAccount) made the Deployments; the real controllers made
    # ReplicaSets and Pods; the real scheduler bound them to the fake node.
    for role in ROLES:
        selector = f"app.kubernetes.io/instance={name},pdserve.io/role={role}"
        replica_sets = cluster.apps.list_namespaced_replica_set
        wait_for(lambda: replica_sets(NAMESPACE, label_selector=selector).items, timeout=60, what=selector)  # noqa: B023
    engine_pods = {role: running_pods(cluster, name, role, 1) for role in ("prefill", "decode")}
    (router_pod,) = running_pods(cluster, name, "router", 1)
    print(f"PDService to running pods: {time.monotonic() - started:.1f} s")

    processes = PodProcesses(cluster, kubelet, tmp_path, name)
    try:
        for role_pods in engine_pods.values():
            for pod in role_pods:
                processes.start(pod)
        for process in processes.processes.values():
            process.wait_healthy()
        # The router: its pod's command, discovering pods as the router's ServiceAccount.
        router_token = cluster.token_of(f"{name}-router", NAMESPACE)
        kubeconfig = cluster.kubeconfig_for(router_token, tmp_path / "router-kubeconfig")
        (container,) = router_pod.spec.containers
        router_port = free_port()
        argv = _substituted(
            container.command[1:],
            {
                "--host": "127.0.0.1",
                "--port": str(router_port),
                "--tokenizer": processes.model,
                "--kv-secret-file": str(processes.secret_file()),
            },
        )
        env = dict(server_env(), KUBECONFIG=str(kubeconfig))
        router = Process("router", argv, env, router_port, tmp_path / "router.log")
        router.start()
        router.wait_healthy()

        def served() -> dict[str, Any] | None:
            try:
                return completion(router.url, name)
            except OSError:
                return None

        answer = wait_for(served, timeout=60, what="a completion through the router")
        assert answer["usage"]["completion_tokens"] == 8
        # Readiness came from the probes, the PDService's status from the real Deployments.
        wait_for(lambda: _ready(get(cluster, "pdservices", name)), timeout=30, what="the PDService Ready")

        # kubectl scale pdpool/llm-decode --replicas=2: the scale subresource, as kubectl writes it.
        cluster.custom.patch_namespaced_custom_object_scale(
            GROUP, VERSION, NAMESPACE, "pdpools", f"{name}-decode", {"spec": {"replicas": 2}}
        )
        decodes = running_pods(cluster, name, "decode", 2)
        for pod in decodes:
            if pod.metadata.uid not in processes.processes:
                processes.start(pod).wait_healthy()
        wait_for(lambda: get(cluster, "pdservices", name)["status"]["pools"]["decode"]["summary"] == "2/2", timeout=30)
        for _ in range(4):  # both decodes serve; the router follows the pods it discovered
            assert completion(router.url, name)["usage"]["completion_tokens"] == 8

        # Self-healing: a deleted Deployment comes back, with its pool's size.
        before = cluster.apps.read_namespaced_deployment(f"{name}-decode", NAMESPACE).metadata.uid
        deleted = time.monotonic()
        cluster.apps.delete_namespaced_deployment(f"{name}-decode", NAMESPACE)

        def recreated() -> Any:
            try:
                deployment = cluster.apps.read_namespaced_deployment(f"{name}-decode", NAMESPACE)
            except Exception:
                return None
            return deployment if deployment.metadata.uid != before else None

        again = wait_for(recreated, timeout=15, what="the deleted Deployment recreated")
        print(f"deleted Deployment recreated in {time.monotonic() - deleted:.1f} s")
        assert again.spec.replicas == 2
        # A resized Deployment goes back to its PDPool's count.
        cluster.apps.patch_namespaced_deployment_scale(f"{name}-decode", NAMESPACE, {"spec": {"replicas": 5}})
        wait_for(
            lambda: cluster.apps.read_namespaced_deployment(f"{name}-decode", NAMESPACE).spec.replicas == 2,
            timeout=15,
            what="the Deployment's replicas restored",
        )
        router.stop()
    finally:
        processes.stop_all()

    # Deleting the PDService: the garbage collector removes everything it owned, pods included.
    cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, NAMESPACE, "pdservices", name)
    selector = f"app.kubernetes.io/instance={name}"

    def everything_gone() -> bool:
        left = [
            *cluster.apps.list_namespaced_deployment(NAMESPACE, label_selector=selector).items,
            *cluster.apps.list_namespaced_replica_set(NAMESPACE, label_selector=selector).items,
            *cluster.core.list_namespaced_pod(NAMESPACE, label_selector=selector).items,
            *cluster.core.list_namespaced_service(NAMESPACE, label_selector=selector).items,
            *cluster.core.list_namespaced_secret(NAMESPACE, label_selector=selector).items,
        ]
        pools = cluster.custom.list_namespaced_custom_object(GROUP, VERSION, NAMESPACE, "pdpools")["items"]
        return not left and not [p for p in pools if p["spec"]["service"] == name]

    wait_for(everything_gone, timeout=60, what="garbage collection of everything the PDService owned")


def _ready(obj: dict[str, Any] | None) -> bool:
    conditions = ((obj or {}).get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)
