"""Triton kernels for the GPU path: write new K/V into their slots, and paged attention for a
batch that mixes prefill chunks and decodes. Same layouts and results as ``reference``.

The attention kernel runs one program per (token, KV head, context partition): it loads the query
heads that share that KV head (GQA: K and V are read once per group), walks its partition of the
sequence's blocks through the block table up to the token's own position (causal), and keeps an
online softmax. Long contexts are split into partitions whose partial results a second kernel
merges (flash-decoding), so a few long decodes still spread over the whole GPU.

``TRITON_INTERPRET=1`` must be set before this module is imported to run the kernels on CPU
tensors (the tests do, at small shapes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.metadata import AttentionMetadata
from pdserve.kernels.reference import FP8_DTYPES, NO_SCALES

FP8_E4M3_MAX = tl.constexpr(448.0)


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_ids_ptr,
    offsets_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    inv_k_scale,
    inv_v_scale,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    FP8: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    dims = tl.arange(0, HEAD_DIM_PADDED)
    in_dim = dims < HEAD_DIM
    block = tl.load(block_ids_ptr + token).to(tl.int64)
    offset = tl.load(offsets_ptr + token).to(tl.int64)
    k = tl.load(key_ptr + token * stride_kt + head * stride_kh + dims, mask=in_dim)
    v = tl.load(value_ptr + token * stride_vt + head * stride_vh + dims, mask=in_dim)
    if FP8:  # divided by the layer's scales and saturated, as torch converts to float8_e4m3fn
        k = tl.minimum(tl.maximum(k.to(tl.float32) * inv_k_scale, -FP8_E4M3_MAX), FP8_E4M3_MAX)
        v = tl.minimum(tl.maximum(v.to(tl.float32) * inv_v_scale, -FP8_E4M3_MAX), FP8_E4M3_MAX)
    tl.store(k_cache_ptr + block * stride_cb + offset * stride_cs + head * stride_ch + dims, k, mask=in_dim)
    tl.store(v_cache_ptr + block * stride_vcb + offset * stride_vcs + head * stride_vch + dims, v, mask=in_dim)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    kv_scales: tuple[float, float] = NO_SCALES,
) -> None:
    """``reference.write_kv``'s contract."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(2) != 1 or value.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("write_kv needs the head dimension contiguous")
    _write_kv_kernel[(num_tokens, num_kv_heads)](
        key,
        value,
        k_cache,
        v_cache,
        metadata.slot_block_ids,
        metadata.slot_offsets,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        1.0 / kv_scales[0],
        1.0 / kv_scales[1],
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=triton.next_power_of_2(head_dim),
        FP8=k_cache.dtype in FP8_DTYPES,
    )


@triton.jit
def _paged_attention_kernel(
    out_ptr,
    partial_ptr,
    stats_ptr,
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    token_seq_ptr,
    token_pos_ptr,
    scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_table,
    num_partitions,
    k_scale,
    v_scale,
    GROUP: tl.constexpr,
    GROUP_PADDED: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_SIZE_PADDED: tl.constexpr,
    PARTITION_BLOCKS: tl.constexpr,
    SPLIT: tl.constexpr,
):
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    partition = tl.program_id(2)
    seq = tl.load(token_seq_ptr + token).to(tl.int64)
    position = tl.load(token_pos_ptr + token)

    group_rows = tl.arange(0, GROUP_PADDED)
    heads = kv_head * GROUP + group_rows
    in_group = group_rows < GROUP
    dims = tl.arange(0, HEAD_DIM_PADDED)
    in_dim = dims < HEAD_DIM
    slots = tl.arange(0, BLOCK_SIZE_PADDED)

    q = tl.load(
        query_ptr + token * stride_qt + heads[:, None] * stride_qh + dims[None, :],
        mask=in_group[:, None] & in_dim[None, :],
        other=0.0,
    ).to(tl.float32)
    q = q * scale

    max_score = tl.full([GROUP_PADDED], float("-inf"), tl.float32)
    denominator = tl.zeros([GROUP_PADDED], tl.float32)
    acc = tl.zeros([GROUP_PADDED, HEAD_DIM_PADDED], tl.float32)
    num_blocks = position // BLOCK_SIZE + 1
    first_block = partition * PARTITION_BLOCKS
    last_block = tl.minimum(first_block + PARTITION_BLOCKS, num_blocks)
    for block_index in range(first_block, last_block):
        block = tl.load(block_tables_ptr + seq * stride_table + block_index).to(tl.int64)
        key_positions = block_index * BLOCK_SIZE + slots
        visible = (slots < BLOCK_SIZE) & (key_positions <= position)
        kv_mask = visible[:, None] & in_dim[None, :]
        k = (
            tl.load(
                k_cache_ptr + block * stride_cb + slots[:, None] * stride_cs + kv_head * stride_ch + dims[None, :],
                mask=kv_mask,
                other=0.0,
            ).to(tl.float32)
            * k_scale
        )
        v = (
            tl.load(
                v_cache_ptr + block * stride_vcb + slots[:, None] * stride_vcs + kv_head * stride_vch + dims[None, :],
                mask=kv_mask,
                other=0.0,
            ).to(tl.float32)
            * v_scale
        )
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [GROUP, BLOCK]
        scores = tl.where(visible[None, :], scores, float("-inf"))
        new_max = tl.maximum(max_score, tl.max(scores, axis=1))
        rescale = tl.exp(max_score - new_max)
        weights = tl.exp(scores - new_max[:, None])
        denominator = denominator * rescale + tl.sum(weights, axis=1)
        acc = acc * rescale[:, None] + tl.sum(weights[:, :, None] * v[None, :, :], axis=1)
        max_score = new_max

    head_dim_mask = in_group[:, None] & in_dim[None, :]
    if SPLIT:
        # Unnormalised partial results of this partition, merged by _merge_partitions_kernel. A
        # partition past the sequence's end leaves max -inf and sum 0, which the merge ignores.
        row = (token * (tl.num_programs(1) * GROUP) + heads) * num_partitions + partition
        tl.store(stats_ptr + row * 2, max_score, mask=in_group)
        tl.store(stats_ptr + row * 2 + 1, denominator, mask=in_group)
        tl.store(partial_ptr + row[:, None] * HEAD_DIM + dims[None, :], acc, mask=head_dim_mask)
    else:
        out = acc / denominator[:, None]
        tl.store(
            out_ptr + token * stride_ot + heads[:, None] * stride_oh + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=head_dim_mask,
        )


@triton.jit
def _merge_partitions_kernel(
    out_ptr,
    partial_ptr,
    stats_ptr,
    stride_ot,
    stride_oh,
    num_partitions,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    PARTITIONS_PADDED: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    parts = tl.arange(0, PARTITIONS_PADDED)
    in_parts = parts < num_partitions
    dims = tl.arange(0, HEAD_DIM_PADDED)
    in_dim = dims < HEAD_DIM
    rows = (token * tl.num_programs(1) + head) * num_partitions + parts
    maxes = tl.load(stats_ptr + rows * 2, mask=in_parts, other=float("-inf"))
    sums = tl.load(stats_ptr + rows * 2 + 1, mask=in_parts, other=0.0)
    overall = tl.max(maxes, axis=0)
    weights = tl.where(in_parts & (sums > 0), tl.exp(maxes - overall), 0.0)
    partial = tl.load(
        partial_ptr + rows[:, None] * HEAD_DIM + dims[None, :], mask=in_parts[:, None] & in_dim[None, :], other=0.0
    )
    out = tl.sum(partial * weights[:, None], axis=0) / tl.sum(sums * weights, axis=0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty), mask=in_dim)


# Contexts longer than this many blocks are split across programs (flash-decoding): a single
# program walking a long context one block at a time keeps too few loads in flight to use a
# GPU's memory bandwidth.
PARTITION_BLOCKS = 32
# A fixed grid (a captured graph's) splits every context into at most this many partitions.
MAX_STATIC_PARTITIONS = 16


def static_partitions(max_blocks: int) -> tuple[int, int]:
    """A grid fixed for any context of up to ``max_blocks`` blocks, chosen once (at graph capture) instead of
    from each step's longest context: (partition count, blocks per partition). Partitions past a sequence's
    end cost a program that exits at once; the merge ignores them."""
    partition_blocks = max(PARTITION_BLOCKS, -(-max_blocks // MAX_STATIC_PARTITIONS))
    return -(-max_blocks // partition_blocks), partition_blocks


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    kv_scales: tuple[float, float] = NO_SCALES,
    partition_blocks: int = PARTITION_BLOCKS,
) -> torch.Tensor:
    """Same contract as ``reference.paged_attention``; each token's sequence and position come from the
    metadata (``token_seqs``, ``token_positions``: written once per step). The grid's context partitions are
    the metadata's fixed ``partitions`` where it has them (``static_partitions``: nothing read from the
    step's values), else enough of ``partition_blocks`` blocks for the step's longest context."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    block_size = k_cache.shape[1]
    output = torch.empty_like(query)
    if num_tokens == 0:
        return output
    group = num_heads // num_kv_heads
    longest_blocks = -(-max(metadata.context_lens) // block_size)
    if metadata.partitions is not None:
        num_partitions, partition_blocks = metadata.partitions
        if num_partitions * partition_blocks < longest_blocks:
            raise ValueError(f"{metadata.partitions} partitions of blocks do not cover {longest_blocks} blocks")
    else:
        num_partitions = -(-longest_blocks // partition_blocks)
    split = num_partitions > 1
    if split:
        partial = torch.empty(
            (num_tokens * num_heads * num_partitions, head_dim), dtype=torch.float32, device=query.device
        )
        stats = torch.empty((num_tokens * num_heads * num_partitions, 2), dtype=torch.float32, device=query.device)
    else:
        partial = stats = output  # unused
    head_dim_padded = triton.next_power_of_2(head_dim)
    _paged_attention_kernel[(num_tokens, num_kv_heads, num_partitions)](
        output,
        partial,
        stats,
        query,
        k_cache,
        v_cache,
        metadata.block_tables,
        metadata.token_seqs,
        metadata.token_positions,
        scale,
        query.stride(0),
        query.stride(1),
        output.stride(0),
        output.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        metadata.block_tables.stride(0),
        num_partitions,
        *(kv_scales if k_cache.dtype in FP8_DTYPES else NO_SCALES),  # other dtypes ignore the scales
        GROUP=group,
        GROUP_PADDED=triton.next_power_of_2(group),
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=head_dim_padded,
        BLOCK_SIZE=block_size,
        BLOCK_SIZE_PADDED=triton.next_power_of_2(block_size),
        PARTITION_BLOCKS=partition_blocks,
        SPLIT=split,
    )
    if split:
        _merge_partitions_kernel[(num_tokens, num_heads)](
            output,
            partial,
            stats,
            output.stride(0),
            output.stride(1),
            num_partitions,
            HEAD_DIM=head_dim,
            HEAD_DIM_PADDED=head_dim_padded,
            PARTITIONS_PADDED=triton.next_power_of_2(num_partitions),
        )
    return output
