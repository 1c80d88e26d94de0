"""A Kubernetes API emulator for tests without a cluster: kmock served over real HTTP in its own thread.

`KubeCluster` starts `kmock_emulator.Emulator` on 127.0.0.1 in a thread with its own event loop,
writes a kubeconfig for it and points this process at it (KUBECONFIG, the `kubernetes` client's
default configuration), so kopf operators and `kubernetes` clients in the tests talk to it as to
a cluster (stop() restores the previous settings). It offers small synchronous JSON helpers
(create, get, list, patch, delete, events, requests, wait_idle; and `wait_for`) keyed by resource
strings such as "v1/pods", "apps/v1/deployments", "pdserve.io/v1alpha1/pdpools".

Pytest: import the fixtures into a conftest (`from tests.operator.kmock_cluster import kube_cluster,
kube_namespace`); `kube_cluster` is one emulator per session with the chart's CRDs applied,
`kube_namespace` a fresh namespace name per test. No controllers run: set Deployment or Pod status
with `patch(..., subresource="status")`; nothing is garbage-collected. For example:

    kube_cluster.create("v1/pods", {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p",
                        "labels": {"app.kubernetes.io/instance": "llm"}}, "spec": {...}}, kube_namespace)
    kube_cluster.patch("v1/pods", "p", {"status": {"podIP": "10.0.0.5", "conditions": [
                       {"type": "Ready", "status": "True"}]}}, kube_namespace, subresource="status")
    kube_cluster.delete("v1/pods", "p", kube_namespace)
"""

import asyncio
import builtins
import json
import os
import pathlib
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import kmock
import kubernetes
import pytest
import yaml
from kubernetes.config import kube_config

from tests.operator.kmock_emulator import Emulator

CRD_DIR = pathlib.Path(__file__).resolve().parents[2] / "helm" / "pdserve" / "crds"
T = TypeVar("T")


class ApiError(Exception):
    """A non-2xx answer of the emulated API server."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:500]}")
        self.status = status
        self.body = body


def wait_for(check: Callable[[], T], timeout: float = 10.0, interval: float = 0.05, what: str = "") -> T:
    """Poll `check` until it returns something truthy, and return that; AssertionError (naming
    `what`) on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"{what or 'not true'} after {timeout} s; last result: {result!r}")
        time.sleep(interval)


class KubeCluster:
    """The emulator, its kubeconfig, and JSON helpers. Use as a context manager (or start/stop)."""

    def __init__(self, crds: builtins.list[pathlib.Path] | None = None) -> None:
        self.crds = crds or []
        self.emulator: Emulator | None = None  # for inspection only: it lives in another thread
        self.url = ""
        self.kubeconfig = pathlib.Path()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._started = threading.Event()
        self._saved_env: dict[str, str | None] = {}
        self._saved_client: tuple[str, kubernetes.client.Configuration] | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None

    # -- lifecycle -------------------------------------------------------------------------------

    def __enter__(self) -> "KubeCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> "KubeCluster":
        self._thread = threading.Thread(target=self._serve, name="kmock", daemon=True)
        self._thread.start()
        if not self._started.wait(10) or not self.url:
            raise RuntimeError("the kmock emulator did not start")
        self._tmp = tempfile.TemporaryDirectory(prefix="kmock-")
        self.kubeconfig = pathlib.Path(self._tmp.name) / "kubeconfig"
        self.kubeconfig.write_text(yaml.safe_dump(self._kubeconfig()))
        self._point_clients_here()
        for path in self.crds:
            self.apply_crds(path)
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stopping is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)
        if self._thread is not None:
            self._thread.join(10)
        self._restore_clients()
        if self._tmp is not None:
            self._tmp.cleanup()

    def _serve(self) -> None:
        self._loop = asyncio.new_event_loop()
        try:
            self._loop.run_until_complete(self._main())
        finally:
            self._loop.close()

    async def _main(self) -> None:
        self._stopping = asyncio.Event()
        async with Emulator() as emulator, kmock.Server(emulator) as server:
            self.emulator = emulator
            self.url = f"http://{server.host}:{server.port}"
            self._started.set()
            await self._stopping.wait()

    def _kubeconfig(self) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "kmock", "cluster": {"server": self.url}}],
            "users": [{"name": "kmock", "user": {"token": "kmock-token"}}],
            "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock"}}],
            "current-context": "kmock",
        }

    def _point_clients_here(self) -> None:
        # In-cluster variables would make kopf and `kubernetes` prefer a service account.
        for key in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"):
            self._saved_env[key] = os.environ.pop(key, None)
        os.environ["KUBECONFIG"] = str(self.kubeconfig)
        self._saved_client = (kube_config.KUBE_CONFIG_DEFAULT_LOCATION, kubernetes.client.Configuration.get_default())
        # The module read $KUBECONFIG when it was imported, maybe before this fixture ran.
        kube_config.KUBE_CONFIG_DEFAULT_LOCATION = str(self.kubeconfig)
        kubernetes.config.load_kube_config(config_file=str(self.kubeconfig))

    def _restore_clients(self) -> None:
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if self._saved_client is not None:
            kube_config.KUBE_CONFIG_DEFAULT_LOCATION, default = self._saved_client
            kubernetes.client.Configuration.set_default(default)

    # -- JSON helpers ----------------------------------------------------------------------------

    def path(
        self, resource: str, namespace: str | None = None, name: str | None = None, subresource: str | None = None
    ) -> str:
        """The URL path of a resource, e.g. ("apps/v1/deployments", "ns", "web") -> /apis/apps/v1/..."""
        parsed = kmock.resource(resource)
        parts = ["api", parsed.version] if parsed.group == "" else ["apis", parsed.group, parsed.version]
        if namespace:
            parts += ["namespaces", namespace]
        parts.append(parsed.plural)
        parts += [part for part in (name, subresource) if part]
        return "/" + "/".join(parts)

    def request(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": content_type, "Accept": "application/json"}
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=10) as response:
                text = response.read()
        except urllib.error.HTTPError as e:
            raise ApiError(e.code, e.read().decode(errors="replace")) from None
        return json.loads(text) if text else None

    def create(self, resource: str, obj: dict[str, Any], namespace: str | None = None) -> dict[str, Any]:
        namespace = namespace or obj.get("metadata", {}).get("namespace")
        return self.request("POST", self.path(resource, namespace), obj)

    def get(self, resource: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        try:
            return self.request("GET", self.path(resource, namespace, name))
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    def list(
        self, resource: str, namespace: str | None = None, label_selector: str | None = None
    ) -> builtins.list[dict[str, Any]]:
        query = "?" + urllib.parse.urlencode({"labelSelector": label_selector}) if label_selector else ""
        return self.request("GET", self.path(resource, namespace) + query)["items"]

    def patch(
        self, resource: str, name: str, patch: Any, namespace: str | None = None, subresource: str | None = None
    ) -> dict[str, Any]:
        """JSON merge patch (a dict) or JSON patch (a list)."""
        kind = "application/json-patch+json" if isinstance(patch, list) else "application/merge-patch+json"
        return self.request("PATCH", self.path(resource, namespace, name, subresource), patch, kind)

    def delete(self, resource: str, name: str, namespace: str | None = None) -> None:
        self.request("DELETE", self.path(resource, namespace, name))

    def apply_crds(self, path: pathlib.Path) -> None:
        """Create the CRDs of a YAML file, or of every *.yaml file of a folder."""
        files = sorted(path.glob("*.yaml")) if path.is_dir() else [path]
        for file in files:
            for doc in yaml.safe_load_all(file.read_text()):
                if doc and doc.get("kind") == "CustomResourceDefinition":
                    self.create("apiextensions.k8s.io/v1/customresourcedefinitions", doc)

    def requests(self) -> builtins.list[tuple[str, str]]:
        """(method, path?query) of every request served so far, oldest first."""
        assert self.emulator is not None
        return list(self.emulator.log)  # a copy: the emulator's thread appends to it

    def wait_idle(self, quiet: float = 0.5, timeout: float = 10.0) -> None:
        """Wait until no request has arrived for `quiet` seconds (clients have settled)."""
        deadline = time.monotonic() + timeout
        count, since = len(self.requests()), time.monotonic()
        while time.monotonic() - since < quiet:
            if time.monotonic() > deadline:
                raise AssertionError(f"requests kept coming for {timeout} s")
            time.sleep(quiet / 10)
            if len(self.requests()) != count:
                count, since = len(self.requests()), time.monotonic()

    def events(self, namespace: str, involved: str | None = None) -> builtins.list[dict[str, Any]]:
        """Core v1 events of a namespace, optionally only those about the object named `involved`."""
        items = self.list("v1/events", namespace)
        return [e for e in items if involved is None or e.get("involvedObject", {}).get("name") == involved]


@pytest.fixture(scope="session")
def kube_cluster() -> Iterator[KubeCluster]:
    """One emulated API server for the session, with helm/pdserve/crds applied."""
    with KubeCluster(crds=[CRD_DIR]) as cluster:
        yield cluster


@pytest.fixture()
def kube_namespace(kube_cluster: KubeCluster) -> str:
    """A fresh namespace name per test, so that tests sharing the emulator never see each other's objects.

    Only the name: kmock cannot serve /api/v1/namespaces, and it needs no Namespace object anyway.
    """
    return f"t-{uuid.uuid4().hex[:8]}"
