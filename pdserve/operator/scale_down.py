"""Which engine pods a scale-down removes: the operator ranks a pool's pods before lowering its size.

The ReplicaSet controller picks the pods to delete; from Kubernetes 1.22 it deletes those with the
lowest `controller.kubernetes.io/pod-deletion-cost` first. Before lowering a pool's replicas the
operator reads each Ready pod's engine metrics and writes that annotation, so that the pods that
go are the cheapest to lose: first those holding no KV blocks for decode peers and pulling none,
then those running and queueing the fewest requests, then those with the coldest KV cache.
Whichever pod goes drains on SIGTERM (running streams finish, held blocks are served).
A pod whose metrics cannot be read gets no new annotation (what it had stays).
"""

import logging
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger(__name__)

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
SCRAPE_TIMEOUT_S = 2.0
# Weights of the ranking: one held or pulled block outweighs any number of running requests (below
# a thousand), which outweigh any cache temperature.
TRANSFER_WEIGHT = 1_000_000
REQUEST_WEIGHT = 1_000
MAX_COST = 2**31 - 1  # the annotation is an int32


def scrape(url: str) -> dict[str, float]:
    """The engine's metrics at `url` (its /metrics), summed over label sets, by sample name."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=SCRAPE_TIMEOUT_S) as response:
        text = response.read().decode()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def deletion_cost(metrics: Mapping[str, float]) -> int:
    """How costly losing this engine is now (higher: kept longer)."""
    transfers = metrics.get("pdserve_kv_blocks_held_for_remote", 0.0)
    transfers += metrics.get("pdserve_num_requests_waiting_for_remote_kv", 0.0)
    requests = metrics.get("pdserve_num_requests_running", 0.0) + metrics.get("pdserve_num_requests_waiting", 0.0)
    warmth = metrics.get("pdserve_kv_cache_usage_ratio", 0.0) * (REQUEST_WEIGHT - 1)
    cost = TRANSFER_WEIGHT * transfers + REQUEST_WEIGHT * min(requests, TRANSFER_WEIGHT // REQUEST_WEIGHT - 1) + warmth
    return min(int(cost), MAX_COST)


def pod_url(pod: Mapping[str, Any]) -> str | None:
    """http://IP:PORT of a Ready pod's `http` container port; None for a pod that serves nothing."""
    status = pod.get("status") or {}
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    if not ready or not status.get("podIP") or (pod.get("metadata") or {}).get("deletionTimestamp"):
        return None
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == "http":
                host = f"[{status['podIP']}]" if ":" in status["podIP"] else status["podIP"]
                return f"http://{host}:{port['containerPort']}"
    return None


def costs(pods: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """Pod name -> deletion cost, for the pods whose metrics could be read (scraped in parallel)."""
    urls = {pod["metadata"]["name"]: pod_url(pod) for pod in pods}
    reachable = {name: url for name, url in urls.items() if url is not None}
    if not reachable:
        return {}

    def measure(item: tuple[str, str]) -> tuple[str, int | None]:
        name, url = item
        try:
            return name, deletion_cost(scrape(url))
        except (OSError, ValueError) as error:
            logger.info("no deletion cost for pod %s: %s", name, error)
            return name, None

    with ThreadPoolExecutor(max_workers=min(16, len(reachable))) as pool:
        found = dict(pool.map(measure, reachable.items()))
    return {name: cost for name, cost in found.items() if cost is not None}
