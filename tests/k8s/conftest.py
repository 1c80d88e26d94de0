"""Fixtures of `make test-k8s`: a real Kubernetes control plane with the chart installed and the
operator running under the chart's ServiceAccount (RBAC enforced), and the fake kubelet.

`tests/k8s/control_plane.sh install` (run by `make test-k8s`) builds the binaries once per machine;
`start` brings up a fresh etcd + kube-apiserver + kube-controller-manager + kube-scheduler for the
session. Objects the server cannot take (an apiVersion Kubernetes 1.20 does not serve) are skipped,
never downgraded, and listed by name at the end of the run.
"""

from __future__ import annotations

import base64
import copy
import functools
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python
import kubernetes
import pytest
import yaml
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import ResourceNotFoundError

from pdserve.launcher import free_port
from tests.k8s.fake_kubelet import FakeKubelet
from tests.operator.kmock_cluster import wait_for

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "pdserve"
CONTROL_PLANE = Path(__file__).with_name("control_plane.sh")
RELEASE, RELEASE_NAMESPACE = "pdserve", "pdserve-system"
NAMESPACE = "pdserve-k8s-test"  # where the tests' PDServices live

# (where, apiVersion, kind, name) of every object the server could not take: shown at the end.
SKIPPED: list[tuple[str, str, str, str]] = []


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if SKIPPED:
        terminalreporter.section("objects the API server does not serve (skipped, not downgraded)")
        for where, api_version, kind, name in SKIPPED:
            terminalreporter.line(f"{where}: {api_version} {kind} {name}")


class Cluster:
    """The admin's view of the real API server: typed clients, a dynamic client, helpers."""

    def __init__(self, kubeconfig: Path) -> None:
        self.kubeconfig = kubeconfig
        self.api = kubernetes.config.new_client_from_config(str(kubeconfig))
        self.core = kubernetes.client.CoreV1Api(self.api)
        self.apps = kubernetes.client.AppsV1Api(self.api)
        self.custom = kubernetes.client.CustomObjectsApi(self.api)
        self.refresh()

    def refresh(self) -> None:
        """Read the API's discovery again (after CRDs were added)."""
        self.dynamic = DynamicClient(self.api)

    def resource(self, api_version: str, kind: str) -> Any | None:
        """The served resource of this apiVersion and kind, or None when the server lacks it."""
        try:
            return self.dynamic.resources.get(api_version=api_version, kind=kind)
        except ResourceNotFoundError:
            return None

    def create(self, obj: dict[str, Any], namespace: str | None = None, dry_run: bool = False) -> Any:
        resource = self.resource(obj["apiVersion"], obj["kind"])
        assert resource is not None, f"{obj['apiVersion']} {obj['kind']} is not served"
        options = {"dry_run": "All"} if dry_run else {}
        where = {"namespace": namespace or obj["metadata"].get("namespace")} if resource.namespaced else {}
        return resource.create(body=obj, **where, **options)

    def token_of(self, service_account: str, namespace: str) -> str:
        """The ServiceAccount's token, from the Secret the token controller makes for it (Kubernetes 1.20)."""

        def token() -> str | None:
            for secret in self.core.list_namespaced_secret(namespace).items:
                annotations = secret.metadata.annotations or {}
                if (
                    secret.type == "kubernetes.io/service-account-token"
                    and annotations.get("kubernetes.io/service-account.name") == service_account
                ):
                    return base64.b64decode(secret.data["token"]).decode()
            return None

        return wait_for(token, timeout=30, what=f"a token for {namespace}/{service_account}")

    def kubeconfig_for(self, token: str, path: Path) -> Path:
        """A kubeconfig like the admin's, with this bearer token (a ServiceAccount's)."""
        config = yaml.safe_load(self.kubeconfig.read_text())
        config["users"][0]["user"] = {"token": token}
        path.write_text(yaml.safe_dump(config))
        return path


def render_chart(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The chart's templates as Helm renders them (without its tests' hook pod and notes)."""
    chart = helm_python.Chart.load(CHART)
    manifests = chart.render(copy.deepcopy(values or {}), name=RELEASE, namespace=RELEASE_NAMESPACE)
    docs = []
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt") or "/tests/" in path:
            continue
        docs.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return docs


def create_or_skip(cluster: Cluster, obj: dict[str, Any], where: str, **options: Any) -> bool:
    """Create obj; when the server does not serve its apiVersion, record it in SKIPPED instead."""
    if cluster.resource(obj["apiVersion"], obj["kind"]) is None:
        SKIPPED.append((where, obj["apiVersion"], obj["kind"], obj["metadata"]["name"]))
        return False
    cluster.create(obj, **options)
    return True


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A fresh control plane with the chart's CRDs and templates installed."""
    started = subprocess.run(["bash", str(CONTROL_PLANE), "start"], capture_output=True, text=True, timeout=300)
    if started.returncode != 0:
        pytest.fail(f"the control plane did not start:\n{started.stderr[-3000:]}")
    try:
        cluster = Cluster(Path(started.stdout.strip().splitlines()[-1]))
        crds = kubernetes.client.ApiextensionsV1Api(cluster.api)
        for path in sorted((CHART / "crds").glob("*.yaml")):
            crds.create_custom_resource_definition(yaml.safe_load(path.read_text()))
        for path in sorted((CHART / "crds").glob("*.yaml")):
            name = yaml.safe_load(path.read_text())["metadata"]["name"]
            established = functools.partial(_established, crds, name)
            wait_for(established, timeout=30, what=f"CRD {name} established")
        cluster.refresh()
        for namespace in (RELEASE_NAMESPACE, NAMESPACE):
            cluster.core.create_namespace({"metadata": {"name": namespace}})
        for doc in render_chart():
            create_or_skip(cluster, doc, "chart", namespace=RELEASE_NAMESPACE)
        yield cluster
    finally:
        subprocess.run(["bash", str(CONTROL_PLANE), "stop"], capture_output=True, timeout=120)


def _established(crds: kubernetes.client.ApiextensionsV1Api, name: str) -> bool:
    conditions = crds.read_custom_resource_definition(name).status.conditions or []
    return any(c.type == "Established" and c.status == "True" for c in conditions)


@pytest.fixture(scope="session")
def kubelet(cluster: Cluster) -> Iterator[FakeKubelet]:
    node = FakeKubelet(cluster.api)
    node.start()
    yield node
    node.stop()


@pytest.fixture(scope="session")
def operator(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[subprocess.Popen]:
    """`pdserve operator` (all namespaces, as the chart runs it) with the chart's ServiceAccount token."""
    folder = tmp_path_factory.mktemp("operator")
    (deployment,) = [d for d in render_chart() if d["kind"] == "Deployment"]
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    kubeconfig = cluster.kubeconfig_for(cluster.token_of(account, RELEASE_NAMESPACE), folder / "kubeconfig")
    env = {"KUBECONFIG": str(kubeconfig), "PATH": "/usr/bin:/bin", "HOME": str(folder)}
    log = folder / "operator.log"
    with open(log, "wb") as output:
        process = subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli", "operator", "--liveness-port", str(free_port())],
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
    process.log_path = log  # type: ignore[attr-defined]
    yield process
    process.terminate()
    try:
        process.wait(20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)
