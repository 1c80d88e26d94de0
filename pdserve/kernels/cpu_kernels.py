"""Fused C++ ops for the CPU path (fp32), built on first use: decode paged attention, rotary +
KV write, and residual-add + RMSNorm.

Decode attention: the torch reference path must gather every decoding sequence's blocks into a buffer before it can
multiply, so a decode step reads the KV from memory and writes and re-reads a copy of it. This
kernel reads each sequence's blocks in place through its block table, once for K and once for V,
with the (sequence, KV head) pairs spread over torch's threads: on the 2-core CPU machines it
roughly halves decode attention time (docs/benchmarks.md).

Rotary + KV write: the rotation of q and k and the stores of k and v into their slots, in one
pass over the new tokens (seven torch ops otherwise).

SiLU * up: an MLP's activation in one pass over its gate and up halves.

Add + RMSNorm: at decode batch sizes a layer's norms are a handful of tiny tensors, and the five
torch dispatches per norm cost more than the arithmetic; one fused call does the residual add,
the sum of squares and the scaling (≈10% of a batch-64 decode step on the 110M Llama).

Linear layers over packed weights: a weight is repacked once, after loading, into panels of 32
output features, each one contiguous stream over the input features; a tile of rows keeps its sums
in registers across a whole panel. Decode's few-row matmuls run 1.5-4x faster than MKL's GEMM on
the [in, out] layout, and prompt-sized ones somewhat faster (docs/benchmarks.md); only the packed
copy is kept. ``packed_rows`` reads rows back out of a packed table (a tied embedding's lookups).

Compiled with torch's C++ extension loader (g++ and ninja) the first time it is needed and cached
under ~/.cache/torch_extensions, for the host's instruction set (``-march=native``) unless
``PDSERVE_CPU_MARCH`` names another. Where that is impossible callers fall back to torch ops (same
results to float rounding); ``cpu_ops()`` returns None then and says why once.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import platform
import re
from pathlib import Path

import torch

from pdserve.kernels import reference
from pdserve.kernels.reference import AttentionMetadata

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstring>
#include <cmath>
#include <vector>

// Blocks are scattered in memory: ask for the next one while computing on this one, so the
// loads overlap the arithmetic instead of stalling at each block boundary.
static inline void prefetch_rows(const float* base, int64_t row_stride, int64_t rows, int64_t row_len) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < row_len; i += 16) __builtin_prefetch(base + r * row_stride + i, 0, 1);
}

// out[rows[d], h, :] = softmax(scale * query[rows[d], h] . K[d, :len_d]) V[d, :len_d] for every
// decode d and query head h, reading K/V through block_tables (decodes sit among a batch's tokens
// at rows[d]: no gather or scatter of their queries is needed). Cache views are [blocks, block_size, kv_heads,
// head_dim] with any strides, head_dim contiguous. Every score is finite (no masking happens in
// here), which is what lets this file be compiled with -ffast-math (vectorised exp).
void decode_attention(torch::Tensor out, torch::Tensor query, torch::Tensor rows, torch::Tensor k_cache,
                      torch::Tensor v_cache, torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  TORCH_CHECK(query.scalar_type() == torch::kFloat32 && k_cache.scalar_type() == torch::kFloat32,
              "decode_attention: float32 only");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1 && query.stride(2) == 1 && out.stride(2) == 1,
              "decode_attention: head_dim must be contiguous");
  const int64_t num_decodes = rows.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t* row_of = rows.data_ptr<int64_t>();
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const float* q_ptr = query.data_ptr<float>();
  const float* k_ptr = k_cache.data_ptr<float>();
  const float* v_ptr = v_cache.data_ptr<float>();
  float* o_ptr = out.data_ptr<float>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t table_stride = block_tables.stride(0);
  const int64_t qs0 = query.stride(0), qs1 = query.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  const int64_t kb = k_cache.stride(0), ks = k_cache.stride(1), kh = k_cache.stride(2);
  const int64_t vb = v_cache.stride(0), vs = v_cache.stride(1), vh = v_cache.stride(2);
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, num_decodes * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> score_buffer;
    std::vector<float> acc_buffer(group * head_dim);
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t d = pair / num_kv_heads, h = pair % num_kv_heads;
      const int64_t len = lens[d];
      const int64_t* table = tables + d * table_stride;
      score_buffer.resize(group * len);
      float* __restrict__ scores = score_buffer.data();
      // Pass 1: scores, block by block, one K row at a time for all query heads of the group.
      for (int64_t start = 0; start < len; start += block_size) {
        const float* block_k = k_ptr + table[start / block_size] * kb + h * kh;
        const int64_t rows = std::min(block_size, len - start);
        if (start + block_size < len) prefetch_rows(k_ptr + table[start / block_size + 1] * kb + h * kh, ks,
                                                    block_size, head_dim);
        for (int64_t g = 0; g < group; ++g) {
          const float* __restrict__ q = q_ptr + row_of[d] * qs0 + (h * group + g) * qs1;
          for (int64_t r = 0; r < rows; ++r) {
            const float* __restrict__ k = block_k + r * ks;
            float dot = 0.f;
            #pragma omp simd reduction(+:dot)
            for (int64_t i = 0; i < head_dim; ++i) dot += q[i] * k[i];
            scores[g * len + start + r] = dot * fscale;
          }
        }
      }
      // Softmax per query head.
      for (int64_t g = 0; g < group; ++g) {
        float* __restrict__ s = scores + g * len;
        float max_score = s[0];
        for (int64_t t = 1; t < len; ++t) max_score = std::max(max_score, s[t]);
        float total = 0.f;
        #pragma omp simd reduction(+:total)
        for (int64_t t = 0; t < len; ++t) { s[t] = std::exp(s[t] - max_score); total += s[t]; }
        const float inv = 1.f / total;
        #pragma omp simd
        for (int64_t t = 0; t < len; ++t) s[t] *= inv;
      }
      // Pass 2: weighted sum of V rows.
      float* __restrict__ acc = acc_buffer.data();
      std::fill(acc, acc + group * head_dim, 0.f);
      for (int64_t start = 0; start < len; start += block_size) {
        const float* block_v = v_ptr + table[start / block_size] * vb + h * vh;
        const int64_t rows = std::min(block_size, len - start);
        if (start + block_size < len) prefetch_rows(v_ptr + table[start / block_size + 1] * vb + h * vh, vs,
                                                    block_size, head_dim);
        for (int64_t g = 0; g < group; ++g) {
          float* __restrict__ a = acc + g * head_dim;
          const float* w = scores + g * len + start;
          for (int64_t r = 0; r < rows; ++r) {
            const float* __restrict__ v = block_v + r * vs;
            const float weight = w[r];
            #pragma omp simd
            for (int64_t i = 0; i < head_dim; ++i) a[i] += weight * v[i];
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* o = o_ptr + row_of[d] * os0 + (h * group + g) * os1;
        std::copy(acc + g * head_dim, acc + (g + 1) * head_dim, o);
      }
    }
  });
}

// Rotary embedding applied in place to the q and k heads of ``qk`` [tokens, q_heads + kv_heads,
// head_dim] ("rotate half" layout; cos/sin [tokens, head_dim] with both halves equal), then the
// k heads (the last kv_heads of qk) and ``v`` [tokens, kv_heads, head_dim] stored in their cache
// slots: one pass instead of seven torch ops.
void rope_write_kv(torch::Tensor qk, torch::Tensor v, torch::Tensor cos, torch::Tensor sin,
                   torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_ids, torch::Tensor offsets) {
  TORCH_CHECK(qk.scalar_type() == torch::kFloat32 && qk.stride(2) == 1 && v.stride(2) == 1 &&
              cos.is_contiguous() && sin.is_contiguous() && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "rope_write_kv: float32 with head_dim contiguous");
  const int64_t tokens = qk.size(0), heads = qk.size(1), head_dim = qk.size(2), kv_heads = v.size(1);
  const int64_t half = head_dim / 2, first_k = heads - kv_heads;
  float* qk_ptr = qk.data_ptr<float>();
  const float* v_ptr = v.data_ptr<float>();
  const float* cos_ptr = cos.data_ptr<float>();
  const float* sin_ptr = sin.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  const int64_t* blocks = block_ids.data_ptr<int64_t>();
  const int64_t* slots = offsets.data_ptr<int64_t>();
  const int64_t qs0 = qk.stride(0), qs1 = qk.stride(1), vs0 = v.stride(0), vs1 = v.stride(1);
  const int64_t kb = k_cache.stride(0), ks = k_cache.stride(1), kh = k_cache.stride(2);
  const int64_t vb = v_cache.stride(0), vsl = v_cache.stride(1), vh = v_cache.stride(2);
  at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* __restrict__ c = cos_ptr + t * head_dim;
      const float* __restrict__ s = sin_ptr + t * head_dim;
      for (int64_t h = 0; h < heads; ++h) {
        float* __restrict__ x = qk_ptr + t * qs0 + h * qs1;
        #pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = x[i], b = x[i + half];
          x[i] = a * c[i] - b * s[i];
          x[i + half] = b * c[i + half] + a * s[i + half];
        }
      }
      const int64_t block = blocks[t], slot = slots[t];
      for (int64_t j = 0; j < kv_heads; ++j) {
        std::copy(qk_ptr + t * qs0 + (first_k + j) * qs1, qk_ptr + t * qs0 + (first_k + j) * qs1 + head_dim,
                  kc + block * kb + slot * ks + j * kh);
        std::copy(v_ptr + t * vs0 + j * vs1, v_ptr + t * vs0 + j * vs1 + head_dim,
                  vc + block * vb + slot * vsl + j * vh);
      }
    }
  });
}

// out = weight * r / sqrt(mean(r^2) + eps) for each row r, where r = residual + x and residual is
// updated in place (has_residual), or r = x. All tensors [rows, hidden], contiguous.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps,
                       bool has_residual) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous() && weight.is_contiguous(),
              "rms_norm: contiguous float32 only");
  TORCH_CHECK(!has_residual || (residual.is_contiguous() && residual.sizes() == x.sizes()),
              "rms_norm: residual must match x");
  const int64_t rows = x.size(0), hidden = x.size(1);
  torch::Tensor out = torch::empty_like(x);
  const float* x_ptr = x.data_ptr<float>();
  float* r_ptr = has_residual ? residual.data_ptr<float>() : nullptr;
  const float* w = weight.data_ptr<float>();
  float* o_ptr = out.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float* __restrict__ xr = x_ptr + row * hidden;
      float* __restrict__ o = o_ptr + row * hidden;
      const float* __restrict__ source = xr;
      if (has_residual) {
        float* __restrict__ r = r_ptr + row * hidden;
        #pragma omp simd
        for (int64_t i = 0; i < hidden; ++i) r[i] += xr[i];
        source = r;
      }
      float squares = 0.f;
      #pragma omp simd reduction(+:squares)
      for (int64_t i = 0; i < hidden; ++i) squares += source[i] * source[i];
      const float inv = 1.f / std::sqrt(squares / hidden + feps);
      #pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) o[i] = w[i] * (source[i] * inv);
    }
  });
  return out;
}
// out[t, i] = silu(gate_up[t, i]) * gate_up[t, inter + i]: the SwiGLU between an MLP's two
// projections in one pass (torch takes a strided silu, then a multiply).
torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.scalar_type() == torch::kFloat32 && gate_up.dim() == 2 && gate_up.stride(1) == 1 &&
                  gate_up.size(1) % 2 == 0,
              "silu_mul: float32 [tokens, 2 * inter] with features contiguous");
  const int64_t tokens = gate_up.size(0), inter = gate_up.size(1) / 2, stride = gate_up.stride(0);
  auto out = torch::empty({tokens, inter}, gate_up.options());
  const float* in_ptr = gate_up.data_ptr<float>();
  float* o_ptr = out.data_ptr<float>();
  at::parallel_for(0, tokens, std::max<int64_t>(1, 16384 / inter), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* __restrict__ gate = in_ptr + t * stride;
      const float* __restrict__ up = gate + inter;
      float* __restrict__ o = o_ptr + t * inter;
      #pragma omp simd
      for (int64_t i = 0; i < inter; ++i) o[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
    }
  });
  return out;
}

// ---- Linear layers over packed weights -------------------------------------------------------
// A weight W [out, in] is stored as panels of PANEL output features: packed[p, k, j] =
// W[p * PANEL + j, k], zero past the last feature. A panel is one contiguous stream, so a thread
// reads its share of the weights front to back (what the prefetchers want), and a tile of rows
// keeps its PANEL-wide sums in registers over the whole input: each weight vector loaded feeds
// ROWS fused multiply-adds. MKL's GEMM, on the [in, out] layout, costs about as much for 4 rows
// as this does for 64 on the CPUs measured (docs/benchmarks.md).
constexpr int64_t PANEL = 32;
#ifdef __AVX512F__
constexpr int VEC = 16;  // floats in a register
constexpr int ROWS = 6;  // 6 rows x 2 vectors: 12 of the 32 registers hold sums
#else
constexpr int VEC = 8;
constexpr int ROWS = 3;  // 3 rows x 4 vectors: 12 of the 16 registers hold sums
#endif
constexpr int PANEL_VECS = PANEL / VEC;
constexpr int64_t ROW_CHUNK = 16 * ROWS;  // rows per work item: a panel is reused from cache across them
typedef float floats __attribute__((vector_size(VEC * 4)));

static inline floats load_floats(const float* p) {
  floats v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// out[m, :width] = x[m, :] . panel for m < TILE rows.
template <int TILE>
static inline void panel_tile(const float* x, int64_t in, const float* panel, float* out, int64_t out_stride,
                              int64_t width) {
  floats sums[TILE][PANEL_VECS];
  for (int m = 0; m < TILE; ++m)
    for (int v = 0; v < PANEL_VECS; ++v) sums[m][v] = floats{};
  for (int64_t k = 0; k < in; ++k) {
    floats w[PANEL_VECS];
    for (int v = 0; v < PANEL_VECS; ++v) w[v] = load_floats(panel + k * PANEL + v * VEC);
    for (int m = 0; m < TILE; ++m) {
      const floats xk = floats{} + x[m * in + k];
      for (int v = 0; v < PANEL_VECS; ++v) sums[m][v] += w[v] * xk;
    }
  }
  for (int m = 0; m < TILE; ++m) {
    float row[PANEL];
    for (int v = 0; v < PANEL_VECS; ++v) std::memcpy(row + v * VEC, &sums[m][v], sizeof(floats));
    std::memcpy(out + m * out_stride, row, width * sizeof(float));
  }
}

template <int TILE>
static void panel_tail(int64_t left, const float* x, int64_t in, const float* panel, float* out,
                       int64_t out_stride, int64_t width) {
  if constexpr (TILE > 0) {
    if (left == TILE) return panel_tile<TILE>(x, in, panel, out, out_stride, width);
    panel_tail<TILE - 1>(left, x, in, panel, out, out_stride, width);
  }
}

// x [rows, in] @ W.T -> [rows, out_features], W packed as above.
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor packed, int64_t out_features) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && packed.scalar_type() == torch::kFloat32,
              "packed_linear: float32 only");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && packed.is_contiguous(), "packed_linear: contiguous 2-D input");
  const int64_t rows = x.size(0), in = x.size(1), panels = packed.size(0);
  TORCH_CHECK(packed.dim() == 3 && packed.size(1) == in && packed.size(2) == PANEL &&
                  (out_features + PANEL - 1) / PANEL == panels,
              "packed_linear: weight panels do not match the input");
  auto out = torch::empty({rows, out_features}, x.options());
  const float* x_ptr = x.data_ptr<float>();
  const float* w_ptr = packed.data_ptr<float>();
  float* o_ptr = out.data_ptr<float>();
  const int64_t chunks = (rows + ROW_CHUNK - 1) / ROW_CHUNK;
  // Work items are (panel, chunk of rows), panel-major: a thread's consecutive items share a panel.
  at::parallel_for(0, panels * chunks, 1, [&](int64_t first, int64_t last) {
    for (int64_t item = first; item < last; ++item) {
      const int64_t p = item / chunks, start = (item % chunks) * ROW_CHUNK;
      const int64_t end = std::min(rows, start + ROW_CHUNK), width = std::min(PANEL, out_features - p * PANEL);
      const float* panel = w_ptr + p * in * PANEL;
      int64_t m = start;
      for (; m + ROWS <= end; m += ROWS)
        panel_tile<ROWS>(x_ptr + m * in, in, panel, o_ptr + m * out_features + p * PANEL, out_features, width);
      panel_tail<ROWS - 1>(end - m, x_ptr + m * in, in, panel, o_ptr + m * out_features + p * PANEL, out_features,
                           width);
    }
  });
  return out;
}

// Rows ids of the packed W ([len(ids), in]): the embedding lookup of a table stored for the LM head.
torch::Tensor packed_rows(torch::Tensor packed, int64_t num_rows, torch::Tensor ids) {
  TORCH_CHECK(packed.is_contiguous() && ids.scalar_type() == torch::kInt64 && ids.is_contiguous(),
              "packed_rows: contiguous panels and int64 ids");
  const int64_t count = ids.numel(), in = packed.size(1);
  const int64_t* id_ptr = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < count; ++t)
    TORCH_CHECK(id_ptr[t] >= 0 && id_ptr[t] < num_rows, "packed_rows: index ", id_ptr[t], " out of range");
  auto out = torch::empty({count, in}, packed.options());
  const float* w_ptr = packed.data_ptr<float>();
  float* o_ptr = out.data_ptr<float>();
  at::parallel_for(0, count, 16, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      const float* column = w_ptr + (id_ptr[t] / PANEL) * in * PANEL + id_ptr[t] % PANEL;
      float* row = o_ptr + t * in;
      for (int64_t k = 0; k < in; ++k) row[k] = column[k * PANEL];
    }
  });
  return out;
}
"""


def _cpu_fingerprint() -> str:
    """Short hash of the CPU's instruction-set flags. The ops are built with -march=native and
    cached on disk by name; a home directory moved to a different CPU must not load a build that
    uses instructions it lacks (it would die of SIGILL), so the name carries the flags."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return hashlib.sha256((flags or platform.machine()).encode()).hexdigest()[:10]


# The instruction set the kernels are built for: the host's by default; e.g. x86-64-v3 (AVX2) to
# measure, on an AVX-512 host, what AVX2 machines get.
MARCH_ENV = "PDSERVE_CPU_MARCH"


@functools.cache
def cpu_ops():
    """The compiled extension (``decode_attention``, ``rms_norm``, ``rope_write_kv``, ``packed_linear``,
    ``packed_rows``, ``silu_mul``), or None where it cannot be built (the reason is logged once)."""
    try:
        from torch.utils.cpp_extension import get_default_build_root, load_inline

        march = os.environ.get(MARCH_ENV, "native")
        suffix = "" if march == "native" else "_" + re.sub(r"[^A-Za-z0-9]", "_", march)
        name = f"pdserve_cpu_kernels_{_cpu_fingerprint()}{suffix}"
        directory = Path(get_default_build_root()) / "pdserve" / name
        directory.mkdir(parents=True, exist_ok=True)
        with open(directory / "pdserve.flock", "w") as guard:
            # One process at a time builds or loads here; the kernel drops this lock when its holder
            # dies. torch's own lock file does not go away with a process killed mid-build, and
            # every later load would wait for it forever: holding this lock, any such file is stale.
            fcntl.flock(guard, fcntl.LOCK_EX)
            (directory / "lock").unlink(missing_ok=True)
            return load_inline(
                name=name,
                cpp_sources=_SOURCE,
                functions=["decode_attention", "rms_norm", "rope_write_kv", "packed_linear", "packed_rows", "silu_mul"],
                extra_cflags=["-O3", f"-march={march}", "-ffast-math", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                build_directory=str(directory),
                verbose=False,
            )
    except Exception as error:  # a missing compiler, headers or ninja: fall back, loudly
        logger.warning(
            "CPU kernels unavailable (%s); using torch ops",
            str(error).splitlines()[0] if str(error) else type(error).__name__,
        )
        return None


PANEL = 32  # output features per panel of a packed weight (the kernel's PANEL)


def pack_weight(weight_t: torch.Tensor) -> torch.Tensor:
    """``[in, out]`` -> the kernel's panels ``[ceil(out / PANEL), in, PANEL]``, zero-padded."""
    in_features, out_features = weight_t.shape
    full, tail = divmod(out_features, PANEL)
    packed = weight_t.new_zeros(full + (tail > 0), in_features, PANEL)
    # Panel by panel view of the same numbers: no transient copy of a large table.
    packed[:full].copy_(weight_t[:, : full * PANEL].view(in_features, full, PANEL).permute(1, 0, 2))
    if tail:
        packed[full, :, :tail] = weight_t[:, full * PANEL :]
    return packed


def packed_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """``x @ W.T`` for a weight packed by ``pack_weight``; ``x`` is ``[..., in]``."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    return cpu_ops().packed_linear(rows, packed, out_features).view(*x.shape[:-1], out_features)


def packed_rows(packed: torch.Tensor, num_rows: int, ids: torch.Tensor) -> torch.Tensor:
    """``W[ids]`` (``[*ids.shape, in]``) from a weight packed by ``pack_weight`` that has ``num_rows`` rows."""
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    return cpu_ops().packed_rows(packed, num_rows, flat).view(*ids.shape, packed.shape[1])


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """``silu(gate) * up`` of ``gate_up`` = [gate | up] ``[tokens, 2 * inter]``; None when the kernel
    does not apply (not fp32 on CPU, or not built): the caller then uses torch ops."""
    ops = cpu_ops() if gate_up.dtype == torch.float32 and gate_up.device.type == "cpu" else None
    if ops is None or gate_up.dim() != 2 or gate_up.stride(1) != 1:
        return None
    return ops.silu_mul(gate_up)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | None:
    """Fused (residual +=) x; RMSNorm. None when the kernel does not apply (not fp32 on CPU,
    not contiguous, or not built): the caller then uses torch ops."""
    ops = cpu_ops() if x.dtype == torch.float32 and x.device.type == "cpu" else None
    if ops is None or not x.is_contiguous() or x.dim() != 2:
        return None
    if residual is None:
        return ops.rms_norm(x, x, weight, eps, False)
    return ops.rms_norm(x, residual, weight, eps, True)


def rope_write_kv(
    qk: torch.Tensor,
    value: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
) -> bool:
    """Rotate ``qk`` [tokens, q_heads + kv_heads, head_dim] in place and store its k heads and
    ``value`` in the cache; False (nothing done) when the kernel does not apply (then the caller
    uses torch ops)."""
    ops = cpu_ops() if qk.dtype == torch.float32 and qk.device.type == "cpu" else None
    if ops is None:
        return False
    ops.rope_write_kv(
        qk,
        value,
        cos.reshape(len(qk), -1),
        sin.reshape(len(qk), -1),
        k_cache,
        v_cache,
        metadata.slot_block_ids,
        metadata.slot_offsets,
    )
    return True


def paged_attention(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata, scale: float
) -> torch.Tensor:
    """``reference.paged_attention`` with the decodes computed by the fused kernel (fp32, when it
    could be built); prefill chunks, other dtypes and kernel-less hosts use the reference."""
    ops = cpu_ops() if query.dtype == torch.float32 else None
    if ops is None:
        return reference.paged_attention(query, k_cache, v_cache, metadata, scale)
    output = torch.empty_like(query)
    rows = metadata.decode_token_indices
    if len(rows):
        ops.decode_attention(
            output,
            query,
            rows,
            k_cache,
            v_cache,
            metadata.decode_block_ids.view(len(rows), -1),
            metadata.decode_context_lens,
            scale,
        )
    reference.prefill_attention(query, k_cache, v_cache, metadata, scale, output)
    return output
