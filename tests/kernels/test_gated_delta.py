"""Gated DeltaNet's sequence mixing: our chunked and recurrent gated delta rule agree with each other
and with transformers' torch implementations (Qwen3.5's fallback path), with and without an initial
state, across chunk boundaries, with fewer key heads than value heads; a prompt split into pieces
(chunked prefill) carries its state to the same result; the convolution's rolling state likewise; the
fused CPU kernel does what both do, for a whole batch at once."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import cpu_kernels, gated_delta
from pdserve.kernels.metadata import build_attention_metadata

hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")


def _inputs(seed: int, tokens: int, key_heads: int, value_heads: int, key_dim: int, value_dim: int):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, key_heads, key_dim, generator=generator)
    k = torch.randn(tokens, key_heads, key_dim, generator=generator)
    v = torch.randn(tokens, value_heads, value_dim, generator=generator)
    # As Qwen3.5 makes them: g = -exp(A_log) * softplus(a + dt_bias) <= 0, beta = sigmoid(b).
    g = -torch.rand(value_heads, generator=generator).mul(4).exp() * F.softplus(
        torch.randn(tokens, value_heads, generator=generator)
    )
    beta = torch.randn(tokens, value_heads, generator=generator).sigmoid()
    state = torch.randn(value_heads, key_dim, value_dim, generator=generator) * 0.1
    return q, k, v, g, beta, state


SHAPES = [  # (tokens, key_heads, value_heads, key_dim, value_dim)
    (1, 2, 2, 16, 16),
    (63, 2, 4, 16, 8),
    (130, 1, 2, 32, 16),
]


def _theirs(q, k, v, g, beta, state, chunked: bool):
    args = (q[None], k[None], v[None])
    kwargs = dict(g=g[None], beta=beta[None], initial_state=state[None], output_final_state=True)
    if chunked:
        out, final = hf.torch_chunk_gated_delta_rule(*args, use_qk_l2norm_in_kernel=True, **kwargs)
    else:
        out, final = hf.torch_recurrent_gated_delta_rule(*args, use_qk_l2norm_in_kernel=True, **kwargs)
    return out[0], final[0]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("initial", ["zero", "carried"])
def test_chunked_form_equals_transformers(shape, initial):
    q, k, v, g, beta, state = _inputs(1, *shape)
    if initial == "zero":
        state.zero_()
    expected_out, expected_state = _theirs(q, k, v, g, beta, state, chunked=True)
    ours_state = state.clone()
    out = gated_delta.chunked_gated_delta_rule(q, k, v, g, beta, ours_state, chunk_size=32)
    torch.testing.assert_close(out, expected_out, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(ours_state, expected_state, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_recurrent_form_token_by_token_equals_the_chunked_form_and_transformers(shape):
    q, k, v, g, beta, state = _inputs(2, *shape)
    recurrent_out, recurrent_state = _theirs(q, k, v, g, beta, state, chunked=False)
    states = state.clone()[None]  # a batch of one sequence, one token per step
    outs = [
        gated_delta.recurrent_gated_delta_rule(
            q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], states
        )
        for t in range(q.shape[0])
    ]
    torch.testing.assert_close(torch.cat(outs), recurrent_out, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(states[0], recurrent_state, atol=1e-5, rtol=1e-4)
    chunked_state = state.clone()
    chunked = gated_delta.chunked_gated_delta_rule(q, k, v, g, beta, chunked_state)
    torch.testing.assert_close(chunked, recurrent_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(chunked_state, recurrent_state, atol=1e-4, rtol=1e-4)


def test_a_batch_of_decodes_is_each_sequence_alone():
    sequences = [_inputs(seed, 1, 2, 4, 16, 8) for seed in range(5)]
    stacked = [torch.cat([s[i] for s in sequences]) for i in range(5)]
    states = torch.stack([s[5] for s in sequences])
    out = gated_delta.recurrent_gated_delta_rule(*stacked, states)
    for index, (q, k, v, g, beta, state) in enumerate(sequences):
        alone = gated_delta.recurrent_gated_delta_rule(q, k, v, g, beta, state[None].clone())
        torch.testing.assert_close(out[index : index + 1], alone)


def test_a_prompt_in_pieces_carries_its_state():
    q, k, v, g, beta, state = _inputs(3, 100, 2, 4, 16, 8)
    whole_state = state.clone()
    whole = gated_delta.chunked_gated_delta_rule(q, k, v, g, beta, whole_state)
    piece_state, pieces = state.clone(), []
    for start, end in ((0, 16), (16, 17), (17, 70), (70, 100)):  # a scheduler's chunks, one of a single token
        part = slice(start, end)
        pieces.append(gated_delta.chunked_gated_delta_rule(q[part], k[part], v[part], g[part], beta[part], piece_state))
    torch.testing.assert_close(torch.cat(pieces), whole, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(piece_state, whole_state, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("width", [2, 4])
def test_convolution_with_rolling_state_equals_transformers(width):
    generator = torch.Generator().manual_seed(width)
    channels, tokens = 12, 9
    x = torch.randn(tokens, channels, generator=generator)
    weight = torch.randn(channels, width, generator=generator)
    expected = hf.causal_conv1d_fn(x.t()[None], weight, None, activation="silu")[0].t()
    state = torch.zeros(channels, width - 1)
    torch.testing.assert_close(gated_delta.causal_conv1d(x[:5], weight, state), expected[:5])
    # The rest in two pieces: a one-token piece (shorter than the state) and a decode step.
    torch.testing.assert_close(gated_delta.causal_conv1d(x[5:6], weight, state), expected[5:6])
    torch.testing.assert_close(gated_delta.causal_conv1d(x[6:8], weight, state), expected[6:8])
    torch.testing.assert_close(state, x[8 - (width - 1) : 8].t())  # the last inputs, oldest first
    states = state[None].clone()
    torch.testing.assert_close(gated_delta.causal_conv1d_step(x[8:9], weight, states), expected[8:9])
    torch.testing.assert_close(states[0], x[9 - (width - 1) : 9].t())


@pytest.mark.usefixtures("kernel_variant")
# Value dims 24, 8 and 80: column blocks of a vector register's width, then single columns, in different mixes.
@pytest.mark.parametrize(
    ("key_heads", "value_heads", "width", "value_dim"), [(2, 4, 4, 24), (1, 3, 2, 8), (2, 2, 4, 80)]
)
def test_the_fused_cpu_kernel_equals_transformers_for_decodes_and_prompt_chunks_in_one_batch(
    key_heads, value_heads, width, value_dim
):
    """Decodes and prompt chunks of several lengths in one call, their states in scattered slots of
    strided views (as in the KV cache's rows): outputs and states as transformers' convolution and
    recurrent rule give them, sequence by sequence; the slots not in the batch untouched."""
    generator = torch.Generator().manual_seed(width + value_heads)
    key_dim = 16
    channels = 2 * key_heads * key_dim + value_heads * value_dim
    spans, slots = [1, 40, 1, 17, 70, 1], [5, 0, 3, 6, 2, 1]  # slot 4 is nobody's
    tokens = sum(spans)
    wide = torch.randn(tokens, channels + 7, generator=generator)
    qkv = wide[:, :channels]  # rows strided, as a split of the fused projection
    weight = torch.randn(channels, width, generator=generator)
    g = -torch.rand(value_heads, generator=generator).mul(4).exp() * F.softplus(
        torch.randn(tokens, value_heads, generator=generator)
    )
    beta = torch.randn(tokens, value_heads, generator=generator).sigmoid()
    conv_bytes, state_size = channels * (width - 1), value_heads * key_dim * value_dim
    rows = torch.randn(7, conv_bytes + state_size + 5, generator=generator) * 0.1
    state = (
        rows[:, :conv_bytes].view(7, channels, width - 1),
        rows[:, conv_bytes : conv_bytes + state_size].view(7, value_heads, key_dim, value_dim),
    )
    before = rows.clone()
    metadata = build_attention_metadata(spans, spans, [[0] * 5] * len(spans), block_size=16)
    metadata.state_slots = torch.tensor(slots)
    out = torch.empty(tokens, value_heads, value_dim)
    assert cpu_kernels.gated_delta_net(out, qkv, weight, state, metadata, g, beta, key_heads)

    key_size = key_heads * key_dim
    for index, (slot, span) in enumerate(zip(slots, spans, strict=True)):
        part = slice(metadata.query_start_loc[index], metadata.query_start_loc[index + 1])
        conv_state = before[slot, :conv_bytes].view(channels, width - 1).clone()
        mixed = gated_delta.causal_conv1d(qkv[part], weight, conv_state)
        q, k, v = mixed.split([key_size, key_size, value_heads * value_dim], dim=-1)
        initial = before[slot, conv_bytes : conv_bytes + state_size].view(value_heads, key_dim, value_dim)
        expected_out, expected_state = _theirs(
            q.view(span, key_heads, key_dim),
            k.view(span, key_heads, key_dim),
            v.view(span, value_heads, value_dim),
            g[part],
            beta[part],
            initial.clone(),
            chunked=False,
        )
        torch.testing.assert_close(out[part], expected_out, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(state[0][slot], conv_state)
        torch.testing.assert_close(state[1][slot], expected_state, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(rows[4], before[4], atol=0, rtol=0)
    torch.testing.assert_close(rows[:, -5:], before[:, -5:], atol=0, rtol=0)


@pytest.mark.usefixtures("kernel_variant")
def test_the_fused_cpu_kernel_refuses_a_slot_out_of_range():
    key_heads, value_heads, key_dim, value_dim, width = 1, 1, 8, 8, 4
    channels = 2 * key_heads * key_dim + value_heads * value_dim
    state = (torch.zeros(2, channels, width - 1), torch.zeros(2, value_heads, key_dim, value_dim))
    metadata = build_attention_metadata([1], [1], [[0]], block_size=16)
    metadata.state_slots = torch.tensor([2])
    out = torch.empty(1, value_heads, value_dim)
    qkv, weight, g, beta = torch.randn(1, channels), torch.randn(channels, width), torch.zeros(1, 1), torch.ones(1, 1)
    with pytest.raises(RuntimeError, match="no span or no slot"):
        cpu_kernels.gated_delta_net(out, qkv, weight, state, metadata, g, beta, key_heads)
