"""Shared pieces of the KV tier tests: compatibility hashes, block hashes, a request, a bounded poll."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.api.peer_kv import PeerKV
from pdserve.kvtransfer.base import KVConnectorOutput
from pdserve.kvtransfer.params import RemotePrefill

COMPAT = "0123456789abcdef" * 2
OTHER_COMPAT = "fedcba9876543210" * 2


def block_hash(n: int) -> bytes:
    """A 32-byte block hash, as the prefix cache's (SHA-256) are."""
    return hashlib.sha256(f"block-{n}".encode()).digest()


@dataclass
class Req:
    """A request as a connector sees it (``base.ConnectorRequest``)."""

    request_id: str
    prompt_token_ids: list[int]
    block_hashes: list[bytes]
    remote_prefill: RemotePrefill | None = None
    remote_decode: bool = False
    peer: PeerKV | None = None
    num_computed_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)


def collect_until(
    collect: Callable[[], KVConnectorOutput | None],
    done: Callable[[KVConnectorOutput], bool],
    first: KVConnectorOutput | None = None,
    timeout: float = 5.0,
) -> KVConnectorOutput:
    """``first`` (a report already taken) and every report ``collect`` gives, merged, polled until ``done`` holds
    of them (at most ``timeout`` s)."""
    merged = KVConnectorOutput()
    if first is not None:
        merged.merge(first)
    deadline = time.monotonic() + timeout
    while True:
        output = collect()
        if output is not None:
            merged.merge(output)
        if done(merged):
            return merged
        assert time.monotonic() < deadline, f"not done after {timeout} s: {merged}"
        time.sleep(0.002)
