"""The mixture-of-experts paths agree: a per-token loop (the plainest statement of the maths), the
torch oracle, the CPU grouped path and the Triton kernel (in Triton's interpreter, on CPU)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernel module is imported: run on CPU

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import moe
from pdserve.kernels import triton_moe as tri


def _per_token(hidden, w13, w2, weights, ids):
    out = torch.zeros_like(hidden)
    for token in range(hidden.shape[0]):
        for choice in range(ids.shape[1]):
            expert = int(ids[token, choice])
            gate, up = (hidden[token] @ w13[expert]).chunk(2)
            out[token] += weights[token, choice] * ((F.silu(gate) * up) @ w2[expert])
    return out


def _problem(seed: int, tokens: int, experts: int, top_k: int, hidden: int, inter: int, renormalize: bool):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=generator)
    w13 = torch.randn(experts, hidden, 2 * inter, generator=generator) * hidden**-0.5
    w2 = torch.randn(experts, inter, hidden, generator=generator) * inter**-0.5
    logits = torch.randn(tokens, experts, generator=generator) * 2
    weights, ids = moe.select_experts(logits, top_k, renormalize)
    return x, w13, w2, weights, ids


# (tokens, experts, top_k, hidden, inter, renormalize): a decode step of one token, experts left
# without tokens, more tokens than a block, hidden and inter sizes that are not block multiples.
CASES = [
    (1, 4, 1, 32, 16, True),
    (3, 16, 2, 48, 24, False),
    (37, 8, 2, 64, 40, True),
    (20, 16, 4, 40, 72, False),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_reference_grouped_and_triton_agree_with_a_per_token_loop(case):
    x, w13, w2, weights, ids = _problem(0, *case)
    expected = _per_token(x, w13, w2, weights, ids)
    torch.testing.assert_close(moe.experts_reference(x, w13, w2, weights, ids), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(moe.grouped_experts(x, w13, w2, weights, ids), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tri.fused_experts(x, w13, w2, weights, ids), expected, atol=1e-5, rtol=1e-5)


def test_routing_matches_the_definition():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 3.5, -2.0, 0.5]])
    probabilities = torch.softmax(logits, dim=-1)
    weights, ids = moe.select_experts(logits, 2, renormalize=False)
    assert ids.tolist() == [[1, 2], [1, 0]]
    torch.testing.assert_close(weights, probabilities.gather(1, ids))
    normalised, _ = moe.select_experts(logits, 2, renormalize=True)
    torch.testing.assert_close(normalised.sum(dim=-1), torch.ones(2))


def test_alignment_gives_each_block_one_expert_and_every_row_once():
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 2], [1, 3]])
    rows, block_experts = tri.align_by_expert(ids, num_experts=5, block_m=4)
    flat = ids.flatten()
    real = rows[rows < flat.numel()]
    assert sorted(real.tolist()) == list(range(flat.numel()))
    for block, expert in enumerate(block_experts.tolist()):
        block_rows = rows[block * 4 : (block + 1) * 4]
        block_rows = block_rows[block_rows < flat.numel()]
        if expert < 0:
            assert block_rows.numel() == 0
        else:
            assert (flat[block_rows.long()] == expert).all()
    # Expert 3 has five rows: two blocks; experts 0, 1, 2 one each; expert 4 none.
    assert sorted(e for e in block_experts.tolist() if e >= 0) == [0, 1, 2, 3, 3]
