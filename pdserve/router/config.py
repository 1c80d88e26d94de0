"""Router settings: the one place that names what the CLI can set for a router."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RouterConfig:
    """Static pod lists and the router's bounds (seconds)."""

    prefill_urls: list[str]  # may be empty: every request then goes decode-only
    decode_urls: list[str]
    api_key: str | None = None
    request_timeout: float = 600.0  # whole request, both legs and the streamed answer
    connect_timeout: float = 10.0
    health_interval: float = 2.0
