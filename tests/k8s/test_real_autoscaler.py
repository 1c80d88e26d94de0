"""The autoscaler against a real kube-apiserver and controllers, with real engines and a real router
serving traffic: the operator (under its ServiceAccount) reads the router pod's /metrics, scales the
decode pool up while requests flow and back down once they stop, and puts back a `kubectl scale`.

The profile is synthetic and says one decode engine cannot meet the TPOT target at any load, so the
plan under traffic is the pool's maximum and without traffic its minimum: what is tested here is the
loop through the real API (metrics, decisions, PDPool writes, Deployments rolling out, events), not
the planner's figures (tests/operator and bench/planner_accuracy.py cover those)."""

from __future__ import annotations

import dataclasses
import json
import re
import threading
import urllib.error
from pathlib import Path
from typing import Any

import pytest

from pdserve.planner.profile import EngineShape, Profile, StepTimeModel, TransferModel
from tests.k8s.conftest import NAMESPACE, SKIPPED, Cluster, wait_for
from tests.k8s.fake_kubelet import FakeKubelet
from tests.k8s.test_real_cluster import GROUP, VERSION, PodProcesses, _cpu_example, completion, get, running_pods

pytestmark = pytest.mark.k8s

# A decode step of 0.2 s at any batch: never within the 0.05 s TPOT target below.
SLOW = Profile(
    "demo",
    "synthetic",
    EngineShape(
        num_blocks=512,
        block_size=16,
        max_model_len=512,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        kv_bytes_per_token=1024,
    ),
    StepTimeModel([0.2, 0.0, 0.0, 0.0]),
    TransferModel(0.001, 1e9),
    gpus_per_pod=0,
)
NAME = "auto"  # not the lifecycle test's name: its objects may still be being collected
AUTOSCALING = {
    "enabled": True,
    "intervalSeconds": 2,
    "cooldownSeconds": 2,
    "scaleDownDecisions": 1,
    "maxStep": 1,
    "horizonSeconds": 10,
    "slo": {"ttftSeconds": 5, "tpotSeconds": 0.05, "attainment": 0.9},
    "profile": {"configMap": "auto-profile"},
    "prefill": {"minReplicas": 1, "maxReplicas": 1},
    "decode": {"minReplicas": 1, "maxReplicas": 2},
}


class Traffic:
    """Completions through the router, one after another, until stopped."""

    def __init__(self, url: str, model: str) -> None:
        self.url, self.model = url, model
        self.stopped = threading.Event()
        self.answered = 0
        self.thread = threading.Thread(target=self._send, daemon=True)
        self.thread.start()

    def _send(self) -> None:
        while not self.stopped.is_set():
            try:
                completion(self.url, self.model, headers={"Content-Type": "application/json"})
                self.answered += 1
            except (OSError, urllib.error.HTTPError):
                self.stopped.wait(0.2)  # a pod going or coming: the router tells the client

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(60)


def pool_size(cluster: Cluster, role: str) -> int:
    return get(cluster, "pdpools", f"{NAME}-{role}")["spec"]["replicas"]


def scaled_rate(cluster: Cluster, name: str) -> float:
    """The arrival rate in the PDService's Scaled event to 1P2D (0 while there is none)."""
    events = cluster.core.list_namespaced_event(NAMESPACE, field_selector=f"involvedObject.name={name}").items
    for event in events:
        found = re.search(r"-> 1P2D \(plan 1P2D at (\S+) req/s\)", event.message or "")
        if event.reason == "Scaled" and found:
            return float(found.group(1))
    return 0.0


def test_the_autoscaler_follows_traffic_on_a_real_cluster(
    cluster: Cluster, kubelet: FakeKubelet, operator: Any, tmp_path: Path
) -> None:
    name = NAME
    profile = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "auto-profile"}}
    cluster.create({**profile, "data": {"profile.json": json.dumps(dataclasses.asdict(SLOW))}}, namespace=NAMESPACE)
    service = _cpu_example(name)
    service["spec"]["autoscaling"] = AUTOSCALING
    cluster.create(service, namespace=NAMESPACE)
    processes = PodProcesses(cluster, kubelet, tmp_path, name)
    traffic = None
    try:
        processes.start_healthy([*running_pods(cluster, name, "prefill", 1), *running_pods(cluster, name, "decode", 1)])
        (router,) = processes.start_healthy(running_pods(cluster, name, "router", 1))
        traffic = Traffic(router.url, name)
        wait_for(lambda: traffic.answered, timeout=60, what="a completion through the router")

        # Under traffic the plan is the most decode engines allowed: the operator writes the pool, then
        # the decision into the status (the pool first: read both, not one then the other) ...
        def scaled_up() -> bool:
            status = (get(cluster, "pdservices", name).get("status") or {}).get("autoscaling") or {}
            return pool_size(cluster, "decode") == 2 and status.get("replicas") == {"prefill": 1, "decode": 2}

        wait_for(scaled_up, timeout=60, what="the decode pool scaled up")
        assert get(cluster, "pdservices", name)["status"]["autoscaling"]["lastScaleTime"] is not None
        # ... with a Scaled event that gives the plan and the arrival rate it saw (by now the status may
        # show a later decision, RolloutInProgress or Cooldown; the event keeps this one).
        wait_for(lambda: scaled_rate(cluster, name) > 0, timeout=30, what="a Scaled event with the arrival rate")
        # ... the real controllers make the pod, and the new engine serves.
        processes.start_healthy(running_pods(cluster, name, "decode", 2))

        # kubectl scale while the autoscaler owns the pool: put back, with a Warning event.
        cluster.custom.patch_namespaced_custom_object_scale(
            GROUP, VERSION, NAMESPACE, "pdpools", f"{name}-decode", {"spec": {"replicas": 3}}
        )

        def overridden() -> bool:
            events = cluster.core.list_namespaced_event(NAMESPACE, field_selector=f"involvedObject.name={name}").items
            return any(event.reason == "ScaleOverridden" for event in events) and pool_size(cluster, "decode") == 2

        wait_for(overridden, timeout=30, what="the manual scale reverted with a ScaleOverridden event")
        processes.start_healthy(running_pods(cluster, name, "decode", 2))

        # Traffic stops: the next decisions plan for none, and the pool goes back to its minimum.
        traffic.stop()
        wait_for(lambda: pool_size(cluster, "decode") == 1, timeout=60, what="the decode pool scaled down")
        running_pods(cluster, name, "decode", 1)
        assert pool_size(cluster, "prefill") == 1

        # An HPA on a pool would fight the autoscaler: reported where autoscaling/v2 is served.
        if cluster.resource("autoscaling/v2", "HorizontalPodAutoscaler") is None:
            SKIPPED.append(("autoscaler", "autoscaling/v2", "HorizontalPodAutoscaler", "ScalingConflict check"))
    finally:
        if traffic is not None:
            traffic.stop()
        processes.stop_all()
        cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, NAMESPACE, "pdservices", name)
        cluster.core.delete_namespaced_config_map("auto-profile", NAMESPACE)
