"""Router settings: the one place that names what the CLI can set for a router, with the flags that set
them (``pdserve.api.flags``)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from pdserve.api.flags import add_flags, flag, flag_values
from pdserve.router.policies import ROUTING_POLICIES

DISCOVERIES = ("static", "kubernetes")


@dataclass
class RouterConfig:
    """Pod lists (static, or found by Kubernetes discovery), pod choice, and the router's bounds (seconds)."""

    prefill_urls: list[str]  # may be empty: every request then goes decode-only
    decode_urls: list[str]
    discovery: str = field(
        default="static",
        metadata=flag("static: the URLs given; kubernetes: watch the pods matching --selector", choices=DISCOVERIES),
    )
    namespace: str | None = field(
        default=None, metadata=flag("kubernetes discovery: namespace (default: the router's)")
    )
    selector: str = field(default="", metadata=flag("kubernetes discovery: label selector of the engine pods"))
    api_key: str | None = None
    # The deployment's key folder (pdserve/api/keys.py): router.key signs the P/D legs and release calls to
    # engines, events.key checks the engines' KV events. None: nothing is signed (loopback, or --kv-insecure).
    keys_dir: str | None = None
    request_timeout: float = 600.0  # whole request, both legs and the streamed answer
    connect_timeout: float = 10.0
    health_interval: float = 2.0
    # Pod choice (pdserve/router/policies.py).
    routing: str = field(
        default="prefix-load",
        metadata=flag(
            "pod choice: prefix policies match the prompt against the engines' KV-cache events (they need "
            "--tokenizer; without it, least-load)",
            choices=tuple(ROUTING_POLICIES),
        ),
    )
    tokenizer: str | None = field(
        default=None,
        metadata=flag("the served model's folder: prompts are tokenized and hashed as the engines do", metavar="PATH"),
    )
    prefix_weight: float = field(default=1.0, metadata=flag("prefix-load: score per cached leading prompt block"))
    load_weight: float = field(
        default=4.0, metadata=flag("prefix-load: score lost per request running or queued on the pod")
    )
    pd_min_prefill_tokens: int = field(
        default=256,
        metadata=flag("skip the prefill leg when the decode pod lacks fewer prompt tokens (0: never skip)"),
    )
    session_affinity: bool = field(
        default=False,
        metadata=flag("keep a session (X-Session-Id header, else the body's user) on one pod per role"),
    )
    failure_threshold: int = 3  # consecutive failed requests that take a pod out until its health probe passes
    # None: from the prompt's length and the pod's measured prefill speed (pdserve/router/prefill_leg.py).
    prefill_timeout: float | None = field(
        default=None,
        metadata=flag(
            "seconds a prefill leg may take before decode computes the prompt and the pod leaves rotation until "
            "its health check passes (default: 2 s + 4x what the pod's measured prefill speed says the prompt "
            "needs)"
        ),
    )

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        add_flags(parser, RouterConfig)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, api_key: str | None, keys_dir: str | None) -> RouterConfig:
        return cls(args.prefill, args.decode or [], api_key=api_key, keys_dir=keys_dir, **flag_values(args, cls))
