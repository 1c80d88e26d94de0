"""Kubernetes discovery: which pods become router endpoints (unit tests on the client's own pod
objects); the watch against the kmock emulator is tested in tests/operator."""

from __future__ import annotations

from datetime import UTC, datetime

from kubernetes.client import (
    V1Container,
    V1ContainerPort,
    V1ObjectMeta,
    V1Pod,
    V1PodCondition,
    V1PodSpec,
    V1PodStatus,
)

from pdserve.router.discovery import pod_endpoint
from pdserve.router.pods import PodSet


def _pod(
    role: str | None = "decode",
    ready: bool = True,
    ip: str | None = "10.0.0.7",
    phase: str = "Running",
    deleting: bool = False,
    port: int | None = 8200,
) -> V1Pod:
    labels = {"app.kubernetes.io/instance": "demo"} | ({"pdserve.io/role": role} if role else {})
    ports = [V1ContainerPort(name="http", container_port=port)] if port else None
    return V1Pod(
        metadata=V1ObjectMeta(
            name="p", uid="u1", labels=labels, deletion_timestamp=datetime.now(UTC) if deleting else None
        ),
        spec=V1PodSpec(containers=[V1Container(name="engine", ports=ports)]),
        status=V1PodStatus(
            phase=phase, pod_ip=ip, conditions=[V1PodCondition(type="Ready", status="True" if ready else "False")]
        ),
    )


def test_a_ready_engine_pod_is_an_endpoint_on_its_http_port():
    assert pod_endpoint(_pod()) == ("decode", "http://10.0.0.7:8200")
    assert pod_endpoint(_pod("prefill", port=9000)) == ("prefill", "http://10.0.0.7:9000")
    assert pod_endpoint(_pod("prefill", port=None)) == ("prefill", "http://10.0.0.7:8100")  # the role's default
    assert pod_endpoint(_pod(ip="fd00::5")) == ("decode", "http://[fd00::5]:8200")


def test_pods_that_cannot_take_requests_are_not_endpoints():
    for pod in (
        _pod(ready=False),
        _pod(ip=None),
        _pod(phase="Pending"),
        _pod(deleting=True),
        _pod(role=None),
        _pod(role="router"),
    ):
        assert pod_endpoint(pod) is None


def test_a_new_pod_list_keeps_the_load_and_health_of_pods_that_stay():
    pods = PodSet("decode", ["http://a:1", "http://b:1"])
    pods.pods[0].in_flight, pods.pods[1].healthy = 3, False
    pods.set_urls(["http://b:1", "http://c:1"])
    assert [(p.url, p.in_flight, p.healthy) for p in pods.pods] == [("http://b:1", 0, False), ("http://c:1", 0, True)]
