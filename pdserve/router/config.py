"""Router settings: the one place that names what the CLI can set for a router."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RouterConfig:
    """Pod lists (static, or found by Kubernetes discovery) and the router's bounds (seconds)."""

    prefill_urls: list[str]  # may be empty: every request then goes decode-only
    decode_urls: list[str]
    discovery: str = "static"  # static | kubernetes
    namespace: str | None = None  # kubernetes: where the pods are (default: the router's own namespace)
    selector: str = ""  # kubernetes: label selector of this service's pods
    api_key: str | None = None
    request_timeout: float = 600.0  # whole request, both legs and the streamed answer
    connect_timeout: float = 10.0
    health_interval: float = 2.0
