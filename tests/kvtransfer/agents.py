"""Transfer agents in this process for tests: a real TransferAgent over the TCP transport (or NIXL) on
127.0.0.1 with a small KV cache and generation array, and everything it has reported."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from pdserve.kvtransfer.agent import TransferAgent
from pdserve.kvtransfer.base import KVConnectorOutput
from pdserve.kvtransfer.config import KVFaults, KVTransferConfig
from pdserve.kvtransfer.params import RemotePrefill
from pdserve.kvtransfer.work import LoadSpec

NUM_BLOCKS = 8
BLOCK_SHAPE = (2, 4, 8)  # 64 float32 values: 256 bytes a block
BLOCK_BYTES = 256
COMPAT = "compat-a"
WAIT_S = 5.0  # generous: the machine is small and shared; a passing test takes far less


def token_of(request_id: str) -> str:
    """The hold token the tests' prefill engines give the hold of ``request_id`` (a real one is random)."""
    return f"token-{request_id}"


def _kv_cache(filled: bool):
    import torch  # after pdserve, which sets the OpenMP wait policy torch reads once

    if not filled:
        return torch.zeros((NUM_BLOCKS, *BLOCK_SHAPE))
    # Every value distinct, and none zero: a block copied to the wrong place or not at all shows.
    return torch.arange(1, NUM_BLOCKS * 64 + 1, dtype=torch.float32).reshape(NUM_BLOCKS, *BLOCK_SHAPE)


class Engine:
    """One agent with its KV cache and generations, and everything it has reported so far."""

    def __init__(
        self,
        *,
        filled: bool,
        compat: str = COMPAT,
        faults: KVFaults | None = None,
        heads: list[tuple[int, int]] | None = None,
        kv_cache: Any = None,
        generations: np.ndarray | None = None,
        rank: int = 0,
        **config: Any,
    ) -> None:
        """``heads``: the engine's KV heads per rank; ``rank``: whose agent this is, over ``kv_cache``
        (default: a small cache of another layout, filled or zeros) and ``generations`` (the engine's)."""
        config.setdefault("transfer_timeout", 3.0)
        config.setdefault("transport", "tcp")
        self.config = KVTransferConfig(faults=faults or KVFaults(), **config)
        self.kv_cache = kv_cache if kv_cache is not None else _kv_cache(filled)
        self.initial = self.kv_cache.clone()
        self.generations = generations if generations is not None else np.zeros(NUM_BLOCKS, dtype=np.int64)
        self.agent = TransferAgent(self.config, self.kv_cache, self.generations, compat, heads, rank)
        self.seen = KVConnectorOutput()

    def poll(self) -> KVConnectorOutput:
        output = self.agent.collect()
        if output is not None:
            for name in ("finished_sending", "finished_recving", "failed_recving", "failed_recving_in_flight"):
                new, seen = getattr(output, name), getattr(self.seen, name)
                assert not new & seen, f"{name} reported {new & seen} twice"
                seen |= new
            self.seen.transfers += output.transfers
            self.seen.num_failed_transfers += output.num_failed_transfers
            self.seen.num_expired_leases += output.num_expired_leases
            self.seen.num_failed_releases += output.num_failed_releases
            for reason, count in output.rejected_messages.items():
                self.seen.rejected_messages[reason] = self.seen.rejected_messages.get(reason, 0) + count
        return self.seen

    def wait_for(self, done: Callable[[KVConnectorOutput], bool], what: str, timeout: float = WAIT_S) -> float:
        """Poll until ``done(everything reported)``; the seconds it took."""
        start = time.monotonic()
        while not done(self.poll()):
            assert time.monotonic() - start < timeout, f"timed out waiting for {what}: {self.seen}"
            time.sleep(0.005)
        return time.monotonic() - start

    def quiet_for(self, seconds: float) -> KVConnectorOutput:
        """Keep polling for ``seconds`` (to see that something does not happen)."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.poll()
            time.sleep(0.01)
        return self.poll()

    def remote(self, request_id: str, block_ids: list[int], *, lease_seconds: float = 30.0) -> RemotePrefill:
        """The params this (prefill) engine would hand out for a hold of ``block_ids``."""
        generations = self.generations[block_ids].tolist()
        return RemotePrefill(
            engine_id=self.config.engine_id,
            request_id=request_id,
            host="127.0.0.1",
            port=self.agent.port,
            block_ids=block_ids,
            generations=generations,
            num_tokens=4 * len(block_ids),
            prompt_hash="",
            compat_hash=COMPAT,
            lease_seconds=lease_seconds,
            hold_token=token_of(request_id),
        )

    def block(self, block_id: int):
        return self.kv_cache[block_id]


@contextmanager
def engines(*specs: dict[str, Any]) -> Iterator[list[Engine]]:
    engines: list[Engine] = []
    try:
        for spec in specs:
            engines.append(Engine(**spec))
        yield engines
    finally:
        for engine in engines:
            engine.agent.close()


def load(request_id: str, remote: RemotePrefill, local_block_ids: list[int]) -> LoadSpec:
    return LoadSpec(request_id, remote, local_block_ids, list(remote.block_ids), list(remote.generations))


def assert_untouched(engine: Engine, *except_blocks: int) -> None:
    import torch

    for block_id in range(NUM_BLOCKS):
        if block_id not in except_blocks:
            assert torch.equal(engine.block(block_id), engine.initial[block_id]), f"block {block_id} was written"
