"""PeerHolds: the finished turns the router asked decode pods to hold for peer reads, and the choice of a prefill
leg's ``kv_prefix_source`` (docs/kv-cache.md, "Peers").

A decode leg to a pod that serves peer reads (its /health says where: ``kv_peer_source``) carries a random handle
(``kv_peer_hold``); once its answer is relayed, the turn is remembered here under the hash of its prompt's last
whole block, until the pod's hold time is up. The next turn of that conversation starts with the same blocks (a
chat template renders the earlier messages alike), so its prompt's hashes lead back to the turn: for each decode
pod, this walks back from the pod's longest cached prefix of the new prompt (the KV-event index) to the last
block a remembered turn ended its prompt with. The pod with the longest such prefix is the source when it holds
more of the prompt than the chosen prefill pod has, and the capability (``pdserve.api.auth``) lets that prefill
engine, and no other, read that hold for ``CAPABILITY_SECONDS``.

What the router believes may be out of date (the hold dropped for room, the pod restarted): the holder then
refuses, and the prefill engine computes the prompt. Nothing here is ever a correctness matter.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.api.peer_kv import PrefixSource, new_peer_handle, prefix_source_params
from pdserve.router.kv_index import KVIndex
from pdserve.router.pods import Pod
from pdserve.router.prompt import Prompt

# How long a prefill engine has to start its read (a leg that queues longer computes the prompt).
CAPABILITY_SECONDS = 120.0
MAX_REMEMBERED_TURNS = 1 << 16

# (reader engine, holder engine, handle, expires_at) -> the capability (``RouterSigner.capability``; "" without keys)
CapabilityMaker = Callable[[str, str, str, float], str]


@dataclass(frozen=True)
class HeldTurn:
    pod: Pod
    engine_id: str  # the holder's run: a restarted engine holds nothing of its past
    handle: str
    expires: float  # time.monotonic()


class PeerHolds:
    def __init__(self, index: KVIndex) -> None:
        self.index = index
        self._turns: OrderedDict[bytes, HeldTurn] = OrderedDict()  # last prompt block hash -> turn, oldest first

    @staticmethod
    def handle_for(pod: Pod) -> str | None:
        """A new hold's handle for a decode leg to ``pod``; None when the pod serves no peer reads."""
        return new_peer_handle() if pod.peer_source is not None and pod.engine_id else None

    def record(self, pod: Pod, handle: str, prompt: Prompt) -> None:
        """``pod`` answered a decode leg that asked it to hold the turn under ``handle``."""
        known = self.index.pods.get(pod.url)
        if known is None or not known.block_size or pod.peer_source is None or not pod.engine_id:
            return
        hashes = prompt.hashes(known.block_size)
        if not len(hashes):
            return
        key = hashes[len(hashes) - 1]
        self._turns.pop(key, None)
        self._turns[key] = HeldTurn(pod, pod.engine_id, handle, time.monotonic() + pod.peer_source.hold_seconds)
        while len(self._turns) > MAX_REMEMBERED_TURNS:
            self._turns.popitem(last=False)

    def source_for(
        self, prompt: Prompt, reader: Pod, holders: list[Pod], capability: CapabilityMaker
    ) -> dict[str, Any] | None:
        """The ``kv_prefix_source`` of a prefill leg to ``reader``: the holder with the longest cached prefix of
        the prompt past what the reader's pool has, or None."""
        if reader.engine_id is None:
            return None
        now = time.monotonic()
        best: tuple[int, HeldTurn, int] | None = None  # (blocks, turn, block size)
        for pod in holders:
            known = self.index.pods.get(pod.url)
            if (
                pod is reader
                or not pod.healthy
                or pod.peer_source is None
                or pod.compat_hash != reader.compat_hash
                or known is None
                or not known.block_size
            ):
                continue
            hashes = prompt.hashes(known.block_size)
            cached = self._cached(pod, hashes)
            if cached <= self._cached(reader, hashes) or (best is not None and cached <= best[0]):
                continue
            for index in range(cached - 1, -1, -1):
                turn = self._turns.get(hashes[index])
                if turn is not None and turn.pod is pod and turn.engine_id == pod.engine_id and turn.expires > now:
                    best = (cached, turn, known.block_size)
                    break
        if best is None:
            return None
        blocks, turn, block_size = best
        source = turn.pod.peer_source
        assert source is not None and reader.engine_id is not None
        expires_at = time.time() + CAPABILITY_SECONDS
        return prefix_source_params(
            PrefixSource(
                engine_id=turn.engine_id,
                host=source.host,
                ports=tuple(source.ports),
                handle=turn.handle,
                num_tokens=blocks * block_size,
                reader=reader.engine_id,
                expires_at=expires_at,
                capability=capability(reader.engine_id, turn.engine_id, turn.handle, expires_at),
            )
        )

    def _cached(self, pod: Pod, hashes: Sequence[bytes]) -> int:
        """How many of ``hashes`` lead the pod's pool (its engine medium)."""
        known = self.index.pods.get(pod.url)
        if known is None:
            return 0
        count = 0
        while count < len(hashes) and hashes[count] in known.hashes:
            count += 1
        return count
