"""Routing policies (``--routing``): how the router picks one of a role's pods, one class per policy and one
row per policy in ``ROUTING_POLICIES``.

- ``round-robin``: the next pod in turn; ``least-load``: fewest requests this router has in flight there.
- ``prefix``: the pod with the best-weighted cached prefix of the prompt (from the KV index); ties go to the
  least-loaded, then round-robin. For a prefill pod that is the one computing the least; for a decode pod the
  one pulling the fewest blocks (or, decode-only, computing the least).
- ``prefix-load``: score = prefix_weight × weighted matched blocks − load_weight × load, where load is the
  larger of this router's in-flight count and the engine's own queue (running + waiting + waiting for KV: it
  sees other router replicas' requests too), plus its KV-cache usage (0..1). Ties as for ``prefix``.

The matched blocks are the prompt's leading blocks a pod holds in any medium, its pool or a KV tier; each
weighs what ``--tier-weights`` gives the fastest medium holding it (engine 1, host 0.8, disk 0.5, shared 0.4 by
default), since a block in a tier must be loaded before it saves any compute.

The prefix policies need the prompt's token ids (``--tokenizer``); without them, or for a request whose prompt
is not known (several prompts), they choose least-load. A policy is built with the router's settings and its
KV index, and answers ``choose``; adding one is a class (in its own module when it is more than a few lines)
plus one row here. Session affinity and health come first, in ``policy.Chooser``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.router.kv_index import KVIndex
from pdserve.router.pods import Pod, PodSet
from pdserve.router.prompt import Prompt

if TYPE_CHECKING:
    from pdserve.router.config import RouterConfig


@dataclass
class Choice:
    pod: Pod
    policy: str  # what decided: a routing name, or "affinity"
    matched: int = 0  # leading prompt blocks the pod holds in any medium, as predicted from the index
    block_size: int = 0  # the pod's block size; 0 when no prediction was made


class RoutingPolicy(ABC):
    """Picks one of a role's pods; subclasses that read the KV index set ``matches_prefixes``."""

    name = ""
    matches_prefixes = False  # whether it matches prompts against the KV index: it needs their token ids
    prefix_aware = False  # whether it does, this router having a tokenizer

    def __init__(self, config: RouterConfig, index: KVIndex) -> None:
        self.index = index

    @abstractmethod
    def choose(
        self, podset: PodSet, prompt: Prompt | None, exclude: Collection[Pod], healthy_only: bool
    ) -> Choice | None:
        """The pod for a request (None: none left), ``exclude`` aside, healthy ones first (only, with
        ``healthy_only``)."""


class RoundRobin(RoutingPolicy):
    name = "round-robin"

    def choose(
        self, podset: PodSet, prompt: Prompt | None, exclude: Collection[Pod], healthy_only: bool
    ) -> Choice | None:
        pod = podset.choose(exclude, healthy_only, round_robin=True)
        return None if pod is None else Choice(pod, self.name)


class LeastLoad(RoutingPolicy):
    name = "least-load"

    def choose(
        self, podset: PodSet, prompt: Prompt | None, exclude: Collection[Pod], healthy_only: bool
    ) -> Choice | None:
        pod = podset.choose(exclude, healthy_only, round_robin=False)
        return None if pod is None else Choice(pod, LeastLoad.name)  # the prefix policies' fallback says so


class PrefixLoad(LeastLoad):
    name = "prefix-load"
    matches_prefixes = True

    def __init__(self, config: RouterConfig, index: KVIndex) -> None:
        super().__init__(config, index)
        self.prefix_aware = config.tokenizer is not None
        self.prefix_weight = config.prefix_weight
        self.load_weight = config.load_weight
        self.medium_weights = config.medium_weights

    def choose(
        self, podset: PodSet, prompt: Prompt | None, exclude: Collection[Pod], healthy_only: bool
    ) -> Choice | None:
        if not self.prefix_aware or prompt is None:
            return super().choose(podset, prompt, exclude, healthy_only)
        matched: dict[Pod, int] = {}
        index = self.index
        prefix_weight, load_weight, medium_weights = self.prefix_weight, self.load_weight, self.medium_weights

        def score(pod: Pod) -> float:
            known = index.pods.get(pod.url)
            hits = 0.0
            if known is not None and known.block_size:
                match = index.match(pod.url, prompt.hashes(known.block_size), medium_weights)
                matched[pod], hits = match.blocks, match.score
            if not load_weight:
                return hits
            load = None if known is None else known.load
            if load is None:
                return prefix_weight * hits - load_weight * pod.in_flight
            queue = load.num_running + load.num_waiting + load.num_waiting_for_remote_kv
            return prefix_weight * hits - load_weight * (max(pod.in_flight, queue) + load.kv_cache_usage)

        pod = podset.choose(exclude, healthy_only, score=score)
        if pod is None:
            return None
        known = index.pods.get(pod.url)
        return Choice(pod, self.name, matched.get(pod, 0), known.block_size if known is not None else 0)


class Prefix(PrefixLoad):
    """prefix-load without the load term: the best-weighted cached prefix wins, load only breaks ties."""

    name = "prefix"

    def __init__(self, config: RouterConfig, index: KVIndex) -> None:
        super().__init__(config, index)
        self.load_weight = 0.0


ROUTING_POLICIES: dict[str, type[RoutingPolicy]] = {
    policy.name: policy for policy in (RoundRobin, LeastLoad, Prefix, PrefixLoad)
}
