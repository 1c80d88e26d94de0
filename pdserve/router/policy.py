"""The router's pod choice: session affinity first, then the configured routing policy
(``router.policies``), and the P/D decider's arithmetic.

Session affinity (``X-Session-Id`` header, else the body's ``user``) overrides the policy, never health:
rendezvous hashing over the role's healthy pods, so a session stays put while its pod is up and only sessions
of a pod that left move.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection

from pdserve.router.config import RouterConfig
from pdserve.router.kv_index import KVIndex
from pdserve.router.pods import Pod, PodSet
from pdserve.router.policies import ROUTING_POLICIES, Choice
from pdserve.router.prompt import Prompt

__all__ = ["Choice", "Chooser", "rendezvous", "uncached_tokens"]


class Chooser:
    def __init__(self, config: RouterConfig, index: KVIndex) -> None:
        policy_cls = ROUTING_POLICIES.get(config.routing)
        if policy_cls is None:
            raise ValueError(f"routing must be one of {', '.join(ROUTING_POLICIES)}, got {config.routing!r}")
        self.index = index
        self.medium_weights = config.medium_weights
        self.policy = policy_cls(config, index)
        self.prefix_aware = self.policy.prefix_aware

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
        return self.policy.choose(podset, prompt, exclude, healthy_only)

    def _predicted(self, choice: Choice, prompt: Prompt | None) -> Choice:
        """Fill in the chosen pod's predicted hit when the prompt is known (for the decider and the metrics)."""
        if prompt is not None and self.prefix_aware:
            known = self.index.pods.get(choice.pod.url)
            if known is not None and known.block_size:
                choice.block_size = known.block_size
                choice.matched = self.index.match(
                    choice.pod.url, prompt.hashes(known.block_size), self.medium_weights
                ).blocks
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
