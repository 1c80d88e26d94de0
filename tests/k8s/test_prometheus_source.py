"""The autoscaler's Prometheus source against a real Prometheus (Debian's, installed by `make test-k8s`):
it scrapes a router's series (a synthetic router's /metrics on 127.0.0.1, labelled as a Kubernetes
scrape labels a pod), and the window the autoscaler reads from it has the router's rate and lengths."""

from __future__ import annotations

import shutil
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from pdserve.launcher import free_port
from pdserve.operator.load import PrometheusQuery, default_selector
from tests.k8s.conftest import wait_for
from tests.operator.test_autoscaler import OUTPUT, PROMPT
from tests.operator.test_autoscaler_operator import SyntheticRouter
from tests.operator.test_scale_down import metrics_server

pytestmark = pytest.mark.k8s

CONFIG = """\
global:
  scrape_interval: 1s
scrape_configs:
  - job_name: routers
    static_configs:
      - targets: ["127.0.0.1:{router}"]
        labels: {{namespace: "ml", pod: "llm-router-7d9f-abcde"}}
      - targets: ["127.0.0.1:{other}"]
        labels: {{namespace: "ml", pod: "other-router-0"}}
"""


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def test_a_window_from_prometheus_has_the_routers_rate_and_lengths(tmp_path: Path) -> None:
    binary = shutil.which("prometheus")
    assert binary, "Prometheus is installed by `tests/k8s/control_plane.sh install` (make test-k8s)"
    router, other = SyntheticRouter(), SyntheticRouter()
    router.set_rate(12)
    other.set_rate(100)  # another PDService's router: the selector leaves it out
    port = free_port()
    with metrics_server(router.exposition) as router_port, metrics_server(other.exposition) as other_port:
        (tmp_path / "prometheus.yml").write_text(CONFIG.format(router=router_port, other=other_port))
        process = subprocess.Popen(
            [
                binary,
                f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=(tmp_path / "prometheus.log").open("w"),
        )
        try:
            url = f"http://127.0.0.1:{port}"
            wait_for(lambda: _ready(url), timeout=60, what="Prometheus ready")
            source = PrometheusQuery(url, default_selector("ml", "llm"))
            # Until the 10-s range is full of samples: increase() extrapolates a range only partly covered
            # by only half a scrape interval, so a young series reads low.
            full = f"count_over_time(pdserve_router_requests_received_total{source.selector}[10s]) >= 10"
            wait_for(lambda: source._query(full), timeout=60, interval=0.5, what="10 s of samples")
            window = source.window(10)
            assert window.rate == pytest.approx(12, rel=0.25)
            # Every request in the bucket holding its length (a length is known to its bucket only).
            assert window.prompt.total == pytest.approx(window.arrivals) and 800 < window.prompt.mean() <= 1200
            assert window.generation.total == pytest.approx(window.arrivals) and 0 < window.generation.mean() <= 100
            assert 800 < PROMPT <= 1200 and 0 < OUTPUT <= 100
            assert window.ttft.total == 0  # this router measured no latency: nothing to correct with
            # A selector Prometheus cannot parse: a clear error, which the autoscaler reports in its status.
            with pytest.raises(urllib.error.HTTPError):
                PrometheusQuery(url, "{namespace=").window(10)
        finally:
            process.terminate()
            process.wait(30)
