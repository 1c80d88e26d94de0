"""Kubernetes discovery: the router's prefill and decode pod sets follow the cluster's pods.

A thread lists and then watches the pods matching the selector in one namespace (the
``kubernetes`` client is synchronous; the event loop never waits on it). A pod joins its role's
set (label ``pdserve.io/role``) once it is Ready and has an IP, at ``http://IP:PORT`` (the
container port named ``http``), and leaves when it stops being Ready, is being deleted or is
gone. Each change hands the event loop a complete snapshot, so a missed or repeated watch event
cannot leave a stale pod behind: the next snapshot replaces the set. A watch that expires (410)
or breaks is followed by a fresh list.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any

from pdserve.api.roles import POOL_ROLES, ROLE_LABEL

logger = logging.getLogger(__name__)

DEFAULT_PORTS = {role.name: role.default_port for role in POOL_ROLES}
WATCH_TIMEOUT_S = 10  # a watch ends this often, so a stop request is noticed
RETRY_DELAY_S = 2.0

Snapshot = dict[str, list[str]]  # role -> pod URLs


def pod_endpoint(pod: Any) -> tuple[str, str] | None:
    """(role, URL) of a pod that can take requests now; None for any other pod."""
    labels = pod.metadata.labels or {}
    role = labels.get(ROLE_LABEL)
    if role not in DEFAULT_PORTS or pod.metadata.deletion_timestamp is not None:
        return None
    status = pod.status
    if status is None or not status.pod_ip or status.phase != "Running":
        return None
    if not any(c.type == "Ready" and c.status == "True" for c in status.conditions or ()):
        return None
    port = DEFAULT_PORTS[role]
    for container in pod.spec.containers or ():
        for container_port in container.ports or ():
            if container_port.name == "http":
                port = container_port.container_port
    host = f"[{status.pod_ip}]" if ":" in status.pod_ip else status.pod_ip
    return role, f"http://{host}:{port}"


class KubernetesDiscovery:
    def __init__(
        self, namespace: str, selector: str, on_snapshot: Callable[[Snapshot], None], loop: asyncio.AbstractEventLoop
    ) -> None:
        self.namespace = namespace
        self.selector = selector
        self._on_snapshot = on_snapshot
        self._loop = loop
        self._stop = threading.Event()
        self._endpoints: dict[str, tuple[str, str]] = {}  # pod uid -> (role, url)
        self._thread = threading.Thread(target=self._run, name="pdserve-discovery", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _publish(self) -> None:
        snapshot: Snapshot = {role: [] for role in DEFAULT_PORTS}
        for role, url in self._endpoints.values():
            snapshot[role].append(url)
        for urls in snapshot.values():
            urls.sort()
        self._loop.call_soon_threadsafe(self._on_snapshot, snapshot)

    def _set(self, pod: Any) -> bool:
        """Record a pod's current endpoint; True when that changed anything."""
        uid = pod.metadata.uid
        endpoint = pod_endpoint(pod)
        if endpoint == self._endpoints.get(uid):
            return False
        if endpoint is None:
            del self._endpoints[uid]
        else:
            self._endpoints[uid] = endpoint
        return True

    def _run(self) -> None:
        from kubernetes import client, config, watch
        from kubernetes.client.exceptions import ApiException

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        api = client.CoreV1Api()
        while not self._stop.is_set():
            try:
                listed = api.list_namespaced_pod(self.namespace, label_selector=self.selector)
                self._endpoints = {}
                for pod in listed.items:
                    self._set(pod)
                self._publish()
                version = listed.metadata.resource_version if listed.metadata is not None else None
                while not self._stop.is_set():
                    stream = watch.Watch().stream(
                        api.list_namespaced_pod,
                        self.namespace,
                        label_selector=self.selector,
                        resource_version=version,
                        timeout_seconds=WATCH_TIMEOUT_S,
                    )
                    for event in stream:
                        pod = event["object"]
                        version = pod.metadata.resource_version or version
                        changed = (
                            self._endpoints.pop(pod.metadata.uid, None) is not None
                            if event["type"] == "DELETED"
                            else self._set(pod)
                        )
                        if changed:
                            self._publish()
            except ApiException as error:
                if error.status != 410:  # 410: the watch's version is too old; list again at once
                    logger.warning("pod discovery in %s: %s; retrying", self.namespace, error.reason)
                    self._stop.wait(RETRY_DELAY_S)
            except Exception as error:  # network or decoding trouble: keep the last view, try again
                logger.warning("pod discovery in %s failed: %s; retrying", self.namespace, error)
                self._stop.wait(RETRY_DELAY_S)
