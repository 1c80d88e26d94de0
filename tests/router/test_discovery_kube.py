"""The router's Kubernetes discovery against the API emulator (kmock over real HTTP, see
tests/operator/kmock_cluster.py): pods appear, become ready, stop being ready and vanish, and the
router's pod sets follow without a restart."""

from __future__ import annotations

from pdserve.router import RouterConfig, start_router
from tests.operator.kmock_cluster import kube_cluster, kube_namespace, wait_for
from tests.router.helpers import LoopThread

__all__ = ["kube_cluster", "kube_namespace"]  # fixtures

PODS = "v1/pods"


def _pod(name: str, role: str, instance: str = "llm") -> dict:
    port = {"prefill": 8100, "decode": 8200}[role]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/instance": instance, "pdserve.io/role": role}},
        "spec": {
            "containers": [{"name": "engine", "image": "pdserve", "ports": [{"name": "http", "containerPort": port}]}]
        },
    }


def _ready(ip: str, ready: bool = True) -> dict:
    return {
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        }
    }


def test_pods_joining_and_leaving_follow_the_cluster(kube_cluster, kube_namespace):
    loop = LoopThread()
    running = loop.run(
        start_router(
            RouterConfig(
                [],
                [],
                discovery="kubernetes",
                namespace=kube_namespace,
                selector="app.kubernetes.io/instance=llm",
                health_interval=60,
            )
        )
    )
    router = running.router
    try:

        def urls() -> tuple[list[str], list[str]]:
            return sorted(p.url for p in router.prefill.pods), sorted(p.url for p in router.decode.pods)

        kube_cluster.create(PODS, _pod("p0", "prefill"), kube_namespace)
        kube_cluster.create(PODS, _pod("d0", "decode"), kube_namespace)
        kube_cluster.create(PODS, _pod("other", "decode", instance="another-service"), kube_namespace)
        kube_cluster.patch(PODS, "other", _ready("10.0.0.99"), kube_namespace, subresource="status")
        kube_cluster.patch(PODS, "p0", _ready("10.0.0.1"), kube_namespace, subresource="status")
        kube_cluster.patch(PODS, "d0", _ready("10.0.0.2"), kube_namespace, subresource="status")
        # Exactly these: the not-yet-ready d1 and the other service's ready pod stay out.
        wait_for(lambda: urls() == (["http://10.0.0.1:8100"], ["http://10.0.0.2:8200"]))
        kube_cluster.create(PODS, _pod("d1", "decode"), kube_namespace)
        kube_cluster.patch(PODS, "d1", _ready("10.0.0.3"), kube_namespace, subresource="status")
        wait_for(lambda: urls()[1] == ["http://10.0.0.2:8200", "http://10.0.0.3:8200"])
        kube_cluster.patch(PODS, "d0", _ready("10.0.0.2", ready=False), kube_namespace, subresource="status")
        wait_for(lambda: urls()[1] == ["http://10.0.0.3:8200"])
        kube_cluster.delete(PODS, "p0", kube_namespace)
        wait_for(lambda: urls() == ([], ["http://10.0.0.3:8200"]))
    finally:
        loop.run(running.close())
        loop.close()
