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
import contextlib
import copy
import json
import queue
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml

from pdserve.models.demo import ensure_demo_model
from pdserve.operator.scale_down import DELETION_COST
from pdserve.testing.metrics import scrape
from pdserve.testing.processes import Process, cpu_engine_flags, server_env
from tests.k8s.conftest import (
    CHART,
    NAMESPACE,
    RELEASE_NAMESPACE,
    SKIPPED,
    Cluster,
    _established,
    create_or_skip,
    render_chart,
    wait_for,
)
from tests.k8s.fake_kubelet import FakeKubelet

pytestmark = pytest.mark.k8s

GROUP, VERSION = "pdserve.io", "v1alpha1"
ROLES = ("router", "prefill", "decode")
ENGINES = ("prefill", "decode")


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


def test_kv_tiers_reach_the_deployments(cluster: Cluster, operator: Any) -> None:
    """A pool's kvCache through the real server: the CRD keeps it (with its default), and the engine
    Deployments the operator writes, which the server validates, mount the tier volumes and pass the
    tiers' flags. Every pool at 0 replicas: no pod is needed to see that."""
    name = "tiers"
    service = _cpu_example(name)
    writer = {"disk": {"size": "1Gi"}, "shared": {"claimName": "kv-cache", "size": "2Gi"}, "maxAge": "12h"}
    service["spec"]["prefill"].update(replicas=0, kvCache=writer)
    service["spec"]["decode"].update(replicas=0, kvCache={"shared": {"claimName": "kv-cache", "readOnly": True}})
    service["spec"]["router"]["replicas"] = 0
    cluster.create(service, namespace=NAMESPACE)
    deployments = cluster.resource("apps/v1", "Deployment")

    def pod_spec(role: str) -> dict[str, Any] | None:
        found = deployments.get(namespace=NAMESPACE, label_selector=f"app.kubernetes.io/instance={name}").items
        return next((d.to_dict()["spec"]["template"]["spec"] for d in found if d.metadata.name.endswith(role)), None)

    try:
        assert get(cluster, "pdservices", name)["spec"]["prefill"]["kvCache"]["shared"]["readOnly"] is False
        prefill = wait_for(lambda: pod_spec("prefill"), timeout=30, what="the prefill Deployment")
        assert prefill["volumes"][3:] == [
            {"name": "kv-disk", "emptyDir": {"sizeLimit": "1Gi"}},
            {"name": "kv-shared", "persistentVolumeClaim": {"claimName": "kv-cache"}},
        ]
        (engine,) = prefill["containers"]
        assert engine["volumeMounts"][3:] == [
            {"name": "kv-disk", "mountPath": "/var/cache/pdserve/kv-disk"},
            {"name": "kv-shared", "mountPath": "/var/cache/pdserve/kv-shared"},
        ]
        command = engine["command"]
        assert command[command.index("--kv-tier-disk") :][:8] == [
            "--kv-tier-disk",
            "/var/cache/pdserve/kv-disk",
            "--kv-tier-disk-bytes",
            str((1 << 30) * 9 // 10),
            "--kv-tier-shared",
            "/var/cache/pdserve/kv-shared",
            "--kv-tier-shared-bytes",
            str(2 << 30),
        ]
        decode = wait_for(lambda: pod_spec("decode"), timeout=30, what="the decode Deployment")
        assert decode["volumes"][3:] == [
            {"name": "kv-shared", "persistentVolumeClaim": {"claimName": "kv-cache", "readOnly": True}}
        ]
        assert decode["containers"][0]["volumeMounts"][3:] == [
            {"name": "kv-shared", "mountPath": "/var/cache/pdserve/kv-shared", "readOnly": True}
        ]
        assert "--kv-tier-shared-read-only" in decode["containers"][0]["command"]
    finally:
        cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, NAMESPACE, "pdservices", name)


def test_an_endpoint_picker_runs_beside_an_inference_pool_of_the_decode_pods(
    cluster: Cluster, operator: Any, tmp_path: Path
) -> None:
    """spec.endpointPicker through the real server: with the Inference Extension's InferencePool served (a minimal
    CRD written here), the operator, under its own RBAC, writes the pool of the decode pods naming the picker, and
    the picker's Deployment and Service, which the server validates. Every pool at 0 replicas."""
    crds = kubernetes.client.ApiextensionsV1Api(cluster.api)
    crd = yaml.safe_load((Path(__file__).parent / "inferencepool-crd.yaml").read_text())
    try:
        crds.create_custom_resource_definition(crd)
    except kubernetes.client.ApiException as error:
        raise AssertionError(error.body) from None
    wait_for(lambda: _established(crds, crd["metadata"]["name"]), timeout=30, what="the InferencePool CRD")
    cluster.refresh()
    name = "picked"
    service = _cpu_example(name)
    for role in ("router", "prefill", "decode"):
        service["spec"][role]["replicas"] = 0
    service["spec"]["endpointPicker"] = {"enabled": True, "replicas": 0}
    cluster.create(service, namespace=NAMESPACE)
    try:
        pool = wait_for(
            lambda: _get_custom(cluster, "inference.networking.k8s.io", "v1", "inferencepools", name),
            timeout=30,
            what="the InferencePool",
        )
        assert pool["spec"]["selector"]["matchLabels"] == {
            "app.kubernetes.io/instance": name,
            "pdserve.io/role": "decode",
        }
        assert pool["spec"]["endpointPickerRef"] == {
            "name": f"{name}-epp",
            "port": {"number": 9002},
            "failureMode": "FailClose",
        }
        picker = wait_for(
            lambda: _read_or_none(lambda: cluster.apps.read_namespaced_deployment(f"{name}-epp", NAMESPACE)),
            timeout=30,
            what="the picker's Deployment",
        )
        assert picker.spec.template.spec.containers[0].command[:2] == ["pdserve", "epp"]
        ports = {
            port.name: port.port for port in cluster.core.read_namespaced_service(f"{name}-epp", NAMESPACE).spec.ports
        }
        assert ports == {"http": 9003, "grpc": 9002}
        command = picker.spec.template.spec.containers[0].command
        assert command[command.index("--inference-pool") + 1] == name
        _picker_discovery_follows_the_pool(cluster, name, tmp_path)
    finally:
        cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, NAMESPACE, "pdservices", name)
        for pod in ("p0", "d0", "d1"):
            with contextlib.suppress(kubernetes.client.ApiException):
                cluster.core.delete_namespaced_pod(f"{name}-{pod}", NAMESPACE, grace_period_seconds=0)


def _picker_discovery_follows_the_pool(cluster: Cluster, name: str, tmp_path: Path) -> None:
    """The picker's discovery, under the router's ServiceAccount (the operator's Role for it), takes its decode
    pods from what the InferencePool selects: narrowing the pool's selector drops a decode pod; prefill pods
    come from the picker's own selector. Pods are made Ready by writing their status (no kubelet here)."""
    for pod, role, ip, extra in (
        ("p0", "prefill", "127.0.0.11", {}),
        ("d0", "decode", "127.0.0.12", {}),
        ("d1", "decode", "127.0.0.13", {"canary": "yes"}),
    ):
        labels = {"app.kubernetes.io/instance": name, "pdserve.io/role": role, **extra}
        container = {"name": "engine", "image": "pdserve", "ports": [{"name": "http", "containerPort": 8200}]}
        # A node selector no node matches: the scheduler leaves them be (the fake kubelet would run their command).
        spec = {"containers": [container], "nodeSelector": {"pdserve.io/test-nowhere": "true"}}
        body = {"metadata": {"name": f"{name}-{pod}", "labels": labels}, "spec": spec}
        cluster.core.create_namespaced_pod(NAMESPACE, body)
        status = {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}
        cluster.core.patch_namespaced_pod_status(f"{name}-{pod}", NAMESPACE, {"status": status})
    token = cluster.token_of(f"{name}-router", NAMESPACE)
    kubeconfig = cluster.kubeconfig_for(token, tmp_path / "picker-kubeconfig")
    watcher = subprocess.Popen(
        [sys.executable, "-c", _DISCOVERY_PRINTER, NAMESPACE, f"app.kubernetes.io/instance={name}", name],
        env={**server_env(), "KUBECONFIG": str(kubeconfig)},
        stdout=subprocess.PIPE,
        text=True,
    )
    snapshots: queue.Queue[dict[str, list[str]]] = queue.Queue()
    reader = threading.Thread(target=lambda: [snapshots.put(json.loads(line)) for line in watcher.stdout], daemon=True)
    reader.start()

    def until(expected: dict[str, list[str]], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        seen = None
        while time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                seen = snapshots.get(timeout=0.5)
                if seen == expected:
                    return
        raise AssertionError(f"discovery saw {seen}, not {expected}")

    try:
        until(
            {"prefill": ["http://127.0.0.11:8200"], "decode": ["http://127.0.0.12:8200", "http://127.0.0.13:8200"]}, 30
        )
        pool = _get_custom(cluster, "inference.networking.k8s.io", "v1", "inferencepools", name)
        assert pool is not None
        labels = {**pool["spec"]["selector"]["matchLabels"], "canary": "yes"}
        cluster.custom.patch_namespaced_custom_object(
            "inference.networking.k8s.io",
            "v1",
            NAMESPACE,
            "inferencepools",
            name,
            {"spec": {"selector": {"matchLabels": labels}}},
        )
        until({"prefill": ["http://127.0.0.11:8200"], "decode": ["http://127.0.0.13:8200"]}, 30)
    finally:
        watcher.terminate()
        watcher.wait(10)


# The picker's discovery in a process of its own (the kubernetes client reads KUBECONFIG when imported): each
# snapshot it hands the event loop, one JSON line each.
_DISCOVERY_PRINTER = """
import asyncio, json, sys
from pdserve.router.discovery import KubernetesDiscovery

async def main():
    loop = asyncio.get_running_loop()
    show = lambda snapshot: print(json.dumps(snapshot), flush=True)
    KubernetesDiscovery(sys.argv[1], sys.argv[2], show, loop, inference_pool=sys.argv[3]).start()
    await asyncio.Event().wait()

asyncio.run(main())
"""


def _get_custom(cluster: Cluster, group: str, version: str, plural: str, name: str) -> dict[str, Any] | None:
    return _read_or_none(lambda: cluster.custom.get_namespaced_custom_object(group, version, NAMESPACE, plural, name))


def _read_or_none(read: Any) -> Any:
    try:
        return read()
    except kubernetes.client.ApiException as error:
        if error.status == 404:
            return None
        raise


class PodProcesses:
    """Runs each pod's own command (from its spec) at its IP, as the kubelet would run the container;
    a pod's deletion stops its process as a kubelet does: SIGTERM, then SIGKILL once the pod's
    terminationGracePeriodSeconds have passed (the fake kubelet runs no preStop hook: the pods have
    none). The router runs with its ServiceAccount's token."""

    def __init__(self, cluster: Cluster, kubelet: FakeKubelet, folder: Path, service: str) -> None:
        self.cluster, self.kubelet, self.folder, self.service = cluster, kubelet, folder, service
        self.model = str(ensure_demo_model())
        self.processes: dict[str, Process] = {}
        self.stopped: list[tuple[str, float]] = []  # (pod, seconds from SIGTERM to its exit) of deleted pods
        self.lock = threading.Lock()  # the kubelet stops pods from its own threads
        kubelet.on_terminating = self.stop

    def keys_folder(self, pod: Any) -> Path:
        """The PDService's keys as the pod's keys volume holds them: the items its role mounts, from the Secret."""
        (volume,) = [v for v in pod.spec.volumes if v.name == "kv-keys"]
        secret = self.cluster.core.read_namespaced_secret(volume.secret.secret_name, NAMESPACE)
        folder = self.folder / f"kv-keys-{pod.metadata.name}"
        folder.mkdir(exist_ok=True)
        for item in volume.secret.items:
            (folder / item.path).write_bytes(base64.b64decode(secret.data[item.key]))
        return folder

    def start(self, pod: Any) -> Process:
        ip = wait_for(lambda: self.kubelet.ip_of(pod), what=f"an IP for {pod.metadata.name}")
        (container,) = pod.spec.containers
        paths = {"--host": ip, "--kv-keys": str(self.keys_folder(pod))}
        env = dict(server_env())
        env.update({e.name: e.value for e in container.env or [] if e.value is not None})
        for variable in container.env or []:  # from Secrets, as the kubelet resolves them
            ref = variable.value_from.secret_key_ref if variable.value_from else None
            if ref is not None:
                secret = self.cluster.core.read_namespaced_secret(ref.name, NAMESPACE)
                env[variable.name] = base64.b64decode(secret.data[ref.key]).decode()
        if pod.metadata.labels["pdserve.io/role"] == "router":
            argv = _substituted(container.command[1:], {**paths, "--tokenizer": self.model})
            account = pod.spec.service_account_name
            token = self.cluster.token_of(account, NAMESPACE)
            env["KUBECONFIG"] = str(self.cluster.kubeconfig_for(token, self.folder / f"{account}.kubeconfig"))
        else:
            argv = _substituted(container.command[1:], {**paths, "--model": self.model})
            argv += cpu_engine_flags("8MiB", served_model_name=self.service)
            env["PDSERVE_KV_HOST"] = ip
        port = int(argv[argv.index("--port") + 1])
        process = Process(pod.metadata.name, argv, env, port, self.folder / f"{pod.metadata.name}.log", host=ip)
        process.start()
        with self.lock:
            self.processes[pod.metadata.uid] = process
        return process

    def start_healthy(self, pods: list[Any]) -> list[Process]:
        """Start the pods not running yet; wait until all of them answer /health."""
        started = [self.start(pod) for pod in pods if pod.metadata.uid not in self.processes]
        for process in started:
            process.wait_healthy()
        return started

    def stop(self, pod: Any) -> None:
        with self.lock:
            process = self.processes.pop(pod.metadata.uid, None)
        if process is not None:
            began = time.monotonic()
            process.stop(timeout=pod.spec.termination_grace_period_seconds or 30)
            self.stopped.append((pod.metadata.name, time.monotonic() - began))

    def start_new(self, service: str) -> None:
        """Start the engine pods of ``service`` that run but have no process yet (a rollout's new pods)."""
        for role in ENGINES:
            fresh = [
                pod
                for pod in pods(self.cluster, service, role)
                if pod.status.phase == "Running" and pod.metadata.uid not in self.processes
            ]
            self.start_healthy(fresh)

    def stop_all(self) -> None:
        with self.lock:
            processes, self.processes = list(self.processes.values()), {}
        for process in processes:
            process.stop()


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


API_KEY = "k8s-test-api-key"
AUTHORIZED = {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}


def completion(url: str, model: str, headers: dict[str, str] = AUTHORIZED) -> dict[str, Any]:
    body = json.dumps({"model": model, "prompt": "Hello from a real cluster", "max_tokens": 8}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body, headers)
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


class Stream:
    """A streamed completion read in its own thread: chunks, the finish reason, tokens, any error."""

    def __init__(self, url: str, model: str, max_tokens: int) -> None:
        self.chunks = 0
        self.tokens = 0
        self.longest_gap = 0.0  # seconds, between two events
        self.finish_reason: str | None = None
        self.error: str | None = None
        body = {"model": model, "prompt": "Tell me a story", "max_tokens": max_tokens, "ignore_eos": True}
        self.request = urllib.request.Request(
            f"{url}/v1/completions",
            json.dumps({**body, "stream": True, "stream_options": {"include_usage": True}}).encode(),
            AUTHORIZED,
        )
        self.thread = threading.Thread(target=self._read, daemon=True)

    def _read(self) -> None:
        try:
            with urllib.request.urlopen(self.request, timeout=120) as response:
                last = time.monotonic()
                for line in response:
                    data = line.decode().strip().removeprefix("data: ")
                    if not data or data == "[DONE]":
                        continue
                    now = time.monotonic()
                    self.longest_gap, last = max(self.longest_gap, now - last), now
                    event = json.loads(data)
                    if "error" in event:
                        self.error = str(event["error"])
                        return
                    if event.get("usage"):  # the last event
                        self.tokens = event["usage"]["completion_tokens"]
                    for choice in event["choices"]:
                        self.chunks += 1
                        self.finish_reason = choice.get("finish_reason") or self.finish_reason
        except Exception as error:  # reported by the test's assertion
            self.error = repr(error)


def test_pdservice_lifecycle(cluster: Cluster, kubelet: FakeKubelet, operator: Any, tmp_path: Path) -> None:
    name = "llm"
    started = time.monotonic()
    # The API key from a Secret of the user's (spec.apiKeySecret): the router and engines get it from it.
    key = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "team-api"}, "stringData": {"api-key": API_KEY}}
    cluster.create(key, namespace=NAMESPACE)
    service = _cpu_example(name)
    service["spec"]["apiKeySecret"] = {"name": "team-api"}
    cluster.create(service, namespace=NAMESPACE)

    # The operator (as its ServiceAccount) made the Deployments; the real controllers made
    # ReplicaSets and Pods; the real scheduler bound them to the fake node.
    for role in ROLES:
        selector = f"app.kubernetes.io/instance={name},pdserve.io/role={role}"
        replica_sets = cluster.apps.list_namespaced_replica_set
        wait_for(lambda: replica_sets(NAMESPACE, label_selector=selector).items, timeout=60, what=selector)  # noqa: B023
    engine_pods = {role: running_pods(cluster, name, role, 1) for role in ENGINES}
    (router_pod,) = running_pods(cluster, name, "router", 1)
    print(f"PDService to running pods: {time.monotonic() - started:.1f} s")

    processes = PodProcesses(cluster, kubelet, tmp_path, name)
    try:
        processes.start_healthy([*engine_pods["prefill"], *engine_pods["decode"]])
        (router,) = processes.start_healthy([router_pod])

        def served() -> dict[str, Any] | None:
            try:
                return completion(router.url, name)
            except OSError:  # until the router's discovery has seen the pods Ready
                return None

        answer = wait_for(served, timeout=60, what="a completion through the router")
        assert answer["usage"]["completion_tokens"] == 8
        with pytest.raises(urllib.error.HTTPError) as refused:  # no key: refused at the router
            completion(router.url, name, headers={"Content-Type": "application/json"})
        assert refused.value.code == 401
        # Readiness came from the probes, the PDService's status from the real Deployments.
        wait_for(lambda: _ready(get(cluster, "pdservices", name)), timeout=30, what="the PDService Ready")
        # PodDisruptionBudgets where the server has policy/v1; else a condition says they were skipped.
        conditions = get(cluster, "pdservices", name)["status"]["conditions"]
        skipped = [c for c in conditions if c["type"] == "ObjectsSkipped"]
        if cluster.resource("policy/v1", "PodDisruptionBudget") is None:
            assert "policy/v1 PodDisruptionBudget" in skipped[0]["message"]
            SKIPPED.extend(("operator", "policy/v1", "PodDisruptionBudget", f"{name}-{r}") for r in ENGINES)
        else:
            assert not skipped
            for role in ENGINES:
                budget = cluster.resource("policy/v1", "PodDisruptionBudget").get(
                    name=f"{name}-{role}", namespace=NAMESPACE
                )
                assert budget.spec.maxUnavailable == 1

        # kubectl scale pdpool/llm-decode --replicas=2: the scale subresource, as kubectl writes it.
        cluster.custom.patch_namespaced_custom_object_scale(
            GROUP, VERSION, NAMESPACE, "pdpools", f"{name}-decode", {"spec": {"replicas": 2}}
        )
        processes.start_healthy(running_pods(cluster, name, "decode", 2))
        wait_for(lambda: get(cluster, "pdservices", name)["status"]["pools"]["decode"]["summary"] == "2/2", timeout=30)
        for _ in range(4):  # both decodes serve; the router follows the pods it discovered
            assert completion(router.url, name)["usage"]["completion_tokens"] == 8

        # Scale-down loses nothing: streams run on both decodes while the pool goes back to one pod.
        # The operator ranks the pods first; the ReplicaSet controller deletes one; the kubelet stops
        # its engine with SIGTERM, which drains: running streams finish, then it exits.
        streams = [Stream(router.url, name, max_tokens=48) for _ in range(6)]
        for stream in streams:
            stream.thread.start()
        wait_for(lambda: all(stream.chunks for stream in streams), timeout=60, what="every stream under way")
        cluster.custom.patch_namespaced_custom_object_scale(
            GROUP, VERSION, NAMESPACE, "pdpools", f"{name}-decode", {"spec": {"replicas": 1}}
        )
        for stream in streams:
            stream.thread.join(120)
        assert [(s.error, s.finish_reason, s.tokens) for s in streams] == [(None, "length", 48)] * 6
        (survivor,) = running_pods(cluster, name, "decode", 1)
        assert DELETION_COST in (survivor.metadata.annotations or {})  # honoured from Kubernetes 1.22
        assert completion(router.url, name)["usage"]["completion_tokens"] == 8
        processes.start_healthy(running_pods(cluster, name, "decode", 1))

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
        assert again.spec.replicas == 1
        # A resized Deployment goes back to its PDPool's count.
        cluster.apps.patch_namespaced_deployment_scale(f"{name}-decode", NAMESPACE, {"spec": {"replicas": 5}})
        wait_for(
            lambda: cluster.apps.read_namespaced_deployment(f"{name}-decode", NAMESPACE).spec.replicas == 1,
            timeout=15,
            what="the Deployment's replicas restored",
        )
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


TOKENS = 300  # per stream of the rollout test: a few seconds each, so that drains find streams to hand over


def test_rolling_updates_under_load_lose_no_request(
    cluster: Cluster, kubelet: FakeKubelet, operator: Any, tmp_path: Path
) -> None:
    """A rolling update of the decode pool, then of the prefill pool (new engine flags: a new pod template),
    while streams start every 0.3 s: every stream ends whole. An old decode pod, deleted once its successor is
    Ready, drains: after 1 s (--drain-handoff) it hands the streams it still runs back to the router, which
    continues them on another decode pod; it exits long before its grace period. Simulated: the kubelet's part
    (starting each new pod's process, SIGTERM then SIGKILL after the grace period on deletion); everything
    else (the operator, the Deployment and ReplicaSet controllers' rollout, the router's discovery) is real."""
    name = "roll"
    service = _cpu_example(name)
    service["spec"]["decode"]["replicas"] = 2
    # Hand streams over after 1 s, not 5: the test's streams (300 tokens) run a few seconds each.
    service["spec"]["decode"]["engineArgs"] = ["--drain-handoff", "1"]
    cluster.create(service, namespace=NAMESPACE)
    processes = PodProcesses(cluster, kubelet, tmp_path, name)
    streams: list[Stream] = []
    stop = threading.Event()
    helpers: list[threading.Thread] = []
    try:
        processes.start_healthy([*running_pods(cluster, name, "prefill", 1), *running_pods(cluster, name, "decode", 2)])
        (router,) = processes.start_healthy(running_pods(cluster, name, "router", 1))
        wait_for(lambda: _answers(router.url, name), timeout=60, what="a completion through the router")

        def kubelet_starts_new_pods() -> None:
            while not stop.is_set():
                processes.start_new(name)
                stop.wait(0.3)

        def load() -> None:
            while not stop.is_set():
                stream = Stream(router.url, name, max_tokens=TOKENS)
                stream.thread.start()
                streams.append(stream)
                stop.wait(0.3)

        helpers += [threading.Thread(target=kubelet_starts_new_pods, daemon=True), threading.Thread(target=load)]
        for helper in helpers:
            helper.start()
        started = time.monotonic()
        rollouts = {}
        for role in ("decode", "prefill"):
            began = time.monotonic()
            before = cluster.apps.read_namespaced_deployment(f"{name}-{role}", NAMESPACE).metadata.generation
            args = service["spec"][role].get("engineArgs", [])
            patch = {"spec": {role: {"engineArgs": [*args, "--max-num-seqs", "48"]}}}
            cluster.custom.patch_namespaced_custom_object(GROUP, VERSION, NAMESPACE, "pdservices", name, patch)
            wait_for(lambda: _rolled_out(cluster, name, role, before), timeout=180, what=f"the {role} rollout")  # noqa: B023
            rollouts[role] = time.monotonic() - began
        time.sleep(2)  # streams started during the last pod's drain run on
        stop.set()
        helpers[1].join()
        for stream in streams:
            stream.thread.join(180)
        migrations = {
            key: value
            for key, value in scrape(router.url).items()
            if key.startswith("pdserve_router_migrations_total") and value
        }
    finally:
        stop.set()
        for helper in helpers:  # no process may start after the others are stopped
            helper.join(120)
        processes.stop_all()
        cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, NAMESPACE, "pdservices", name)
    outcomes = [(s.error, s.finish_reason, s.tokens) for s in streams]
    failed = [outcome for outcome in outcomes if outcome != (None, "length", TOKENS)]
    gaps = sorted(s.longest_gap for s in streams)
    print(
        f"rollouts under load ({time.monotonic() - started:.0f} s; decode {rollouts['decode']:.0f} s, prefill "
        f"{rollouts['prefill']:.0f} s): {len(streams)} streams, {len(failed)} failed; migrations {migrations}; "
        f"longest gap per stream p50 {gaps[len(gaps) // 2]:.2f} s, p99 {gaps[int(len(gaps) * 0.99)]:.2f} s, "
        f"max {gaps[-1]:.2f} s; deleted pods stopped in {', '.join(f'{s:.1f}' for _, s in processes.stopped)} s"
    )
    assert not failed, failed[:5]
    assert sum(migrations.values()) > 0, "no stream was handed over: the rollout did not test the hand-off"


def _answers(url: str, model: str) -> bool:
    try:
        return completion(url, model)["usage"]["completion_tokens"] == 8
    except OSError:  # until the router's discovery has seen the pods Ready
        return False


def _rolled_out(cluster: Cluster, service: str, role: str, generation: int) -> bool:
    """The role's Deployment, changed since ``generation``, runs only pods of its latest template, all Ready."""
    deployment = cluster.apps.read_namespaced_deployment(f"{service}-{role}", NAMESPACE)
    status = deployment.status
    wanted = deployment.spec.replicas
    done = (
        deployment.metadata.generation > generation
        and (status.observed_generation or 0) >= deployment.metadata.generation
        and status.updated_replicas == wanted
        and status.ready_replicas == wanted
        and status.replicas == wanted
    )
    return done and len(pods(cluster, service, role)) == wanted


def _ready(obj: dict[str, Any] | None) -> bool:
    conditions = ((obj or {}).get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)
