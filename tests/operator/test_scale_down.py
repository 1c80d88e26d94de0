"""Which pods a scale-down removes: deletion costs from real HTTP metrics endpoints, and the operator
writing them on the pool's pods (emulated API) before it lowers the Deployment."""

import contextlib
import http.server
import threading
from collections.abc import Callable, Iterator

from pdserve.operator.scale_down import DELETION_COST, costs, deletion_cost
from pdserve.operator.scrape import pod_url
from tests.operator.helpers import DEPLOYMENTS, PDPOOLS
from tests.operator.kmock_cluster import wait_for
from tests.operator.test_operator import deploy, replicas

IDLE = {"pdserve_num_requests_running": 0.0, "pdserve_kv_cache_usage_ratio": 0.0}


def test_transfers_outweigh_requests_which_outweigh_cache_warmth():
    cold_idle = deletion_cost(IDLE)
    warm_idle = deletion_cost({**IDLE, "pdserve_kv_cache_usage_ratio": 0.9})
    busy = deletion_cost({"pdserve_num_requests_running": 3, "pdserve_num_requests_waiting": 2})
    very_busy = deletion_cost({"pdserve_num_requests_running": 500, "pdserve_kv_cache_usage_ratio": 1.0})
    holding = deletion_cost({"pdserve_kv_blocks_held_for_remote": 1})
    pulling = deletion_cost({"pdserve_num_requests_waiting_for_remote_kv": 1})
    assert cold_idle < warm_idle < busy < very_busy < holding
    assert pulling == holding
    assert deletion_cost({"pdserve_kv_blocks_held_for_remote": 10**9}) == 2**31 - 1  # an int32


def pod(name: str, ip: str | None, port: int, ready: bool = True) -> dict:
    status = {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
    ports = [{"name": "kv-side", "containerPort": 1}, {"name": "http", "containerPort": port}]
    return {"metadata": {"name": name}, "spec": {"containers": [{"ports": ports}]}, "status": status}


def test_only_ready_pods_with_an_ip_are_asked():
    assert pod_url(pod("a", "10.0.0.7", 8200)) == "http://10.0.0.7:8200"
    assert pod_url(pod("a", "fd00::7", 8200)) == "http://[fd00::7]:8200"
    assert pod_url(pod("a", None, 8200)) is None
    assert pod_url(pod("a", "10.0.0.7", 8200, ready=False)) is None
    going = pod("a", "10.0.0.7", 8200)
    going["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert pod_url(going) is None


@contextlib.contextmanager
def metrics_server(text: str | Callable[[], str]) -> Iterator[int]:
    """A /metrics endpoint on 127.0.0.1 answering `text` (an engine's exposition, in miniature), or
    what `text()` returns at each scrape; yields its port."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = (text if isinstance(text, str) else text()).encode()
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def exposition(running: int, usage: float, held: int = 0) -> str:
    return (
        "# TYPE pdserve_num_requests_running gauge\n"
        f'pdserve_num_requests_running{{model_name="demo"}} {running}\n'
        "# TYPE pdserve_kv_cache_usage_ratio gauge\n"
        f'pdserve_kv_cache_usage_ratio{{model_name="demo"}} {usage}\n'
        "# TYPE pdserve_kv_blocks_held_for_remote gauge\n"
        f"pdserve_kv_blocks_held_for_remote {held}\n"
    )


def test_costs_read_each_pods_metrics_and_skip_the_unreachable():
    with metrics_server(exposition(2, 0.5)) as busy, metrics_server(exposition(0, 0.1, held=4)) as holding:
        pods = [
            pod("busy", "127.0.0.1", busy),
            pod("holding", "127.0.0.1", holding),
            pod("gone", "127.0.0.1", 1),  # nothing listens: no annotation
            pod("unready", "127.0.0.1", busy, ready=False),
        ]
        found = costs(pods)
    assert set(found) == {"busy", "holding"}
    assert found["busy"] == 2 * 1000 + int(0.5 * 999)
    assert found["holding"] > found["busy"]


def test_the_operator_ranks_a_pools_pods_before_lowering_it(kube_cluster, kube_namespace, operator):
    deploy(kube_cluster, kube_namespace, decode={"replicas": 2})
    with metrics_server(exposition(3, 0.2)) as busy, metrics_server(exposition(0, 0.0)) as idle:
        for name, port in (("decode-busy", busy), ("decode-idle", idle)):
            labels = {"app.kubernetes.io/instance": "llm", "pdserve.io/role": "decode"}
            container = {"name": "decode", "image": "x", "ports": [{"name": "http", "containerPort": port}]}
            manifest = {"metadata": {"name": name, "labels": labels}, "spec": {"containers": [container]}}
            kube_cluster.create("v1/pods", {"apiVersion": "v1", "kind": "Pod", **manifest}, kube_namespace)
            status = {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}
            kube_cluster.patch("v1/pods", name, {"status": status}, kube_namespace, subresource="status")
        kube_cluster.patch(PDPOOLS, "llm-decode", {"spec": {"replicas": 1}}, kube_namespace, subresource="scale")
        wait_for(lambda: replicas(kube_cluster, kube_namespace, "decode") == 1)

    def cost(name: str) -> int:
        return int(kube_cluster.get("v1/pods", name, kube_namespace)["metadata"]["annotations"][DELETION_COST])

    # Written before the Deployment was lowered; the idle pod is the one to go.
    assert cost("decode-idle") < cost("decode-busy") == 3000 + int(0.2 * 999)
    assert kube_cluster.get(DEPLOYMENTS, "llm-decode", kube_namespace)["spec"]["replicas"] == 1
