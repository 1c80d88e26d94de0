"""FakeModelRunner: a deterministic model stand-in for engine tests and scheduler benchmarks.

It keeps a fake KV cache (one token id per slot) and writes each scheduled token into the slot
its block table names. The next token is a fixed function of the context *read back through
the block table*, not of the request's token list, so a wrong block table, a bad prefix-cache
hit or a block reused while still owned changes the output. ``reference_generate`` computes
the same function straight from token ids: the oracle any schedule must reproduce.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from pdserve.kvtransfer.base import KVConnectorOutput
from pdserve.worker.interface import NO_TOKEN, ModelRunnerOutput, SchedulerOutput

_MAX_CONTEXT = 1 << 16
# The weighted sum is reduced modulo a prime first, so tokens spread evenly over any vocabulary
# (reducing straight modulo an even vocabulary size would lock the parity of every token).
_PRIME = 1_000_003


def _position_weights() -> np.ndarray:
    rng = np.random.default_rng(1234)
    return rng.integers(1, _PRIME, size=_MAX_CONTEXT, dtype=np.int64)


def _next_token(context: np.ndarray, weights: np.ndarray, vocab_size: int) -> int:
    return int((context * weights[: len(context)]).sum() % _PRIME % vocab_size)


def reference_generate(prompt_token_ids: list[int], num_tokens: int, vocab_size: int) -> list[int]:
    """The first ``num_tokens`` tokens FakeModelRunner produces after a prompt (no stop conditions)."""
    weights = _position_weights()
    tokens = list(prompt_token_ids)
    for _ in range(num_tokens):
        tokens.append(_next_token(np.asarray(tokens, dtype=np.int64), weights, vocab_size))
    return tokens[len(prompt_token_ids) :]


class FakeConnectorWorker(Protocol):
    def step(self, metadata: Any, runner: FakeModelRunner) -> KVConnectorOutput | None:
        """Start the loads in ``metadata``; report those (and sends) that have completed."""
        ...


class FakeModelRunner:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        vocab_size: int = 1000,
        connector_worker: FakeConnectorWorker | None = None,
    ) -> None:
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.kv = np.full(num_blocks * block_size, -1, dtype=np.int64)
        self.weights = _position_weights()
        self.connector_worker = connector_worker

    def slots(self, block_ids: list[int], start: int, end: int) -> np.ndarray:
        positions = np.arange(start, end)
        table = np.asarray(block_ids, dtype=np.int64)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def write_tokens(self, block_ids: list[int], start: int, token_ids: list[int]) -> None:
        self.kv[self.slots(block_ids, start, start + len(token_ids))] = token_ids

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        connector_output = None
        if self.connector_worker is not None:
            connector_output = self.connector_worker.step(scheduler_output.kv_connector_metadata, self)
        sampled = []
        for request, num_new, start, block_ids in zip(
            scheduler_output.requests,
            scheduler_output.num_scheduled_tokens,
            scheduler_output.start_positions,
            scheduler_output.block_ids,
            strict=True,
        ):
            end = start + num_new
            self.write_tokens(block_ids, start, request.all_token_ids[start:end])
            if end < request.num_tokens:
                sampled.append(NO_TOKEN)
                continue
            context = self.kv[self.slots(block_ids, 0, end)]
            sampled.append(_next_token(context, self.weights, self.vocab_size))
        return ModelRunnerOutput(sampled, connector_output)

    def close(self) -> None:
        return None
