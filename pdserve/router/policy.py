"""Pod choice policies (``--routing``), session affinity and the P/D decider.

- ``round-robin``: the next pod in turn; ``least-load``: fewest requests this router has in flight there.
- ``prefix``: the pod with the longest cached prefix of the prompt (from the KV index); ties go to the
  least-loaded, then round-robin. For a prefill pod that is the one computing the least; for a decode pod the
  one pulling the fewest blocks (or, decode-only, computing the least).
- ``prefix-load``: score = prefix_weight × matched blocks − load_weight × load, where load is the larger of
  this router's in-flight count and the engine's own queue (running + waiting + waiting for KV: it sees other
  router replicas' requests too), plus its KV-cache usage (0..1). Ties as for ``prefix``.

The prefix policies need the prompt's token ids (``--tokenizer``); without them, or for a request whose prompt
is not known (several prompts), they choose least-load. Session affinity (``X-Session-Id`` header, else the
body's ``user``) overrides the score, never health: rendezvous hashing over the role's healthy pods, so a
session stays put while its pod is up and only sessions of a pod that left move.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection
from dataclasses import dataclass

from pdserve.router.config import RouterConfig
from pdserve.router.kv_index import KVIndex
from pdserve.router.pods import Pod, PodSet
from pdserve.router.prompt import Prompt

ROUTINGS = ("round-robin", "least-load", "prefix", "prefix-load")
PREFIX_ROUTINGS = ("prefix", "prefix-load")


@dataclass
class Choice:
    pod: Pod
    policy: str  # what decided: a routing name, or "affinity"
    matched: int = 0  # leading prompt blocks the pod has cached, as predicted from the index
    block_size: int = 0  # the pod's block size; 0 when no prediction was made


class Chooser:
    def __init__(self, config: RouterConfig, index: KVIndex) -> None:
        if config.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, got {config.routing!r}")
        self.index = index
        self.routing = config.routing
        self.prefix_aware = config.routing in PREFIX_ROUTINGS and config.tokenizer is not None
        self.prefix_weight = config.prefix_weight
        self.load_weight = config.load_weight if config.routing == "prefix-load" else 0.0
        self.fallback = "round-robin" if config.routing == "round-robin" else "least-load"

    def choose(
        self,
        podset: PodSet,
        prompt: Prompt | None = None,
        session: str | None = None,
        exclude: Collection[Pod] = (),
        healthy_only: bool = False,
    ) -> Choice | None:
        if session is not None:
            pod = rendezvous(podset.healthy(exclude), session)
            if pod is not None:
                return self._predicted(Choice(pod, "affinity"), prompt)
        if not self.prefix_aware or prompt is None:
            pod = podset.choose(exclude, healthy_only, round_robin=self.fallback == "round-robin")
            return None if pod is None else self._predicted(Choice(pod, self.fallback), prompt)
        matched: dict[Pod, int] = {}
        index = self.index
        prefix_weight, load_weight = self.prefix_weight, self.load_weight

        def score(pod: Pod) -> float:
            known = index.pods.get(pod.url)
            hits = 0
            if known is not None and known.block_size:
                hits = index.match(pod.url, prompt.hashes(known.block_size))
            matched[pod] = hits
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
        return Choice(pod, self.routing, matched.get(pod, 0), known.block_size if known is not None else 0)

    def _predicted(self, choice: Choice, prompt: Prompt | None) -> Choice:
        """Fill in the chosen pod's predicted hit when the prompt is known (for the decider and the metrics)."""
        if prompt is not None and self.prefix_aware:
            known = self.index.pods.get(choice.pod.url)
            if known is not None and known.block_size:
                choice.block_size = known.block_size
                choice.matched = self.index.match(choice.pod.url, prompt.hashes(known.block_size))
        return choice


def rendezvous(pods: list[Pod], key: str) -> Pod | None:
    """Highest-random-weight choice: each (key, pod) pair gets a pseudo-random weight, the heaviest pod wins.
    Removing a pod moves only the keys it held."""
    best: Pod | None = None
    best_weight = b""
    encoded = key.encode("utf-8", "surrogatepass")
    for pod in pods:
        weight = hashlib.blake2b(encoded + b"\0" + pod.url.encode(), digest_size=8).digest()
        if best is None or weight > best_weight:
            best, best_weight = pod, weight
    return best


def uncached_tokens(prompt: Prompt, choice: Choice) -> int:
    """Prompt tokens the chosen pod would have to compute or receive (what the P/D decider weighs)."""
    return len(prompt) - choice.matched * choice.block_size
