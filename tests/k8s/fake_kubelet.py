"""A kubelet without containers, for tests against a real control plane (tests/k8s).

It registers one Node and keeps it Ready. Every pod the real scheduler binds to that node is
marked Running with a loopback IP of its own (127.0.1.N), which the test uses to start the pod's
process. Readiness is probed as a kubelet does: each pod's readinessProbe HTTP GET is sent to its
IP every half second, and the pod's Ready condition follows it. A pod whose deletion begins is
handed to `on_terminating` (the test stops its process, as a kubelet would send SIGTERM), then
deleted for good.

This is the one emulated part of `make test-k8s`: no container runtime can run here. The API
server, etcd, controller-manager (Deployments, ReplicaSets, garbage collection, ServiceAccount
tokens) and scheduler are the real ones.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import threading
import urllib.request
from collections.abc import Callable
from typing import Any

from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

logger = logging.getLogger(__name__)

PROBE_INTERVAL_S = 0.5
HEARTBEAT_S = 10.0


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat()


def _condition(kind: str, ok: bool) -> dict[str, str]:
    return {"type": kind, "status": "True" if ok else "False", "lastTransitionTime": _now()}


class FakeKubelet:
    """The node `name`'s kubelet: pods Running on 127.0.1.N, readiness probed over HTTP."""

    def __init__(self, api: client.ApiClient, name: str = "pdserve-fake-node", first_ip: str = "127.0.1.1") -> None:
        self.core = client.CoreV1Api(api)
        self.coordination = client.CoordinationV1Api(api)
        self.name = name
        self.first_ip = ipaddress.ip_address(first_ip)
        self.on_terminating: Callable[[Any], None] = lambda pod: None
        self._ips: dict[str, str] = {}  # pod uid -> IP
        self._ready: dict[str, bool] = {}  # pod uid -> what the status says
        self._running: dict[str, Any] = {}  # pod uid -> the pod, while it runs here
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=loop, name=f"fake-kubelet-{loop.__name__}", daemon=True)
            for loop in (self._heartbeat, self._watch_pods, self._probe)
        ]

    def start(self) -> None:
        node = {"metadata": {"name": self.name, "labels": {"kubernetes.io/hostname": self.name}}}
        try:
            self.core.create_node(node)
        except ApiException as error:
            if error.status != 409:
                raise
        self._report_node()
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()

    def ip_of(self, pod: Any) -> str | None:
        with self._lock:
            return self._ips.get(pod.metadata.uid)

    # --- node -------------------------------------------------------------------------------------

    def _report_node(self) -> None:
        now = _now()
        conditions = [
            {"type": kind, "status": "False", "reason": "Fake", "lastHeartbeatTime": now, "lastTransitionTime": now}
            for kind in ("MemoryPressure", "DiskPressure", "PIDPressure")
        ]
        conditions.append(
            {"type": "Ready", "status": "True", "reason": "Fake", "lastHeartbeatTime": now, "lastTransitionTime": now}
        )
        capacity = {"cpu": "64", "memory": "256Gi", "pods": "110", "nvidia.com/gpu": "8"}
        info = dict.fromkeys(
            ("machineID", "systemUUID", "bootID", "kernelVersion", "osImage", "containerRuntimeVersion"), ""
        )
        info.update(kubeletVersion="fake", kubeProxyVersion="fake", operatingSystem="linux", architecture="amd64")
        status = {
            "conditions": conditions,
            "capacity": capacity,
            "allocatable": capacity,
            "addresses": [{"type": "Hostname", "address": self.name}],
            "nodeInfo": info,
        }
        self.core.patch_node_status(self.name, {"status": status})

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._report_node()
            except Exception as error:  # the next beat tries again
                logger.warning("node heartbeat failed: %s", error)

    # --- pods -------------------------------------------------------------------------------------

    def _watch_pods(self) -> None:
        selector = f"spec.nodeName={self.name}"
        while not self._stop.is_set():
            try:
                stream = watch.Watch().stream(
                    self.core.list_pod_for_all_namespaces, field_selector=selector, timeout_seconds=60
                )
                for event in stream:
                    self._pod_event(event["type"], event["object"])
                    if self._stop.is_set():
                        return
            except Exception as error:  # the watch is opened again
                logger.warning("pod watch failed: %s", error)
                self._stop.wait(0.5)

    def _pod_event(self, kind: str, pod: Any) -> None:
        uid = pod.metadata.uid
        if kind == "DELETED":
            with self._lock:
                self._ips.pop(uid, None)
                self._ready.pop(uid, None)
                self._running.pop(uid, None)
            return
        if pod.metadata.deletion_timestamp:
            with self._lock:
                running = self._running.pop(uid, None) is not None
            if running:  # its own thread: a process may take its grace period to drain
                threading.Thread(target=self._terminate, args=(pod,), daemon=True).start()
            return
        with self._lock:
            if uid in self._running:
                return
            taken = set(self._ips.values())
            ip = next(str(self.first_ip + n) for n in range(250) if str(self.first_ip + n) not in taken)
            self._ips[uid] = ip
            self._running[uid] = pod
            self._ready[uid] = pod.spec.containers[0].readiness_probe is None
        self._write_status(pod, ip, self._ready[uid])
        logger.info("pod %s/%s running at %s", pod.metadata.namespace, pod.metadata.name, ip)

    def _terminate(self, pod: Any) -> None:
        """What a kubelet does for a pod being deleted: stop what runs, then remove the pod for good."""
        self.on_terminating(pod)
        try:
            self.core.delete_namespaced_pod(pod.metadata.name, pod.metadata.namespace, grace_period_seconds=0)
        except ApiException as error:
            if error.status != 404:
                raise

    def _write_status(self, pod: Any, ip: str, ready: bool) -> None:
        now = _now()
        containers = [
            {
                "name": container.name,
                "image": container.image,
                "imageID": "",
                "ready": ready,
                "restartCount": 0,
                "started": True,
                "state": {"running": {"startedAt": now}},
            }
            for container in pod.spec.containers
        ]
        conditions = [_condition("Initialized", True), _condition("PodScheduled", True)]
        conditions += [_condition("Ready", ready), _condition("ContainersReady", ready)]
        status = {
            "phase": "Running",
            "hostIP": "127.0.0.1",
            "podIP": ip,
            "podIPs": [{"ip": ip}],
            "startTime": now,
            "conditions": conditions,
            "containerStatuses": containers,
        }
        try:
            self.core.patch_namespaced_pod_status(pod.metadata.name, pod.metadata.namespace, {"status": status})
        except ApiException as error:
            if error.status != 404:  # deleted meanwhile
                raise

    # --- readiness --------------------------------------------------------------------------------

    def _probe(self) -> None:
        while not self._stop.wait(PROBE_INTERVAL_S):
            with self._lock:
                pods = [(uid, pod, self._ips[uid]) for uid, pod in self._running.items()]
            for uid, pod, ip in pods:
                ready = _probe_ready(pod, ip)
                with self._lock:
                    if uid not in self._running or self._ready.get(uid) == ready:
                        continue
                    self._ready[uid] = ready
                try:
                    self._write_status(pod, ip, ready)
                except Exception as error:  # written again at the next change
                    logger.warning("pod status of %s failed: %s", pod.metadata.name, error)


def _probe_ready(pod: Any, ip: str) -> bool:
    """The first container's readinessProbe (HTTP GET) against the pod's IP; no probe: ready."""
    container = pod.spec.containers[0]
    probe = container.readiness_probe
    if probe is None or probe.http_get is None:
        return True
    port = probe.http_get.port
    if isinstance(port, str):  # a named container port
        port = next(p.container_port for p in container.ports or [] if p.name == port)
    try:
        with urllib.request.urlopen(f"http://{ip}:{port}{probe.http_get.path or '/'}", timeout=1) as response:
            return 200 <= response.status < 400
    except OSError:
        return False
