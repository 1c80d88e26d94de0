"""Reading pods' Prometheus metrics from the operator: where a pod serves (its `http` port) and
what its /metrics says, each sample with its labels. Used to rank pods before a scale-down and
to read the routers' traffic for the autoscaler."""

import urllib.request
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from prometheus_client.parser import text_string_to_metric_families

SCRAPE_TIMEOUT_S = 2.0

Sample = tuple[str, dict[str, str], float]  # (name, labels, value)
T = TypeVar("T")


def samples(url: str) -> list[Sample]:
    """Every sample of the metrics at `url` (a pod's base URL; its /metrics is read)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=SCRAPE_TIMEOUT_S) as response:
        text = response.read().decode()
    return [
        (sample.name, dict(sample.labels), sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    ]


def totals(url: str) -> dict[str, float]:
    """The metrics at `url`, summed over label sets, by sample name."""
    values: dict[str, float] = {}
    for name, _, value in samples(url):
        values[name] = values.get(name, 0.0) + value
    return values


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


def each_pod(pods: Sequence[Mapping[str, Any]], read: Callable[[str, str], T | None]) -> dict[str, T]:
    """`read(pod name, url)` for every pod that serves, in parallel; pod name -> what it returned
    (a None, for a pod that could not be read, is left out)."""
    urls = {pod["metadata"]["name"]: pod_url(pod) for pod in pods}
    reachable = [(name, url) for name, url in urls.items() if url is not None]
    if not reachable:
        return {}
    with ThreadPoolExecutor(max_workers=min(16, len(reachable))) as pool:
        found = dict(zip([name for name, _ in reachable], pool.map(lambda item: read(*item), reachable), strict=True))
    return {name: value for name, value in found.items() if value is not None}
