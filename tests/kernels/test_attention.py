"""Paged attention: the torch reference against naive dense attention, and the Triton kernels
(run by Triton's interpreter on CPU, at small shapes) against the reference."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels module is imported: run on CPU

import pytest
import torch

from pdserve.kernels import reference
from pdserve.kernels import triton_attention as tri
from pdserve.kernels.metadata import build_attention_metadata


def _batch(seed: int, num_kv_heads: int, group: int, head_dim: int, block_size: int, specs):
    """A random mixed batch. specs: (num_cached, query_len) per sequence."""
    gen = torch.Generator().manual_seed(seed)
    num_heads = num_kv_heads * group
    num_blocks = sum(-(-(c + q) // block_size) for c, q in specs) + 3
    # Unused slots hold finite garbage, as stale KV from other requests would.
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables, full_k, full_v, queries = [], [], [], []
    for num_cached, query_len in specs:
        total = num_cached + query_len
        table = [free.pop() for _ in range(-(-total // block_size))]
        tables.append(table)
        k = torch.randn(total, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(total, num_kv_heads, head_dim, generator=gen)
        for pos in range(num_cached):  # the cached prefix is already in the blocks
            k_cache[table[pos // block_size], pos % block_size] = k[pos]
            v_cache[table[pos // block_size], pos % block_size] = v[pos]
        full_k.append(k)
        full_v.append(v)
        queries.append(torch.randn(query_len, num_heads, head_dim, generator=gen))
    metadata = build_attention_metadata([q for _, q in specs], [c + q for c, q in specs], tables, block_size)
    new_k = torch.cat([k[c:] for k, (c, _) in zip(full_k, specs, strict=True)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(full_v, specs, strict=True)])
    return k_cache, v_cache, metadata, torch.cat(queries), new_k, new_v, full_k, full_v


# Mixed batches: decodes with long contexts, a fresh prefill, a chunk after a cached prefix.
SPECS = [(37, 1), (0, 9), (5, 1), (13, 6), (0, 1), (20, 1)]


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize(("head_dim", "block_size"), [(16, 4), (24, 16), (64, 16)])
def test_reference_paged_attention_equals_dense_attention(group, head_dim, block_size):
    k_cache, v_cache, metadata, query, new_k, new_v, full_k, full_v = _batch(
        group + head_dim, 2, group, head_dim, block_size, SPECS
    )
    reference.write_kv(new_k, new_v, k_cache, v_cache, metadata)
    scale = head_dim**-0.5
    out = reference.paged_attention(query, k_cache, v_cache, metadata, scale)
    for seq, (num_cached, query_len) in enumerate(SPECS):
        start = metadata.query_start_loc[seq]
        total = num_cached + query_len
        # Dense attention over the whole sequence; its last query_len rows are this chunk's.
        gen = torch.Generator().manual_seed(seq)
        earlier_queries = torch.randn(num_cached, query.shape[1], head_dim, generator=gen)
        full_q = torch.cat([earlier_queries, query[start : start + query_len]])
        dense = reference.dense_causal_attention(full_q, full_k[seq][:total], full_v[seq][:total], scale)
        torch.testing.assert_close(out[start : start + query_len], dense[num_cached:], atol=1e-5, rtol=1e-5)


def _engine_layout_views(k_cache, v_cache):
    """The engine's layout: [blocks, layers, 2, kv_heads, block_size, head_dim], layer 1's views."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    combined = torch.zeros(num_blocks, 3, 2, num_kv_heads, block_size, head_dim)
    k_view, v_view = combined[:, 1, 0].transpose(1, 2), combined[:, 1, 1].transpose(1, 2)
    k_view.copy_(k_cache)
    v_view.copy_(v_cache)
    return k_view, v_view


def test_reference_works_on_the_engines_strided_layout():
    k_cache, v_cache, metadata, query, new_k, new_v, _, _ = _batch(3, 2, 2, 16, 4, SPECS)
    k_view, v_view = _engine_layout_views(k_cache, v_cache)
    reference.write_kv(new_k, new_v, k_view, v_view, metadata)
    reference.write_kv(new_k, new_v, k_cache, v_cache, metadata)
    torch.testing.assert_close(k_view, k_cache)
    out_view = reference.paged_attention(query, k_view, v_view, metadata, 0.25)
    out_plain = reference.paged_attention(query, k_cache, v_cache, metadata, 0.25)
    torch.testing.assert_close(out_view, out_plain)


@pytest.mark.parametrize(("group", "head_dim", "block_size"), [(1, 16, 4), (2, 24, 16), (4, 32, 8)])
def test_triton_kernels_match_the_reference(group, head_dim, block_size):
    specs = [(9, 1), (0, 5), (3, 4), (17, 1)]
    k_cache, v_cache, metadata, query, new_k, new_v, _, _ = _batch(7 * group, 2, group, head_dim, block_size, specs)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    k_cache, v_cache = _engine_layout_views(k_cache, v_cache)  # the kernels take any strides
    reference.write_kv(new_k, new_v, ref_k, ref_v, metadata)
    tri.write_kv(new_k, new_v, k_cache, v_cache, metadata)
    torch.testing.assert_close(k_cache, ref_k, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, ref_v, atol=0, rtol=0)
    scale = head_dim**-0.5
    expected = reference.paged_attention(query, ref_k, ref_v, metadata, scale)
    actual = tri.paged_attention(query, k_cache, v_cache, metadata, scale)
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("group", "head_dim", "block_size"), [(1, 16, 4), (2, 24, 16), (4, 64, 16)])
def test_cpu_decode_kernel_matches_the_reference(group, head_dim, block_size, kernel_variant):
    from pdserve.kernels import cpu_kernels

    k_cache, v_cache, metadata, query, new_k, new_v, _, _ = _batch(11 * group, 2, group, head_dim, block_size, SPECS)
    k_cache, v_cache = _engine_layout_views(k_cache, v_cache)
    reference.write_kv(new_k, new_v, k_cache, v_cache, metadata)
    expected = reference.paged_attention(query, k_cache, v_cache, metadata, 0.3)
    actual = cpu_kernels.paged_attention(query, k_cache, v_cache, metadata, 0.3)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_cpu_fused_add_rms_norm_matches_torch(kernel_variant):
    from pdserve.kernels import cpu_kernels

    gen = torch.Generator().manual_seed(5)
    x, residual, weight = (torch.randn(37, 96, generator=gen) for _ in range(3))
    weight = weight[0]

    def torch_norm(v):
        return weight * (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6))

    torch.testing.assert_close(cpu_kernels.rms_norm(x, weight, 1e-6), torch_norm(x))
    expected_sum = residual + x
    normed = cpu_kernels.rms_norm(x, weight, 1e-6, residual)
    torch.testing.assert_close(residual, expected_sum)  # updated in place: the next residual
    torch.testing.assert_close(normed, torch_norm(expected_sum))
    assert cpu_kernels.rms_norm(x.t(), weight[:37], 1e-6) is None  # not contiguous: caller uses torch


def test_cpu_fused_rope_and_kv_write_match_torch(kernel_variant):
    from pdserve.kernels import cpu_kernels
    from pdserve.models.rope import RotaryEmbedding, apply_rotary

    k_cache, v_cache, metadata, _, _, _, _, _ = _batch(9, 2, 2, 16, 4, SPECS)
    k_cache, v_cache = _engine_layout_views(k_cache, v_cache)
    num_tokens = metadata.query_start_loc[-1]
    gen = torch.Generator().manual_seed(9)
    qkv = torch.randn(num_tokens, (4 + 2 + 2) * 16, generator=gen)
    qk = qkv[:, : 6 * 16].view(num_tokens, 6, 16)  # 4 query heads and 2 kv heads, strided like the model's
    value = qkv[:, 6 * 16 :].view(num_tokens, 2, 16)
    positions = torch.cat(
        [
            torch.arange(c - q, c)
            for q, c in zip(
                [b - a for a, b in zip(metadata.query_start_loc, metadata.query_start_loc[1:], strict=False)],
                metadata.context_lens,
                strict=True,
            )
        ]
    )
    cos, sin = RotaryEmbedding(16, 128, 10000.0, {}).for_positions(positions)
    expected_qk = apply_rotary(qk, cos, sin)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    reference.write_kv(expected_qk[:, 4:], value, ref_k, ref_v, metadata)
    assert cpu_kernels.rope_write_kv(qk, value, cos, sin, k_cache, v_cache, metadata)
    torch.testing.assert_close(qk, expected_qk)  # rotated in place
    torch.testing.assert_close(k_cache, ref_k)
    torch.testing.assert_close(v_cache, ref_v)


def test_model_with_triton_kernels_matches_the_cpu_path(tmp_path):
    """The GPU code path end to end (Triton kernels, interpreted here) inside our model."""
    from pdserve.models.attention import triton_backend
    from pdserve.models.config import ModelConfig
    from pdserve.models.loader import load_model
    from pdserve.testing.hf_models import build_hf_model

    build_hf_model("Llama", {"num_attention_heads": 4, "num_key_value_heads": 2}, tmp_path)
    config = ModelConfig.from_folder(tmp_path)
    model = load_model(tmp_path, config, torch.float32, torch.device("cpu"), 64)
    block_size = 4
    metadata = build_attention_metadata([6, 1, 3], [6, 9, 7], [[0, 1], [2, 3, 4], [5, 6]], block_size)
    positions = torch.tensor([0, 1, 2, 3, 4, 5, 8, 4, 5, 6])
    tokens = torch.randint(0, 1000, (10,), generator=torch.Generator().manual_seed(1))

    def run(backend):
        for layer in model.layers:
            if backend is not None:
                layer.self_attn.backend = backend
        # Earlier context of the two sequences with cached prefixes: random but identical KV for both runs.
        cache = torch.randn(
            7,
            config.num_layers,
            2,
            config.num_kv_heads,
            block_size,
            config.head_dim,
            generator=torch.Generator().manual_seed(2),
        )
        views = [(cache[:, i, 0].transpose(1, 2), cache[:, i, 1].transpose(1, 2)) for i in range(config.num_layers)]
        with torch.no_grad():
            return model.compute_logits(model(tokens, positions, views, metadata))

    expected = run(None)
    torch.testing.assert_close(run(triton_backend()), expected, atol=1e-4, rtol=1e-4)


def test_triton_context_partitions_merge_exactly():
    # Tiny partitions force the split-and-merge path that long contexts take on a GPU.
    specs = [(37, 1), (0, 9), (13, 6), (70, 1)]
    k_cache, v_cache, metadata, query, new_k, new_v, _, _ = _batch(5, 2, 2, 16, 4, specs)
    reference.write_kv(new_k, new_v, k_cache, v_cache, metadata)
    expected = reference.paged_attention(query, k_cache, v_cache, metadata, 0.25)
    for partition_blocks in (1, 3):
        actual = tri.paged_attention(query, k_cache, v_cache, metadata, 0.25, partition_blocks=partition_blocks)
        torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)
    # A fixed grid, as a captured graph has: more partitions than any context here needs, most of them empty.
    for fixed in ((20, 1), (4, 6)):
        metadata.partitions = fixed
        actual = tri.paged_attention(query, k_cache, v_cache, metadata, 0.25)
        torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)
    metadata.partitions = (2, 3)  # 6 blocks: the 71-token context needs 18
    with pytest.raises(ValueError, match="do not cover 18 blocks"):
        tri.paged_attention(query, k_cache, v_cache, metadata, 0.25)


def test_a_static_grid_covers_every_context_in_a_bounded_number_of_partitions():
    assert tri.static_partitions(8) == (1, 32)
    assert tri.static_partitions(64) == (2, 32)
    assert tri.static_partitions(2048) == (16, 128)  # 32k tokens of 16: partitions grow instead of multiplying
    for max_blocks in range(1, 3000, 37):
        count, size = tri.static_partitions(max_blocks)
        assert count * size >= max_blocks and count <= tri.MAX_STATIC_PARTITIONS


# --kv-cache-dtype: a cache that stores 16-bit floats under a float32 model. Each path widens what it reads
# back to float32, so every path agrees with the others to float32 rounding over the same stored bits, and
# with an fp32 cache to the 16-bit rounding of K and V (bf16 keeps 8 bits of mantissa, fp16 11).
KV_DTYPE_TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 3e-3}


def _narrowed(k_cache, v_cache, kv_dtype):
    k_view, v_view = _engine_layout_views(k_cache, v_cache)
    return k_view.to(kv_dtype), v_view.to(kv_dtype)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("group", "head_dim", "block_size"), [(1, 16, 4), (4, 64, 16)])
def test_cpu_kernels_read_and_write_a_16_bit_cache(kv_dtype, group, head_dim, block_size, kernel_variant):
    from pdserve.kernels import cpu_kernels
    from pdserve.models.rope import RotaryEmbedding

    k_cache, v_cache, metadata, query, new_k, new_v, _, _ = _batch(5 * group, 2, group, head_dim, block_size, SPECS)
    wide_k, wide_v = _engine_layout_views(k_cache, v_cache)
    narrow_k, narrow_v = _narrowed(k_cache, v_cache, kv_dtype)
    assert narrow_k.dtype == kv_dtype
    # The fused rotary + KV write rounds as torch does: the same bits as the reference's write.
    positions = torch.tensor([c - 1 for c in metadata.context_lens])[: len(new_k)]
    positions = torch.arange(len(new_k)) % 8 if len(positions) != len(new_k) else positions
    cos, sin = RotaryEmbedding(head_dim, 128, 10000.0, {}).for_positions(positions)
    qk = torch.cat([query, new_k], dim=1)
    fused_k, fused_v = narrow_k.clone(), narrow_v.clone()
    rotated = qk.clone()
    assert cpu_kernels.rope_write_kv(rotated, new_v, cos, sin, fused_k, fused_v, metadata)
    reference.write_kv(rotated[:, query.shape[1] :], new_v, narrow_k, narrow_v, metadata)
    assert torch.equal(fused_k.view(torch.int16), narrow_k.view(torch.int16))
    assert torch.equal(fused_v.view(torch.int16), narrow_v.view(torch.int16))
    reference.write_kv(rotated[:, query.shape[1] :], new_v, wide_k, wide_v, metadata)
    query = rotated[:, : query.shape[1]].contiguous()

    expected = reference.paged_attention(query, narrow_k, narrow_v, metadata, 0.3)
    actual = cpu_kernels.paged_attention(query, narrow_k, narrow_v, metadata, 0.3)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    full_precision = reference.paged_attention(query, wide_k, wide_v, metadata, 0.3)
    tolerance = KV_DTYPE_TOLERANCE[kv_dtype]
    torch.testing.assert_close(actual, full_precision, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
def test_triton_kernels_read_and_write_a_16_bit_cache(kv_dtype):
    specs = [(9, 1), (0, 5), (17, 1)]
    k_cache, v_cache, metadata, query, new_k, new_v, _, _ = _batch(23, 2, 2, 16, 4, specs)
    ref_k, ref_v = _narrowed(k_cache, v_cache, kv_dtype)
    tri_k, tri_v = ref_k.clone(), ref_v.clone()
    reference.write_kv(new_k, new_v, ref_k, ref_v, metadata)
    tri.write_kv(new_k, new_v, tri_k, tri_v, metadata)
    # Triton's interpreter narrows float32 to bfloat16 by truncation where a GPU rounds to nearest even (as
    # torch does): at most one unit in the last place apart here.
    ulps = 1 if kv_dtype == torch.bfloat16 else 0
    for written, expected_bits in ((tri_k, ref_k), (tri_v, ref_v)):
        assert (written.view(torch.int16).int() - expected_bits.view(torch.int16).int()).abs().max() <= ulps
    expected = reference.paged_attention(query, tri_k, tri_v, metadata, 0.25)  # over the same stored bits
    actual = tri.paged_attention(query, tri_k, tri_v, metadata, 0.25)
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kv_scales", [(1.0, 1.0), (0.5, 2.0)])
def test_an_8_bit_cache_stores_k_and_v_over_their_scales(kv_scales):
    """fp8_e4m3: K / k_scale and V / v_scale are stored (3 bits of mantissa), read back times the scales: the
    reference's attention stays within fp8's rounding of fp32's; the Triton kernels agree with it."""
    k_cache, v_cache, metadata, query, new_k, new_v, _, _ = _batch(3, 2, 2, 16, 4, [(9, 1), (0, 5), (17, 1)])
    wide_k, wide_v = _engine_layout_views(k_cache, v_cache)
    fp8 = torch.float8_e4m3fn
    narrow_k, narrow_v = (wide_k / kv_scales[0]).to(fp8), (wide_v / kv_scales[1]).to(fp8)
    triton_k, triton_v = narrow_k.clone(), narrow_v.clone()
    reference.write_kv(new_k, new_v, narrow_k, narrow_v, metadata, kv_scales)
    reference.write_kv(new_k, new_v, wide_k, wide_v, metadata)
    slots = (metadata.slot_block_ids, metadata.slot_offsets)
    assert torch.equal(narrow_k[slots].float(), (new_k / kv_scales[0]).to(fp8).float())
    expected = reference.paged_attention(query, wide_k, wide_v, metadata, 0.25)
    actual = reference.paged_attention(query, narrow_k, narrow_v, metadata, 0.25, kv_scales)
    torch.testing.assert_close(actual, expected, atol=0.15, rtol=0.1)  # measured: 0.075 at most

    tri.write_kv(new_k, new_v, triton_k, triton_v, metadata, kv_scales)
    # Triton's interpreter narrows to fp8 by truncating where a GPU and torch round to nearest: it differs only
    # where rounding carries into the next power of two (1.96: 1.0, not 2.0) and among subnormals (< 2^-6).
    for written, wanted in ((triton_k, narrow_k), (triton_v, narrow_v)):
        differ = written.view(torch.uint8) != wanted.view(torch.uint8)
        assert differ.float().mean() < 0.02
        values = wanted[differ].float().abs()
        assert bool(((values < 2.0**-6) | (values == 2.0 ** values.log2().round())).all()), values
    same_bits = reference.paged_attention(query, triton_k, triton_v, metadata, 0.25, kv_scales)
    torch.testing.assert_close(
        tri.paged_attention(query, triton_k, triton_v, metadata, 0.25, kv_scales), same_bits, atol=1e-5, rtol=1e-5
    )
