"""FakeModelRunner: a deterministic model stand-in for engine tests and scheduler benchmarks.

It keeps a fake KV cache (one token id per slot) and writes each scheduled token into the slot
its block table names. The next token is a fixed function of the context *read back through
the block table*, not of the request's token list, so a wrong block table, a bad prefix-cache
hit or a block reused while still owned changes the output. ``reference_generate`` computes
the same function straight from token ids: the oracle any schedule must reproduce.

With state slots (a hybrid model's linear-attention layers) it also keeps, per slot, the running
weighted sum of the tokens fed through it and their count, zeroed when a request is scheduled from
position 0, as the real runner zeroes a slot. A chunk that does not continue exactly where its
slot's count stands (two requests in one slot, a slot reused while owned, a stale slot after
preemption) raises, and the sampled token must agree with the slot's sum. A step's
``state_restores`` slots are put back as they were before it.
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
        num_state_slots: int = 0,
    ) -> None:
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.kv = np.full(num_blocks * block_size, -1, dtype=np.int64)
        self.weights = _position_weights()
        self.connector_worker = connector_worker
        # Per slot: (weighted sum modulo the prime, tokens fed).
        self.state = np.zeros((num_state_slots, 2), dtype=np.int64)

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
        restores = set(scheduler_output.state_restores or ())
        kept: dict[int, np.ndarray] = {}
        num_requests = len(scheduler_output.requests)
        state_slots: list[int | None] = (
            [*scheduler_output.state_slots] if scheduler_output.state_slots else [None] * num_requests
        )
        for request, num_new, start, block_ids, slot in zip(
            scheduler_output.requests,
            scheduler_output.num_scheduled_tokens,
            scheduler_output.start_positions,
            scheduler_output.block_ids,
            state_slots,
            strict=True,
        ):
            end = start + num_new
            self.write_tokens(block_ids, start, request.all_token_ids[start:end])
            if slot is not None:
                if slot in restores:  # kept after a start-0 zeroing, as the real runner keeps it
                    kept[slot] = self.state[slot].copy() if start else np.zeros(2, dtype=np.int64)
                self._feed_state(slot, request.request_id, start, request.all_token_ids[start:end])
            if end < request.num_tokens:
                sampled.append(NO_TOKEN)
                continue
            context = self.kv[self.slots(block_ids, 0, end)]
            token = _next_token(context, self.weights, self.vocab_size)
            if slot is not None and int(self.state[slot, 0]) % self.vocab_size != token:
                raise AssertionError(f"request {request.request_id}: state slot {slot} disagrees with its KV")
            sampled.append(token)
        for slot, state in kept.items():  # a step that hands its state over as it found it
            self.state[slot] = state
        return ModelRunnerOutput(sampled, connector_output)

    def _feed_state(self, slot: int, request_id: str, start: int, token_ids: list[int]) -> None:
        if start == 0:
            self.state[slot] = 0
        total, count = (int(value) for value in self.state[slot])
        if count != start:
            raise AssertionError(f"request {request_id} continues at {start}, but its state slot {slot} holds {count}")
        weights = self.weights[start : start + len(token_ids)]
        total = (total + int((np.asarray(token_ids, dtype=np.int64) * weights).sum())) % _PRIME
        self.state[slot] = (total, start + len(token_ids))

    def close(self) -> None:
        return None
