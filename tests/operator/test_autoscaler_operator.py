"""The autoscaler under kopf against the emulated API server, reading a synthetic router's /metrics
over real HTTP: load rising then falling scales both pools up and back down in bounded steps; a
kubectl scale is reverted with a ScaleOverridden event; an HPA on a pool sets ScalingConflict;
with autoscaling off nothing touches the replicas.

The emulator runs no controllers: a thread here plays the Deployment controller (each engine
Deployment's status follows its spec at once), and the router is a metrics endpoint whose counters
grow at the rate the test sets (the real router's series, docs/contracts.md)."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.operator.helpers import DEPLOYMENTS, PDPOOLS, PDSERVICES
from tests.operator.kmock_cluster import KubeCluster, wait_for
from tests.operator.test_autoscaler import ENGINE, OUTPUT, PROMPT, SLO_FIELDS
from tests.operator.test_operator import deploy
from tests.operator.test_scale_down import metrics_server

BUCKETS = (100.0, 800.0, 1200.0, 1e6)


class SyntheticRouter:
    """A router's metrics: requests arrive at `rate` per second, each PROMPT tokens in, OUTPUT out."""

    def __init__(self) -> None:
        self.rate = 0.0
        self.received = 0.0
        self.since = time.monotonic()
        self.lock = threading.Lock()

    def set_rate(self, rate: float) -> None:
        with self.lock:
            self._advance()
            self.rate = rate

    def _advance(self) -> None:
        now = time.monotonic()
        self.received += self.rate * (now - self.since)
        self.since = now

    def exposition(self) -> str:
        with self.lock:
            self._advance()
            received = self.received
        lines = [
            "# TYPE pdserve_router_requests_received_total counter",
            f"pdserve_router_requests_received_total {received}",
        ]
        for name, length in (("pdserve_request_prompt_tokens", PROMPT), ("pdserve_request_generation_tokens", OUTPUT)):
            lines.append(f"# TYPE {name} histogram")
            for bound in BUCKETS:
                lines.append(f'{name}_bucket{{le="{bound}"}} {received if length <= bound else 0.0}')
            lines += [
                f'{name}_bucket{{le="+Inf"}} {received}',
                f"{name}_count {received}",
                f"{name}_sum {received * length}",
            ]
        return "\n".join(lines) + "\n"


@contextlib.contextmanager
def deployment_controller(cluster: KubeCluster, namespace: str) -> Iterator[None]:
    """Each engine Deployment's status follows its spec (all pods of the template available)."""
    done = threading.Event()

    def follow() -> None:
        while not done.wait(0.1):
            for role in ("prefill", "decode"):
                deployment = cluster.get(DEPLOYMENTS, f"llm-{role}", namespace)
                if deployment is None:
                    continue
                size = deployment["spec"]["replicas"]
                counts = {"replicas": size, "updatedReplicas": size, "availableReplicas": size, "readyReplicas": size}
                counts["observedGeneration"] = deployment["metadata"].get("generation", 0)
                if any((deployment.get("status") or {}).get(key) != value for key, value in counts.items()):
                    cluster.patch(DEPLOYMENTS, f"llm-{role}", {"status": counts}, namespace, subresource="status")

    thread = threading.Thread(target=follow, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def router_pod(cluster: KubeCluster, namespace: str, port: int) -> None:
    labels = {"app.kubernetes.io/instance": "llm", "pdserve.io/role": "router"}
    container = {"name": "router", "image": "x", "ports": [{"name": "http", "containerPort": port}]}
    manifest = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "llm-router-0", "labels": labels}}
    cluster.create("v1/pods", {**manifest, "spec": {"containers": [container]}}, namespace)
    status = {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}
    cluster.patch("v1/pods", "llm-router-0", {"status": status}, namespace, subresource="status")


def profile_config_map(cluster: KubeCluster, namespace: str) -> None:
    data = {"profile.json": json.dumps(dataclasses.asdict(ENGINE))}
    cluster.create(
        "v1/configmaps",
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "profile"}, "data": data},
        namespace,
    )


@contextlib.contextmanager
def autoscaled(cluster: KubeCluster, namespace: str, rate: float, **autoscaling: Any) -> Iterator[SyntheticRouter]:
    """The PDService llm with AUTOSCALING (and `autoscaling` on top), its profile, a router pod whose
    metrics say `rate` requests a second, and the Deployment controller; yields the router."""
    router = SyntheticRouter()
    router.set_rate(rate)
    with metrics_server(router.exposition) as port, deployment_controller(cluster, namespace):
        router_pod(cluster, namespace, port)
        profile_config_map(cluster, namespace)
        deploy(cluster, namespace, autoscaling={**AUTOSCALING, **autoscaling})
        yield router


AUTOSCALING = {
    "enabled": True,
    "intervalSeconds": 1,
    "cooldownSeconds": 1,
    "scaleDownDecisions": 2,
    "maxStep": 1,
    "horizonSeconds": 10,
    "slo": SLO_FIELDS,
    "profile": {"configMap": "profile"},
    "prefill": {"maxReplicas": 6},
    "decode": {"maxReplicas": 8},
}


def pools(cluster: KubeCluster, namespace: str) -> tuple[int, int]:
    return tuple(cluster.get(PDPOOLS, f"llm-{role}", namespace)["spec"]["replicas"] for role in ("prefill", "decode"))


def autoscaling_status(cluster: KubeCluster, namespace: str) -> dict:
    return (cluster.get(PDSERVICES, "llm", namespace).get("status") or {}).get("autoscaling") or {}


def test_load_rising_then_falling_scales_both_pools_up_and_down(kube_cluster, kube_namespace, operator):
    with autoscaled(kube_cluster, kube_namespace, 15) as router:
        seen = [pools(kube_cluster, kube_namespace)]

        def reached(wanted: tuple[int, int]) -> bool:
            now = pools(kube_cluster, kube_namespace)
            if now != seen[-1]:
                seen.append(now)
            return now == wanted

        def steady_at_plan() -> dict | None:
            status = autoscaling_status(kube_cluster, kube_namespace)
            target = status.get("target") or {"prefill": 0, "decode": 0}
            at_target = reached((target["prefill"], target["decode"]))  # first: it records every size seen
            return status if at_target and status.get("reason") == "Steady" else None

        status = wait_for(steady_at_plan, timeout=90, what="the pools at the plan for 15 req/s")
        assert status["target"]["prefill"] + status["target"]["decode"] >= 4  # more than one step from 1P1D
        assert status["inputs"]["arrivalRate"] == pytest.approx(15, rel=0.3)
        assert status["predicted"]["ttft_p90_s"] <= SLO_FIELDS["ttftSeconds"]
        peak = (status["target"]["prefill"], status["target"]["decode"])
        router.set_rate(0)
        wait_for(lambda: reached((1, 1)), timeout=60, what="the minimum once traffic stopped")
        # Bounded steps: one replica per pool per decision, both pools written in the same decision.
        for before, after in itertools.pairwise(seen):
            assert all(abs(a - b) <= 1 for a, b in zip(before, after, strict=True)), seen
        assert seen[0] == (1, 1) and peak in seen
        reasons = {e["reason"] for e in kube_cluster.events(kube_namespace, "llm")}
        assert "Scaled" in reasons


def test_a_manual_scale_is_reverted_and_an_hpa_is_a_conflict(kube_cluster, kube_namespace, operator):
    with autoscaled(kube_cluster, kube_namespace, 0.5):
        wait_for(lambda: autoscaling_status(kube_cluster, kube_namespace).get("reason") == "Steady", timeout=30)
        kube_cluster.patch(PDPOOLS, "llm-decode", {"spec": {"replicas": 5}}, kube_namespace, subresource="scale")
        wait_for(
            lambda: "ScaleOverridden" in {e["reason"] for e in kube_cluster.events(kube_namespace, "llm")},
            timeout=20,
            what="a ScaleOverridden event",
        )
        wait_for(lambda: pools(kube_cluster, kube_namespace) == (1, 1), what="the autoscaler's size back")
        hpa = {
            "apiVersion": "autoscaling/v2",
            "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": "decode-cpu"},
            "spec": {
                "scaleTargetRef": {"apiVersion": "pdserve.io/v1alpha1", "kind": "PDPool", "name": "llm-decode"},
                "minReplicas": 1,
                "maxReplicas": 4,
            },
        }
        kube_cluster.create("autoscaling/v2/horizontalpodautoscalers", hpa, kube_namespace)

        def conflict() -> dict | None:
            conditions = (kube_cluster.get(PDSERVICES, "llm", kube_namespace).get("status") or {}).get("conditions")
            return next((c for c in conditions or [] if c["type"] == "ScalingConflict" and c["status"] == "True"), None)

        assert "decode-cpu" in wait_for(conflict, timeout=20, what="ScalingConflict=True")["message"]
        # Turned off: the last size stays, the pool is the user's again, the condition goes.
        kube_cluster.patch(PDSERVICES, "llm", {"spec": {"autoscaling": {"enabled": False}}}, kube_namespace)
        wait_for(
            lambda: (
                not conflict()
                and not any(
                    c["type"] == "ScalingConflict"
                    for c in (kube_cluster.get(PDSERVICES, "llm", kube_namespace)["status"].get("conditions") or [])
                )
            ),
            timeout=20,
            what="the condition gone",
        )
        kube_cluster.patch(PDPOOLS, "llm-decode", {"spec": {"replicas": 4}}, kube_namespace, subresource="scale")
        time.sleep(2.5)
        assert pools(kube_cluster, kube_namespace) == (1, 4)


def test_manual_mode_never_touches_replicas(kube_cluster, kube_namespace, operator):
    with autoscaled(kube_cluster, kube_namespace, 15, enabled=False):
        time.sleep(3)
        assert pools(kube_cluster, kube_namespace) == (1, 1)
        assert autoscaling_status(kube_cluster, kube_namespace) == {}
