"""Torch reference ops over paged KV: the CPU path, and the oracle for the Triton kernels.

A layer's K (or V) cache is a tensor ``[num_blocks, block_size, num_kv_heads, head_dim]``, any
strides (the engine keeps all layers in one block-major tensor, so these are views). A batch
mixes any number of sequences, each contributing ``query_len`` new tokens after
``context_len - query_len`` tokens already in its blocks (a prefix-cache hit, an earlier chunk,
or earlier decodes); attention is causal inside each chunk.

Decodes (query_len 1) are computed together, one KV head at a time: gather that head's blocks of
every decoding sequence into one buffer, then two batched matmuls over the sequences. With the
engine's head-major block layout (each head's ``[block_size, head_dim]`` slab of a block is
contiguous) the gather copies whole slabs and its result is already in matmul layout; nothing is
transposed or copied twice. Prefill chunks are computed one sequence at a time (a handful per
step), each as one SDPA call. No loop runs per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.kernels.metadata import AttentionMetadata

# 8-bit float caches store K / k_scale and V / v_scale (a scale per layer: ``Attention.kv_scales``) and are
# read back times the scale; other dtypes ignore the scales. float8_e4m3fn saturates at +-448 (torch's
# conversion clamps).
FP8_DTYPES = (torch.float8_e4m3fn,)
NO_SCALES = (1.0, 1.0)


def stored(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """``x`` as a cache of ``dtype`` stores it."""
    return (x / scale).to(dtype) if dtype in FP8_DTYPES else x.to(dtype)


def widened(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Cache values ``x`` read back in ``dtype``."""
    if x.dtype in FP8_DTYPES:
        return x.to(dtype).mul_(scale)
    return x.to(dtype)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    kv_scales: tuple[float, float] = NO_SCALES,
) -> None:
    """Store the new tokens' K and V ``[num_tokens, num_kv_heads, head_dim]`` in their slots (rounded to
    the cache's dtype where it stores another; divided by the layer's scales into an 8-bit cache)."""
    k_cache[metadata.slot_block_ids, metadata.slot_offsets] = stored(key, k_cache.dtype, kv_scales[0])
    v_cache[metadata.slot_block_ids, metadata.slot_offsets] = stored(value, v_cache.dtype, kv_scales[1])


def _gather_context(
    cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int, dtype: torch.dtype, scale: float
) -> torch.Tensor:
    """[num_tokens, num_kv_heads, head_dim] of one sequence, in position order, in ``dtype``."""
    block_size = cache.shape[1]
    num_blocks = -(-num_tokens // block_size)
    blocks = cache[block_table[:num_blocks]]
    return widened(blocks.reshape(num_blocks * block_size, *cache.shape[2:])[:num_tokens], dtype, scale)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    kv_scales: tuple[float, float] = NO_SCALES,
) -> torch.Tensor:
    """Attention of each new token ``query [num_tokens, num_heads, head_dim]`` over its sequence's
    context in the cache (its own K/V must already be written). Returns the query's shape."""
    output = torch.empty_like(query)
    if len(metadata.decode_seq_indices):
        decode_attention(query, k_cache, v_cache, metadata, scale, output, kv_scales)
    prefill_attention(query, k_cache, v_cache, metadata, scale, output, kv_scales)
    return output


def prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    output: torch.Tensor,
    kv_scales: tuple[float, float] = NO_SCALES,
) -> None:
    """The prefill chunks' part of ``paged_attention``, written into ``output``."""
    group = query.shape[1] // k_cache.shape[2]
    for seq in metadata.prefill_seq_indices:
        start, end = metadata.query_start_loc[seq], metadata.query_start_loc[seq + 1]
        query_len = end - start
        context_len = metadata.context_lens[seq]
        keys = _gather_context(k_cache, metadata.block_tables[seq], context_len, query.dtype, kv_scales[0])
        values = _gather_context(v_cache, metadata.block_tables[seq], context_len, query.dtype, kv_scales[1])
        q = query[start:end].transpose(0, 1).unsqueeze(0)  # [1, heads, query_len, head_dim]
        k = keys.transpose(0, 1).unsqueeze(0)
        v = values.transpose(0, 1).unsqueeze(0)
        num_cached = context_len - query_len
        if num_cached == 0:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=group > 1)
        else:
            # Query i sits at position num_cached + i and sees keys up to there.
            visible = (
                torch.arange(context_len, device=query.device)[None, :]
                <= torch.arange(num_cached, context_len, device=query.device)[:, None]
            )
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale, enable_gqa=group > 1)
        output[start:end] = out[0].transpose(0, 1)


def decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    output: torch.Tensor,
    kv_scales: tuple[float, float] = NO_SCALES,
) -> None:
    """The decodes' part of ``paged_attention``, written into ``output``."""
    num_kv_heads, head_dim, block_size = k_cache.shape[2], k_cache.shape[3], k_cache.shape[1]
    group = query.shape[1] // num_kv_heads
    block_ids = metadata.decode_block_ids
    rows = metadata.decode_token_indices
    num_decodes = len(rows)
    span = len(block_ids) // num_decodes * block_size
    # Masked slots may hold stale KV of other requests: -inf keeps them out (the cache is
    # zero-initialised, so no slot holds NaN that a zero weight could not cancel).
    padding = (torch.arange(span, device=query.device) >= metadata.decode_context_lens[:, None])[:, None, :]
    queries = query[rows]  # [D, heads, head_dim]
    out = torch.empty_like(queries)
    # Gathered in the cache's dtype; a cache that stores another dtype than the query's is widened after.
    keys = torch.empty((len(block_ids), k_cache.shape[1], head_dim), dtype=k_cache.dtype, device=query.device)
    values = torch.empty_like(keys)
    for head in range(num_kv_heads):
        torch.index_select(k_cache[:, :, head], 0, block_ids, out=keys)
        torch.index_select(v_cache[:, :, head], 0, block_ids, out=values)
        head_keys, head_values = widened(keys, query.dtype, kv_scales[0]), widened(values, query.dtype, kv_scales[1])
        heads = slice(head * group, (head + 1) * group)  # the query heads sharing this KV head
        scores = torch.bmm(queries[:, heads], head_keys.view(num_decodes, span, head_dim).transpose(1, 2))
        scores.mul_(scale).masked_fill_(padding, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[:, heads] = torch.bmm(probs, head_values.view(num_decodes, span, head_dim))
    output[rows] = out


def dense_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """Plain causal attention over one whole sequence ``[seq_len, heads, head_dim]`` (K/V with
    kv heads), with no paging or batching: the naive oracle for the paged ops."""
    group = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(group, dim=1)
    value = value.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query, key) * scale
    seq_len = query.shape[0]
    mask = torch.ones(seq_len, seq_len, dtype=torch.bool, device=query.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), value)
