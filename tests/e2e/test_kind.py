"""End to end on a real cluster: kind + helm + kubectl + docker (docs/kubernetes.md, "Tests").

Builds the CPU image, loads it into a kind cluster, installs the chart (helm install --wait, then
helm test), writes the demo model onto a PVC and serves it with the CPU example PDService, waits
for Ready, scales the decode PDPool to 2, sends OpenAI requests through the router (kubectl
port-forward), deletes the PDService and checks that its objects are garbage-collected.

Runs only with PDSERVE_E2E=1 and docker, kind, helm and kubectl on PATH:

    PDSERVE_E2E=1 .venv/bin/python -m pytest tests/e2e -m slow -v

PDSERVE_E2E_IMAGE=name:tag uses an image already built (skips docker build); PDSERVE_E2E_CLUSTER
names the kind cluster (default pdserve-e2e; an existing one is reused and kept);
PDSERVE_E2E_KEEP=1 keeps a cluster this test created.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from pdserve.launcher import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "pdserve"
CPU_EXAMPLE = CHART / "examples" / "pdservice-cpu.yaml"
TOOLS = ("docker", "kind", "helm", "kubectl")
RELEASE, OPERATOR_NAMESPACE, NAMESPACE = "pdserve", "pdserve-system", "pdserve-e2e"
TEST_IMAGE = "busybox:1.36"  # the chart's `helm test` image (test.image)


class Cluster:
    def __init__(self, name: str, kubeconfig: Path, image: str) -> None:
        self.name, self.image = name, image
        self.env = {**os.environ, "KUBECONFIG": str(kubeconfig)}

    def run(self, *args: str, timeout: float = 600, stdin: str | None = None, check: bool = True) -> str:
        result = subprocess.run(args, input=stdin, capture_output=True, text=True, timeout=timeout, env=self.env)
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(args)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
        return result.stdout

    def kubectl(self, *args: str, **kwargs) -> str:
        return self.run("kubectl", *args, **kwargs)

    def get_json(self, *args: str) -> dict:
        return json.loads(self.kubectl("get", "-o", "json", *args))

    def diagnostics(self) -> str:
        """What the cluster looked like, for a failure message."""
        parts = []
        for args in (
            ("get", "pdservices,pdpools,deployments,pods,services,jobs,pvc", "-A", "-o", "wide"),
            ("get", "events", "-A", "--sort-by=.lastTimestamp"),
            ("logs", "-n", OPERATOR_NAMESPACE, "-l", "app.kubernetes.io/component=operator", "--tail=200"),
            ("logs", "-n", NAMESPACE, "-l", "app.kubernetes.io/instance=demo", "--tail=50", "--prefix"),
        ):
            result = subprocess.run(("kubectl", *args), capture_output=True, text=True, timeout=60, env=self.env)
            parts.append(f"$ kubectl {' '.join(args)}\n{result.stdout}{result.stderr}")
        return "\n".join(parts)[-20000:]


def _prerequisites() -> str | None:
    if os.environ.get("PDSERVE_E2E") != "1":
        return "set PDSERVE_E2E=1 to run the kind end-to-end test (builds an image, creates a cluster: minutes)"
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return f"the kind end-to-end test needs {', '.join(missing)} on PATH"
    if subprocess.run(("docker", "info"), capture_output=True, timeout=60).returncode != 0:
        return "docker is installed but its daemon is not reachable"
    return None


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    reason = _prerequisites()
    if reason:
        pytest.skip(reason)
    name = os.environ.get("PDSERVE_E2E_CLUSTER", "pdserve-e2e")
    image = os.environ.get("PDSERVE_E2E_IMAGE", "")
    if not image:
        image = "pdserve:e2e-cpu"
        subprocess.run(
            (
                "docker",
                "build",
                "-t",
                image,
                "--build-arg",
                "BASE_IMAGE=python:3.11-slim",
                "--build-arg",
                "TORCH_INDEX=https://download.pytorch.org/whl/cpu",
                str(REPO),
            ),
            check=True,
            timeout=2400,
        )
    existing = subprocess.run(("kind", "get", "clusters"), capture_output=True, text=True, check=True).stdout.split()
    created = name not in existing
    if created:
        subprocess.run(("kind", "create", "cluster", "--name", name, "--wait", "180s"), check=True, timeout=600)
    kubeconfig = tmp_path_factory.mktemp("kind") / "kubeconfig"
    kubeconfig.write_text(
        subprocess.run(("kind", "get", "kubeconfig", "--name", name), capture_output=True, text=True, check=True).stdout
    )
    if subprocess.run(("docker", "image", "inspect", TEST_IMAGE), capture_output=True).returncode != 0:
        subprocess.run(("docker", "pull", TEST_IMAGE), check=True, timeout=600)
    for loaded in (image, TEST_IMAGE):
        subprocess.run(("kind", "load", "docker-image", loaded, "--name", name), check=True, timeout=900)
    repository, tag = image.rsplit(":", 1)
    cluster = Cluster(name, kubeconfig, image)
    try:
        cluster.run(
            "helm",
            "install",
            RELEASE,
            str(CHART),
            "--namespace",
            OPERATOR_NAMESPACE,
            "--create-namespace",
            "--set",
            f"image.repository={repository}",
            "--set",
            f"image.tag={tag}",
            "--set",
            "image.pullPolicy=Never",
            "--wait",
            "--timeout",
            "5m",
        )
        yield cluster
    finally:
        cluster.run(
            "kubectl", "delete", "namespace", NAMESPACE, "--ignore-not-found", "--wait", "--timeout=3m", check=False
        )
        cluster.run("helm", "uninstall", RELEASE, "--namespace", OPERATOR_NAMESPACE, "--wait", check=False)
        if created and os.environ.get("PDSERVE_E2E_KEEP") != "1":
            subprocess.run(("kind", "delete", "cluster", "--name", name), check=False, timeout=300)


def _http(url: str, body: dict | None = None, timeout: float = 60) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        assert response.status == 200
        return json.loads(response.read())


def _wait(predicate, timeout: float, what: str, interval: float = 3.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = predicate()
        except (AssertionError, OSError, urllib.error.URLError, json.JSONDecodeError):
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def _cpu_example(image: str) -> tuple[list[dict], dict]:
    """The CPU example's PVC and Job, and its PDService, with our image (already on the nodes)."""
    docs = [doc for doc in yaml.safe_load_all(CPU_EXAMPLE.read_text()) if doc]
    (service,) = [doc for doc in docs if doc["kind"] == "PDService"]
    service["spec"]["image"], service["spec"]["imagePullPolicy"] = image, "Never"
    setup = [doc for doc in docs if doc["kind"] != "PDService"]
    for doc in setup:
        for container in doc.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
            container["image"], container["imagePullPolicy"] = image, "Never"
    return setup, service


def test_helm_test_checks_operator_health(cluster: Cluster) -> None:
    try:
        cluster.run("helm", "test", RELEASE, "--namespace", OPERATOR_NAMESPACE, "--timeout", "3m")
    except AssertionError as error:
        raise AssertionError(f"{error}\n{cluster.diagnostics()}") from None


def test_pdservice_lifecycle(cluster: Cluster) -> None:
    try:
        _lifecycle(cluster)
    except AssertionError as error:
        raise AssertionError(f"{error}\n{cluster.diagnostics()}") from None


def _lifecycle(cluster: Cluster) -> None:
    setup, service = _cpu_example(cluster.image)
    name = service["metadata"]["name"]
    cluster.kubectl("create", "namespace", NAMESPACE)
    ns = ("--namespace", NAMESPACE)

    # The demo model onto the PVC, then the PDService.
    cluster.kubectl("apply", *ns, "-f", "-", stdin=yaml.safe_dump_all(setup))
    job = next(doc["metadata"]["name"] for doc in setup if doc["kind"] == "Job")
    cluster.kubectl("wait", *ns, "--for=condition=complete", f"job/{job}", "--timeout=10m", timeout=660)
    cluster.kubectl("apply", *ns, "-f", "-", stdin=yaml.safe_dump(service))
    cluster.kubectl("wait", *ns, "--for=condition=Ready", f"pdservice/{name}", "--timeout=10m", timeout=660)

    # One PDPool per engine pool, seeded from the PDService.
    pools = {pool["spec"]["role"]: pool for pool in cluster.get_json("pdpools", *ns)["items"]}
    assert set(pools) == {"prefill", "decode"}
    assert pools["decode"]["metadata"]["name"] == f"{name}-decode"
    assert pools["decode"]["spec"]["replicas"] == 1

    # Scale the decode pool alone; its Deployment follows, the prefill pool stays.
    cluster.kubectl("scale", *ns, f"pdpool/{name}-decode", "--replicas=2")
    cluster.kubectl(
        "wait", *ns, "--for=jsonpath={.status.readyReplicas}=2", f"pdpool/{name}-decode", "--timeout=5m", timeout=330
    )
    selector = f"app.kubernetes.io/instance={name},pdserve.io/role=decode"
    (deployment,) = cluster.get_json("deployments", *ns, "-l", selector)["items"]
    assert deployment["spec"]["replicas"] == 2 and deployment["status"].get("readyReplicas") == 2
    assert cluster.get_json(f"pdpool/{name}-prefill", *ns)["spec"]["replicas"] == 1

    # OpenAI requests through the router.
    router = cluster.get_json(f"service/{name}-router", *ns)
    (remote,) = [port["port"] for port in router["spec"]["ports"] if port["name"] == "http"]
    local = free_port()
    forward = subprocess.Popen(
        ("kubectl", "port-forward", *ns, f"service/{name}-router", f"{local}:{remote}"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=cluster.env,
    )
    try:
        base = f"http://127.0.0.1:{local}"
        models = _wait(lambda: _http(f"{base}/v1/models")["data"], 60, "the router's /v1/models")
        model = models[0]["id"]
        for index in range(4):  # a few, so both decode pods are likely to serve one
            completion = _wait(
                lambda i=index: _http(
                    f"{base}/v1/completions",
                    {"model": model, "prompt": f"Hello number {i}", "max_tokens": 8, "temperature": 0},
                ),
                120,
                "a completion through the router",
            )
            assert completion["choices"][0]["text"] and completion["usage"]["completion_tokens"] >= 1
        chat = _http(
            f"{base}/v1/chat/completions",
            {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8},
        )
        assert chat["choices"][0]["message"]["role"] == "assistant"
    finally:
        forward.terminate()
        forward.wait(timeout=10)

    # Deleting the PDService takes everything it owns with it (owner references).
    cluster.kubectl("delete", *ns, f"pdservice/{name}", "--wait", "--timeout=3m", timeout=200)
    owned = f"app.kubernetes.io/instance={name}"

    def gone() -> bool:
        left = cluster.get_json("deployments,services,pdpools,pods", *ns, "-l", owned)["items"]
        return not left

    _wait(gone, 180, f"the objects of PDService {name} to be garbage-collected")
