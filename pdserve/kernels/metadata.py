"""A step's inputs as the kernels read them: ``AttentionMetadata`` (where each token's KV goes and which KV
each token attends to) and ``InputBuffers``, the persistent buffers a model runner writes every step into
(``ModelRunner.prepare_inputs``, the first of a step's three stages: prepare the inputs, run the model,
sample).

The buffers are allocated once, for the largest step the scheduler can issue (``max_num_batched_tokens``
tokens over ``max_num_seqs`` sequences of up to ``max_model_len`` tokens), and every step writes into them:
the token ids, positions, each token's sequence, KV slots, block tables, query start locations and context
lengths, and what the CPU decode path reads (which sequences decode, their rows and compact block tables).
Nothing on the hot path allocates a tensor, so the addresses a step's kernels read are the same every step
(what a captured CUDA graph replays over). Each buffer has a host side, numpy, filled with vectorised
copies, and a device side: on CPU the same memory (no copy); on a GPU a device tensor filled from pinned
host memory by one asynchronous copy. Rows of a block table past a sequence's own blocks keep older
(valid) block ids: no kernel reads past a sequence's context.

``build_attention_metadata`` builds one batch's metadata in buffers of its own (tests, memory profiling).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    """Where a batch's tokens live in the paged cache. Built once per step, shared by all layers. Tensors are
    on the device (views of ``InputBuffers``); the lists are the same facts on the host, for the paths that
    loop over sequences (prefill chunks on CPU, the hybrid layers' prefill) or size a kernel's grid."""

    slot_block_ids: torch.Tensor  # [num_tokens] block of each new token's KV slot
    slot_offsets: torch.Tensor  # [num_tokens] offset of that slot inside its block
    query_start_loc: list[int]  # [num_seqs + 1] where each sequence's tokens start in the batch
    context_lens: list[int]  # [num_seqs] tokens in each sequence's context, new ones included
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64
    token_seqs: torch.Tensor  # [num_tokens] each token's sequence
    token_positions: torch.Tensor  # [num_tokens] each token's position in its sequence
    query_starts: torch.Tensor  # query_start_loc, [num_seqs + 1]
    context_lens_tensor: torch.Tensor  # context_lens, [num_seqs]
    # The decodes (query_len 1), batched, for the CPU path.
    decode_seq_indices: torch.Tensor  # [num_decodes] sequence index of each decode
    decode_token_indices: torch.Tensor  # [num_decodes] its token's index in the batch
    decode_context_lens: torch.Tensor  # [num_decodes]
    decode_block_ids: torch.Tensor  # [num_decodes * decode_blocks] their block tables, flattened
    prefill_seq_indices: list[int]  # sequences with query_len > 1
    # Hybrid models: each sequence's state slot (linear-attention layers), int64 [num_seqs].
    state_slots: torch.Tensor | None = None
    # The GPU attention grid's (partition count, blocks per partition), fixed for a captured graph
    # (``triton_attention.static_partitions``); None: sized from the step's longest context.
    partitions: tuple[int, int] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)


class _Buffer:
    """One persistent buffer: its host array and the device tensor the kernels read."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        pinned = device.type == "cuda"
        self.host_tensor = torch.zeros(shape, dtype=dtype, pin_memory=pinned)
        self.host = self.host_tensor.numpy()
        self.device = torch.zeros(shape, dtype=dtype, device=device) if device.type != "cpu" else self.host_tensor
        self.on_host = device.type == "cpu"

    def upload(self, count: int) -> torch.Tensor:
        """The first ``count`` entries (along the first axis) as the kernels read them, copied to the
        device first where it is another (asynchronously: the host side is written again only for the next
        step, after this step's sampled tokens were read back, which waits for the device)."""
        if not self.on_host and count:
            self.device[:count].copy_(self.host_tensor[:count], non_blocking=True)
        return self.device[:count]


class InputBuffers:
    """A step's inputs, reused step after step (see the module's docstring)."""

    def __init__(
        self, max_tokens: int, max_seqs: int, max_model_len: int, block_size: int, device: torch.device
    ) -> None:
        self.block_size = block_size
        self.max_tokens = max_tokens
        self.max_seqs = max_seqs
        self.max_blocks = -(-max_model_len // block_size)
        int64 = torch.int64
        self.input_ids = _Buffer((max_tokens,), int64, device)
        self.positions = _Buffer((max_tokens,), int64, device)
        self.token_seqs = _Buffer((max_tokens,), int64, device)  # each token's sequence in the batch
        self.slot_block_ids = _Buffer((max_tokens,), int64, device)
        self.slot_offsets = _Buffer((max_tokens,), int64, device)
        self.block_tables = _Buffer((max_seqs, self.max_blocks), int64, device)
        self.query_start_loc = _Buffer((max_seqs + 1,), int64, device)
        self.context_lens = _Buffer((max_seqs,), int64, device)
        self.decode_seqs = _Buffer((max_seqs,), int64, device)
        self.decode_rows = _Buffer((max_seqs,), int64, device)
        self.decode_context_lens = _Buffer((max_seqs,), int64, device)
        self.decode_block_ids = _Buffer((max_seqs * self.max_blocks,), int64, device)
        self.state_slots = _Buffer((max_seqs,), int64, device)

    def buffers(self) -> list[_Buffer]:
        return [value for value in vars(self).values() if isinstance(value, _Buffer)]

    def prepare(
        self,
        token_ids: Sequence[Sequence[int]],
        num_scheduled_tokens: Sequence[int],
        start_positions: Sequence[int],
        block_ids: Sequence[Sequence[int]],
        state_slots: Sequence[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Write one step (sequence i: ``num_scheduled_tokens[i]`` tokens of ``token_ids[i]`` from
        ``start_positions[i]``, its KV in ``block_ids[i]``) into the buffers: the step's token ids, positions
        and attention metadata, all views of them."""
        num_seqs = len(num_scheduled_tokens)
        num_tokens = int(sum(num_scheduled_tokens))
        if num_tokens > self.max_tokens or num_seqs > self.max_seqs:
            raise ValueError(
                f"a step of {num_tokens} tokens over {num_seqs} sequences exceeds the input buffers "
                f"({self.max_tokens} tokens, {self.max_seqs} sequences)"
            )
        input_ids, positions, token_seqs = self.input_ids.host, self.positions.host, self.token_seqs.host
        tables, starts, lens = self.block_tables.host, self.query_start_loc.host, self.context_lens.host
        query_start_loc = [0] * (num_seqs + 1)
        context_lens = [0] * num_seqs
        decode_seqs: list[int] = []
        prefill_seqs: list[int] = []
        row = 0
        for seq, (tokens, count, start, blocks) in enumerate(
            zip(token_ids, num_scheduled_tokens, start_positions, block_ids, strict=True)
        ):
            end = start + count
            if count == 1:
                input_ids[row] = tokens[start]
                positions[row] = start
                token_seqs[row] = seq
                decode_seqs.append(seq)
            else:
                input_ids[row : row + count] = tokens[start:end]
                positions[row : row + count] = np.arange(start, end)
                token_seqs[row : row + count] = seq
                prefill_seqs.append(seq)
            if len(blocks) > self.max_blocks:
                raise ValueError(f"sequence {seq} has {len(blocks)} blocks; the buffers hold {self.max_blocks}")
            tables[seq, : len(blocks)] = blocks
            row += count
            query_start_loc[seq + 1] = row
            context_lens[seq] = end
        starts[: num_seqs + 1] = query_start_loc
        lens[:num_seqs] = context_lens
        step_positions = positions[:num_tokens]
        np.floor_divide(step_positions, self.block_size, out=self.slot_offsets.host[:num_tokens])
        self.slot_block_ids.host[:num_tokens] = tables[token_seqs[:num_tokens], self.slot_offsets.host[:num_tokens]]
        np.remainder(step_positions, self.block_size, out=self.slot_offsets.host[:num_tokens])

        num_decodes = len(decode_seqs)
        decode_blocks = 0
        if num_decodes:
            seqs = self.decode_seqs.host[:num_decodes]
            seqs[:] = decode_seqs
            self.decode_rows.host[:num_decodes] = starts[seqs]
            decode_lens = self.decode_context_lens.host[:num_decodes]
            decode_lens[:] = lens[seqs]
            decode_blocks = -(-int(decode_lens.max()) // self.block_size)
            compact = self.decode_block_ids.host[: num_decodes * decode_blocks].reshape(num_decodes, decode_blocks)
            np.take(tables[:, :decode_blocks], seqs, axis=0, out=compact)
        if state_slots is not None:
            self.state_slots.host[:num_seqs] = state_slots

        metadata = AttentionMetadata(
            slot_block_ids=self.slot_block_ids.upload(num_tokens),
            slot_offsets=self.slot_offsets.upload(num_tokens),
            query_start_loc=query_start_loc,
            context_lens=context_lens,
            block_tables=self.block_tables.upload(max(num_seqs, 1)),
            decode_seq_indices=self.decode_seqs.upload(num_decodes),
            decode_token_indices=self.decode_rows.upload(num_decodes),
            decode_context_lens=self.decode_context_lens.upload(num_decodes),
            decode_block_ids=self.decode_block_ids.upload(num_decodes * decode_blocks),
            prefill_seq_indices=prefill_seqs,
            token_seqs=self.token_seqs.upload(num_tokens),
            token_positions=self.positions.upload(num_tokens),
            query_starts=self.query_start_loc.upload(num_seqs + 1),
            context_lens_tensor=self.context_lens.upload(num_seqs),
            state_slots=self.state_slots.upload(num_seqs) if state_slots is not None else None,
        )
        return self.input_ids.upload(num_tokens), metadata.token_positions, metadata


def build_attention_metadata(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Metadata for sequences with ``query_lens[i]`` new tokens ending at ``context_lens[i]``, in buffers
    sized for this batch alone."""
    device = torch.device(device)
    longest = max(max(context_lens, default=1), max((len(t) for t in block_tables), default=1) * block_size)
    buffers = InputBuffers(max(sum(query_lens), 1), max(len(query_lens), 1), longest, block_size, device)
    zeros = [[0] * length for length in context_lens]  # token ids: the metadata does not read them
    starts = [end - count for end, count in zip(context_lens, query_lens, strict=True)]
    return buffers.prepare(zeros, query_lens, starts, block_tables)[2]
