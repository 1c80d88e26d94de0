"""Kubernetes discovery: the router's prefill and decode pod sets follow the cluster's pods.

A thread lists and then watches the pods matching the selector in one namespace (the
``kubernetes`` client is synchronous; the event loop never waits on it). A pod joins its role's
set (label ``pdserve.io/role``) once it is Ready and has an IP, at ``http://IP:PORT`` (the
container port named ``http``), and leaves when it stops being Ready, is being deleted or is
gone. Each change hands the event loop a complete snapshot, so a missed or repeated watch event
cannot leave a stale pod behind: the next snapshot replaces the set. A watch that expires (410)
or breaks is followed by a fresh list.

With an InferencePool named (the endpoint picker behind a gateway), its ``spec.selector`` says which decode
pods requests may go to: a decode pod it does not select is no candidate, whatever the router's own selector
says (a platform team may narrow the pool, a canary subset say). The pool is read again each time a watch
ends (every ``WATCH_TIMEOUT_S``); a selector that changed takes effect then. A pool that cannot be read keeps
the last view it gave (none at first: no decode pod until the pool is read).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any

from pdserve.api.roles import DECODE, POOL_ROLES, ROLE_LABEL

logger = logging.getLogger(__name__)

DEFAULT_PORTS = {role.name: role.default_port for role in POOL_ROLES}
WATCH_TIMEOUT_S = 10  # a watch ends this often, so a stop request is noticed
RETRY_DELAY_S = 2.0

Snapshot = dict[str, list[str]]  # role -> pod URLs
# The Gateway API Inference Extension's pool: (group, version, plural).
INFERENCE_POOL = ("inference.networking.k8s.io", "v1", "inferencepools")


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
        self,
        namespace: str,
        selector: str,
        on_snapshot: Callable[[Snapshot], None],
        loop: asyncio.AbstractEventLoop,
        inference_pool: str | None = None,
    ) -> None:
        self.namespace = namespace
        self.selector = selector
        self.inference_pool = inference_pool
        # The pool's matchLabels (None: not read yet, so no decode pod); unused without a pool.
        self._pool_labels: dict[str, str] | None = None
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
        if endpoint is not None and endpoint[0] == DECODE.name and not self._in_pool(pod):
            endpoint = None
        if endpoint == self._endpoints.get(uid):
            return False
        if endpoint is None:
            self._endpoints.pop(uid, None)
        else:
            self._endpoints[uid] = endpoint
        return True

    def _in_pool(self, pod: Any) -> bool:
        if self.inference_pool is None:
            return True
        if self._pool_labels is None:
            return False
        labels = pod.metadata.labels or {}
        return all(labels.get(key) == value for key, value in self._pool_labels.items())

    def _read_pool(self, custom: Any) -> bool:
        """Read the InferencePool's selector; True when it changed (the pods must be listed again)."""
        group, version, plural = INFERENCE_POOL
        pool = custom.get_namespaced_custom_object(group, version, self.namespace, plural, self.inference_pool)
        labels = dict(((pool.get("spec") or {}).get("selector") or {}).get("matchLabels") or {})
        if labels == self._pool_labels:
            return False
        logger.info("InferencePool %s selects decode pods by %s", self.inference_pool, labels)
        self._pool_labels = labels
        return True

    def _run(self) -> None:
        from kubernetes import client, config, watch
        from kubernetes.client.exceptions import ApiException

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        api = client.CoreV1Api()
        custom = client.CustomObjectsApi() if self.inference_pool is not None else None
        while not self._stop.is_set():
            try:
                if custom is not None:
                    self._read_pool(custom)
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
                    if custom is not None and self._read_pool(custom):
                        break  # another selector: list the pods again under it
            except ApiException as error:
                if error.status != 410:  # 410: the watch's version is too old; list again at once
                    logger.warning("pod discovery in %s: %s; retrying", self.namespace, error.reason)
                    self._stop.wait(RETRY_DELAY_S)
            except Exception as error:  # network or decoding trouble: keep the last view, try again
                logger.warning("pod discovery in %s failed: %s; retrying", self.namespace, error)
                self._stop.wait(RETRY_DELAY_S)
