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
from collections.abc import Mapping, Sequence
from typing import Any

from pdserve.operator.scrape import each_pod, totals

logger = logging.getLogger(__name__)

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
# Weights of the ranking: one held or pulled block outweighs any number of running requests (below
# a thousand), which outweigh any cache temperature.
TRANSFER_WEIGHT = 1_000_000
REQUEST_WEIGHT = 1_000
MAX_COST = 2**31 - 1  # the annotation is an int32


def deletion_cost(metrics: Mapping[str, float]) -> int:
    """How costly losing this engine is now (higher: kept longer)."""
    transfers = metrics.get("pdserve_kv_blocks_held_for_remote", 0.0)
    transfers += metrics.get("pdserve_num_requests_waiting_for_remote_kv", 0.0)
    requests = metrics.get("pdserve_num_requests_running", 0.0) + metrics.get("pdserve_num_requests_waiting", 0.0)
    warmth = metrics.get("pdserve_kv_cache_usage_ratio", 0.0) * (REQUEST_WEIGHT - 1)
    cost = TRANSFER_WEIGHT * transfers + REQUEST_WEIGHT * min(requests, TRANSFER_WEIGHT // REQUEST_WEIGHT - 1) + warmth
    return min(int(cost), MAX_COST)


def costs(pods: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """Pod name -> deletion cost, for the pods whose metrics could be read (scraped in parallel)."""

    def measure(name: str, url: str) -> int | None:
        try:
            return deletion_cost(totals(url))
        except (OSError, ValueError) as error:
            logger.info("no deletion cost for pod %s: %s", name, error)
            return None

    return each_pod(pods, measure)
