"""The GPU's mixture-of-experts path: a grouped matmul in Triton, both expert projections run as
one launch each over all experts. Same weight layout and results as ``moe.experts_reference``.

The (token, choice) pairs are sorted by expert and each expert's run padded to a whole number of
``BLOCK_M`` rows (``align_by_expert``), so every row block of the sorted order belongs to one
expert: a program multiplies one such block (its rows gathered from the activations) by one
column block of that expert's weights. The first launch computes gate and up for every pair, the
activation runs in torch, the second launch computes down and scales each row by its routing
weight; the top-k rows of a token are summed last. Blocks past the last expert's run exit at once
(the block count is an upper bound, so nothing waits on the GPU to size the grid).

``TRITON_INTERPRET=1`` must be set before this module is imported to run it on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.activation import swiglu

BLOCK_M = 16  # rows (token choices) per program: decode steps route few tokens to each expert
BLOCK_N = 64
BLOCK_K = 32


@triton.jit
def _expert_matmul_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    row_weights_ptr,
    sorted_rows_ptr,
    block_experts_ptr,
    num_rows,
    N,
    K,
    stride_am,
    stride_ak,
    stride_be,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    ROWS_PER_A_ROW: tl.constexpr,  # top_k when A holds one row per token, 1 when one per choice
    SCALE_ROWS: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block)
    if expert < 0:
        return
    rows = tl.load(sorted_rows_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = rows < num_rows  # padding rows hold num_rows
    a_rows = (rows // ROWS_PER_A_ROW).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = cols < N
    b_base = b_ptr + expert.to(tl.int64) * stride_be
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        in_k = ks < K
        a = tl.load(
            a_ptr + a_rows[:, None] * stride_am + ks[None, :] * stride_ak,
            mask=valid[:, None] & in_k[None, :],
            other=0.0,
        )
        b = tl.load(
            b_base + ks[:, None] * stride_bk + cols[None, :] * stride_bn,
            mask=in_k[:, None] & in_n[None, :],
            other=0.0,
        )
        if IEEE:  # float32 weights: full precision, not TF32 (outputs must match the CPU path's)
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    if SCALE_ROWS:
        acc = acc * tl.load(row_weights_ptr + rows, mask=valid, other=0.0)[:, None]
    tl.store(
        c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :] * stride_cn,
        acc.to(c_ptr.dtype.element_ty),
        mask=valid[:, None] & in_n[None, :],
    )


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_rows, block_experts): the flattened (token, choice) rows in expert order, each
    expert's run padded with the sentinel ``ids.numel()`` to a multiple of ``block_m``; and each
    ``block_m`` block's expert (-1 past the last run). Sized by an upper bound, without a sync."""
    flat = ids.flatten()
    num_rows = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    run_ends = torch.cumsum(padded, 0)
    order = flat.argsort(stable=True)
    experts = flat[order]
    rank_in_run = torch.arange(num_rows, device=ids.device) - (torch.cumsum(counts, 0) - counts)[experts]
    capacity = triton.cdiv(num_rows + num_experts * (block_m - 1), block_m) * block_m
    sorted_rows = torch.full((capacity,), num_rows, dtype=torch.int32, device=ids.device)
    sorted_rows[run_ends[experts] - padded[experts] + rank_in_run] = order.to(torch.int32)
    block_starts = torch.arange(0, capacity, block_m, device=ids.device)
    block_experts = torch.searchsorted(run_ends, block_starts, right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1).to(torch.int32)
    return sorted_rows, block_experts


def _expert_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    sorted_rows: torch.Tensor,
    block_experts: torch.Tensor,
    rows_per_a_row: int,
    row_weights: torch.Tensor | None,
) -> None:
    num_rows, n = out.shape
    grid = (block_experts.numel(), triton.cdiv(n, BLOCK_N))
    _expert_matmul_kernel[grid](
        a,
        b,
        out,
        out if row_weights is None else row_weights,
        sorted_rows,
        block_experts,
        num_rows,
        n,
        b.shape[1],
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        b.stride(2),
        out.stride(0),
        out.stride(1),
        ROWS_PER_A_ROW=rows_per_a_row,
        SCALE_ROWS=row_weights is not None,
        IEEE=a.dtype == torch.float32,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
    )


def fused_experts(
    hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """As ``moe.experts_reference``: ``[tokens, hidden]``."""
    num_tokens, top_k = ids.shape
    num_experts, hidden_size, two_inter = w13.shape
    sorted_rows, block_experts = align_by_expert(ids, num_experts, BLOCK_M)
    gate_up = hidden.new_empty(num_tokens * top_k, two_inter)
    _expert_matmul(hidden, w13, gate_up, sorted_rows, block_experts, top_k, None)
    activated = swiglu(gate_up)
    out = hidden.new_empty(num_tokens * top_k, hidden_size)
    _expert_matmul(activated, w2, out, sorted_rows, block_experts, 1, weights.flatten().contiguous())
    return out.view(num_tokens, top_k, hidden_size).sum(dim=1)
