"""Mixture-of-experts computation in torch: routing, the oracle, and the CPU path.

A routed MLP layer sends each token to ``top_k`` of ``E`` experts and sums their outputs, each
weighted by the router's probability. Expert weights are stored stacked and transposed, as our
Linear keeps its weight: ``w13[e]`` is expert e's gate and up projections side by side,
``[hidden, 2 * inter]``, and ``w2[e]`` its down projection, ``[inter, hidden]``.

- ``select_experts``: the router's choice, as transformers' Qwen3-MoE and Mixtral routers make it
  (softmax in float32 over all experts, top-k, optionally renormalised over the chosen ones).
- ``experts_reference``: the oracle, written for clarity: every (token, choice) pair gathers its
  expert's weights and multiplies them (memory grows with tokens × top_k × weights: tests only).
- ``grouped_experts``: the CPU path. The (token, choice) pairs are sorted by expert, so each expert
  runs its two matmuls once per step over all of its tokens; the Python loop is over the experts
  that have tokens, never over tokens.

The Triton kernel for the GPU is in ``triton_moe``; all three agree (tests/kernels/test_moe.py).
"""

from __future__ import annotations

import torch

from pdserve.kernels import cpu_kernels
from pdserve.kernels.activation import swiglu


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights ``[tokens, top_k]`` in the logits' dtype, expert ids ``[tokens, top_k]``)."""
    probabilities = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probabilities, top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


def experts_reference(
    hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """``[tokens, hidden]``: the weighted sum of each token's chosen experts' outputs."""
    gate_up = torch.einsum("th,tkhi->tki", hidden, w13[ids])
    out = torch.einsum("tki,tkih->tkh", swiglu(gate_up), w2[ids])
    return (out * weights.unsqueeze(-1)).sum(dim=1)


def grouped_experts(
    hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """As ``experts_reference``, each expert's matmuls once over its tokens. ``w13`` and ``w2`` are
    stacked as above, or each expert's packed by ``cpu_kernels.pack_weight`` (``[E, panels, in,
    PANEL]``: the CPU kernel's layout)."""
    top_k = ids.shape[1]
    inter = w2.shape[-2]
    flat_ids = ids.flatten()
    order = flat_ids.argsort(stable=True)  # (token, choice) pairs, expert by expert
    tokens = order // top_k
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    rows = hidden[tokens]
    out = torch.empty_like(rows)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            end = start + count
            gate_up = _expert_matmul(rows[start:end], w13, expert, 2 * inter)
            out[start:end] = _expert_matmul(swiglu(gate_up), w2, expert, hidden.shape[1])
            start = end
    out.mul_(weights.flatten()[order].unsqueeze(-1))
    # Summed into each token in expert order, as transformers does: the same float rounding.
    return torch.zeros_like(hidden).index_add_(0, tokens, out)


def _expert_matmul(rows: torch.Tensor, weight: torch.Tensor, expert: int, out_features: int) -> torch.Tensor:
    if weight.dim() == 4:  # packed
        return cpu_kernels.packed_linear(rows, weight[expert], out_features)
    return torch.mm(rows, weight[expert])
