"""The CPU kernels for linear layers over packed weights (``cpu_kernels.packed_linear``) and SwiGLU against
torch's ops, and the layers that use them against their unpacked selves."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import cpu_kernels, moe
from pdserve.kernels.activation import swiglu
from pdserve.models.linear import Linear
from pdserve.models.parallel import TensorParallel
from pdserve.models.transformer import VocabParallelEmbedding

pytestmark = pytest.mark.usefixtures("kernel_variant")  # every shipped variant the CPU runs (conftest.py)


# Rows: one, tails of a register tile (3 rows a tile with AVX2, 6 with AVX-512), more than a work
# item's chunk of rows, and a prompt-sized count. Output features: whole panels, a panel and a
# bit, fewer than a panel.
@pytest.mark.parametrize("rows", [1, 2, 5, 7, 13, 97, 300])
@pytest.mark.parametrize(("in_features", "out_features"), [(64, 96), (33, 40), (128, 7), (17, 1)])
def test_packed_linear_equals_matmul(rows, in_features, out_features):
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight_t = torch.randn(in_features, out_features, generator=generator)
    x = torch.randn(rows, in_features, generator=generator)
    packed = cpu_kernels.pack_weight(weight_t)
    panel = cpu_kernels.cpu_ops().PANEL
    assert packed.shape == (-(-out_features // panel), in_features, panel)
    torch.testing.assert_close(cpu_kernels.packed_linear(x, packed, out_features), x @ weight_t, atol=1e-4, rtol=1e-5)


def test_packed_linear_takes_no_rows_and_strided_input():
    weight_t = torch.randn(16, 40)
    packed = cpu_kernels.pack_weight(weight_t)
    assert cpu_kernels.packed_linear(torch.empty(0, 16), packed, 40).shape == (0, 40)
    wide = torch.randn(5, 32)
    torch.testing.assert_close(cpu_kernels.packed_linear(wide[:, ::2], packed, 40), wide[:, ::2] @ weight_t)


def test_packed_linear_refuses_a_weight_of_another_shape():
    with pytest.raises(RuntimeError, match="do not match"):
        cpu_kernels.packed_linear(torch.randn(2, 8), cpu_kernels.pack_weight(torch.randn(16, 40)), 40)


def test_packed_rows_are_the_weight_rows_and_ids_are_checked():
    weight = torch.randn(70, 24)  # [out, in]: an embedding table
    packed = cpu_kernels.pack_weight(weight.t())
    ids = torch.tensor([[0, 69, 31], [32, 33, 5]])
    assert torch.equal(cpu_kernels.packed_rows(packed, 70, ids), weight[ids])
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_kernels.packed_rows(packed, 70, torch.tensor([70]))  # a padding row of the last panel


def test_a_packed_linear_layer_equals_itself_unpacked_and_drops_the_unpacked_weight():
    layer = Linear(48, 72, bias=True)
    torch.nn.init.normal_(layer.weight_t)
    torch.nn.init.normal_(layer.bias)
    x = torch.randn(9, 48)
    expected = layer(x)
    layer.pack_for_cpu()
    assert not hasattr(layer, "weight_t") and [name for name, _ in layer.named_parameters()] == ["bias"]
    torch.testing.assert_close(layer(x), expected, atol=1e-4, rtol=1e-5)


def test_a_packed_embedding_looks_up_and_gives_logits_as_before():
    table = VocabParallelEmbedding(100, 40, TensorParallel())
    torch.nn.init.normal_(table.weight)
    ids, hidden = torch.tensor([3, 99, 0, 64]), torch.randn(4, 40)
    looked_up, logits = table(ids), table.local_logits(hidden)
    table.pack_for_cpu()
    assert not hasattr(table, "weight")
    assert torch.equal(table(ids), looked_up)
    torch.testing.assert_close(table.local_logits(hidden), logits, atol=1e-4, rtol=1e-5)


def test_packed_experts_equal_stacked_experts():
    generator = torch.Generator().manual_seed(3)
    experts, hidden_size, inter, top_k = 6, 40, 24, 2
    w13 = torch.randn(experts, hidden_size, 2 * inter, generator=generator)
    w2 = torch.randn(experts, inter, hidden_size, generator=generator)
    x = torch.randn(11, hidden_size, generator=generator)
    weights, ids = moe.select_experts(torch.randn(11, experts, generator=generator), top_k, True)
    packed13 = torch.stack([cpu_kernels.pack_weight(w) for w in w13])
    packed2 = torch.stack([cpu_kernels.pack_weight(w) for w in w2])
    torch.testing.assert_close(
        moe.grouped_experts(x, packed13, packed2, weights, ids),
        moe.grouped_experts(x, w13, w2, weights, ids),
        atol=1e-3,
        rtol=1e-5,
    )


def test_fused_swiglu_equals_torch():
    gate_up = torch.randn(7, 2 * 48) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(swiglu(gate_up), torch.nn.functional.silu(gate) * up, atol=1e-5, rtol=1e-5)
    assert cpu_kernels.silu_mul(gate_up) is not None  # the fused path is the one measured above
