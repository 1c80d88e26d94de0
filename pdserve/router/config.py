"""Router settings: the one place that names what the CLI can set for a router, with the flags that set
them (``pdserve.api.flags``), and the reading of the per-medium weights ``--tier-weights`` gives."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from pdserve.api.flags import add_flags, flag, flag_values
from pdserve.api.kv_events import MEDIA
from pdserve.router.policies import ROUTING_POLICIES

DISCOVERIES = ("static", "kubernetes")
# What a matched prompt block is worth by the fastest medium holding it (llm-d's per-tier scorer weights): a block
# in the engine's pool costs nothing to use, one in a tier must be loaded first, the slower the tier the longer.
DEFAULT_TIER_WEIGHTS = "engine=1,host=0.8,disk=0.5,shared=0.4"


def parse_tier_weights(text: str) -> dict[str, float]:
    """Per-medium weights (every medium of ``MEDIA``) from ``--tier-weights`` text, ``medium=weight`` pairs
    separated by commas; a medium the text leaves out keeps its default. ValueError, saying why, for an unknown
    medium, one given twice, a weight that is not a number in [0, 1], or a tier weighing more than the engine's
    pool (a block a tier must load first cannot be worth more than one already in the pool)."""
    weights = _pairs(DEFAULT_TIER_WEIGHTS)
    weights.update(_pairs(text))
    if weights["engine"] <= 0:
        raise ValueError("--tier-weights: engine must weigh more than 0 (its blocks are what prefix scores count)")
    heavier = [medium for medium in MEDIA[1:] if weights[medium] > weights["engine"]]
    if heavier:
        raise ValueError(
            f"--tier-weights: engine must weigh the most, got {', '.join(heavier)} above engine={weights['engine']}"
        )
    return weights


def _pairs(text: str) -> dict[str, float]:
    weights: dict[str, float] = {}
    for pair in text.split(","):
        medium, equals, number = (part.strip() for part in pair.partition("="))
        if not equals:
            raise ValueError(f"--tier-weights: {pair.strip()!r} is not medium=weight (e.g. {DEFAULT_TIER_WEIGHTS})")
        if medium not in MEDIA:
            raise ValueError(f"--tier-weights: unknown medium {medium!r} (media: {', '.join(MEDIA)})")
        if medium in weights:
            raise ValueError(f"--tier-weights: {medium} is given twice")
        try:
            weight = float(number)
        except ValueError:
            raise ValueError(f"--tier-weights: {medium}'s weight {number!r} is not a number") from None
        if not 0.0 <= weight <= 1.0:  # NaN fails this too
            raise ValueError(f"--tier-weights: {medium}'s weight must be in [0, 1], got {number}")
        weights[medium] = weight
    return weights


def _checked_tier_weights(text: str) -> str:
    """The flag's text, once it reads as weights; else the reason, which argparse prints after the flag's name."""
    try:
        parse_tier_weights(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error).removeprefix("--tier-weights: ")) from None
    return text


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
    inference_pool: str | None = field(
        default=None,
        metadata=flag(
            "kubernetes discovery: the InferencePool (Gateway API Inference Extension) whose selector says which "
            "decode pods may take requests (the endpoint picker's pool)"
        ),
    )
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
    tier_weights: str = field(
        default=DEFAULT_TIER_WEIGHTS,
        metadata=flag(
            "prefix policies: what a matched block is worth by the fastest medium holding it (engine: the pool; "
            "host, disk, shared: its KV tiers), in [0, 1], engine the most; media left out keep their default "
            f"({DEFAULT_TIER_WEIGHTS})",
            parse=_checked_tier_weights,
            metavar="MEDIUM=W,...",
        ),
    )
    medium_weights: dict[str, float] = field(init=False, repr=False)  # tier_weights read: medium -> weight
    pd_min_prefill_tokens: int = field(
        default=256,
        metadata=flag("skip the prefill leg when the decode pod lacks fewer prompt tokens (0: never skip)"),
    )
    session_affinity: bool = field(
        default=False,
        metadata=flag("keep a session (X-Session-Id header, else the body's user) on one pod per role"),
    )
    failure_threshold: int = 3  # consecutive failed requests that take a pod out until its health probe passes
    migration_limit: int = field(
        default=3,
        metadata=flag(
            "times a stream that breaks after it started is continued on another decode pod, with the tokens the "
            "client has (0: the client's connection is ended, as a cut answer)"
        ),
    )
    token_deadline: float = field(
        default=60.0,
        metadata=flag(
            "seconds a started stream may go without an event before it counts as stalled and is continued "
            "elsewhere (0: no deadline); generous, since a busy CPU engine or a long preemption may pause a stream"
        ),
    )
    # Flow control (pdserve/router/admission.py) and tenants (pdserve/router/tenants.py).
    tenants: str | None = field(
        default=None,
        metadata=flag(
            "the tenant table (JSON or YAML): API keys, weights, priority ranges, per-minute limits, queue bounds",
            metavar="PATH",
        ),
    )
    tenant_header: str | None = field(
        default=None,
        metadata=flag(
            "take the tenant from this header, which a gateway in front sets and strips from clients' requests "
            "(never set it on a router clients reach directly)",
            metavar="NAME",
        ),
    )
    priority_range: str = field(
        default="-10:10",
        metadata=flag(
            "without a tenant table: the priorities requests may ask for (clamped into it)", metavar="MIN:MAX"
        ),
    )
    flow_control: bool = field(
        default=True,
        metadata=flag("queue requests while the pods' signals say the fleet is saturated (else send at once)"),
    )
    saturation_queue: int = field(
        default=5, metadata=flag("a pod with this many requests waiting is saturated (flow control)")
    )
    saturation_kv: float = field(
        default=0.9, metadata=flag("a pod whose KV cache is this full (0..1) is saturated (flow control)")
    )
    max_queued: int = field(default=1024, metadata=flag("requests waiting per priority band before 429s"))
    max_ahead: int = field(
        default=4,
        metadata=flag(
            "requests per priority band in flight sent ahead of the band's others, at once, because their tenant "
            "had none in flight while other tenants had (flow control; 0: none)"
        ),
    )
    router_replicas: int = field(
        default=1,
        metadata=flag("router replicas sharing the tenants' per-minute limits: each applies its share"),
    )
    # None: from the prompt's length and the pod's measured prefill speed (pdserve/router/prefill_leg.py).
    prefill_timeout: float | None = field(
        default=None,
        metadata=flag(
            "seconds a prefill leg may take before decode computes the prompt and the pod leaves rotation until "
            "its health check passes (default: 2 s + 4x what the pod's measured prefill speed says the prompt "
            "needs)"
        ),
    )

    def __post_init__(self) -> None:
        self.medium_weights = parse_tier_weights(self.tier_weights)
        if self.router_replicas < 1:
            raise ValueError(f"router_replicas must be >= 1, got {self.router_replicas}")
        if self.saturation_queue < 1 or not 0 < self.saturation_kv <= 1:
            raise ValueError("saturation_queue must be >= 1 and saturation_kv in (0, 1]")
        if self.max_ahead < 0:
            raise ValueError(f"max_ahead must be >= 0, got {self.max_ahead}")

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        add_flags(parser, RouterConfig)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, api_key: str | None, keys_dir: str | None) -> RouterConfig:
        return cls(args.prefill, args.decode or [], api_key=api_key, keys_dir=keys_dir, **flag_values(args, cls))
