"""Router settings: the one place that names what the CLI can set for a router."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RouterConfig:
    """Pod lists (static, or found by Kubernetes discovery), pod choice, and the router's bounds (seconds)."""

    prefill_urls: list[str]  # may be empty: every request then goes decode-only
    decode_urls: list[str]
    discovery: str = "static"  # static | kubernetes
    namespace: str | None = None  # kubernetes: where the pods are (default: the router's own namespace)
    selector: str = ""  # kubernetes: label selector of this service's pods
    api_key: str | None = None
    # The deployment's key folder (pdserve/api/keys.py): router.key signs the P/D legs and release calls to
    # engines, events.key checks the engines' KV events. None: nothing is signed (loopback, or --kv-insecure).
    keys_dir: str | None = None
    request_timeout: float = 600.0  # whole request, both legs and the streamed answer
    connect_timeout: float = 10.0
    health_interval: float = 2.0
    # Pod choice (pdserve/router/policy.py).
    routing: str = "prefix-load"  # round-robin | least-load | prefix | prefix-load
    tokenizer: str | None = None  # model folder: prompts are tokenized and hashed as the engines do
    prefix_weight: float = 1.0  # prefix-load: score per cached leading block
    load_weight: float = 4.0  # prefix-load: score lost per request queued or running on the pod
    pd_min_prefill_tokens: int = 256  # fewer uncached prompt tokens on the decode pod: skip the prefill leg (0: never)
    session_affinity: bool = False  # X-Session-Id header (else body "user") sticks to a pod per role
    failure_threshold: int = 3  # consecutive failed requests that take a pod out until its health probe passes
    # Seconds a prefill leg may take before decode computes the prompt instead and the prefill pod
    # leaves rotation until its health probe passes; None: from the prompt's length and the pod's
    # measured prefill speed (pdserve/router/proxy.py prefill_timeout).
    prefill_timeout: float | None = None
