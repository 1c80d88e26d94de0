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

Gated DeltaNet (Qwen3.5's linear attention): the convolution and the gated delta rule of every
sequence in the batch, decodes and prompt chunks alike, in the recurrent form over the states in
place: the torch path gathers, rewrites and scatters each decode's state several times a step, and
runs prompts through the chunked form's many small ops.

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
#include <atomic>
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

// ---- Gated DeltaNet ------------------------------------------------------------------------
// A batch of sequences, each a span of tokens (a decode: one; a prompt chunk: many) continuing from
// its state slot: the causal depthwise convolution (+ SiLU) over its rolling window, then the gated
// delta rule token by token in the recurrent form (pdserve/kernels/gated_delta.py states the rule),
// each state updated in place where it lives. A (sequence, value head) state [key_dim, value_dim] is
// worked on a block of columns at a time (the columns do not mix), which stays in L1 for the whole
// span: memory sees each state read and written once per step, where torch's ops gather, read,
// write and scatter it several times, and a prompt costs one pass over cached numbers per token
// instead of the chunked form's many small tensor ops.
constexpr int64_t GDN_MAX_WIDTH = 16;

// Columns [0, W) of one state (row stride value_dim) through tokens [begin, end): each pass over its
// rows applies the previous token's write (S = decay S + k delta^T) and reads S^T k and S^T q for
// this token. q and k are normalised already (q scaled); kq[t] is their dot product.
template <int W>
static void delta_rule_columns(float* state, int64_t value_dim, int64_t key_dim, int64_t begin, int64_t end,
                               const float* mixed, int64_t channels, int64_t q_at, int64_t k_at, int64_t v_at,
                               const float* log_decay, const float* beta, const float* kq, int64_t kq_stride,
                               int64_t num_heads, int64_t head, float* out) {
  float delta[W] = {};
  float last_decay = 1.f;
  const float* last_k = nullptr;
  for (int64_t t = begin; t < end; ++t) {
    const float* row = mixed + t * channels;
    const float* q = row + q_at;
    const float* k = row + k_at;
    float to_k[W] = {}, to_q[W] = {};
    for (int64_t i = 0; i < key_dim; ++i) {
      float* __restrict__ s = state + i * value_dim;
      if (last_k != nullptr) {
        const float written = last_k[i];
        #pragma omp simd
        for (int l = 0; l < W; ++l) s[l] = last_decay * s[l] + written * delta[l];
      }
      const float ki = k[i], qi = q[i];
      #pragma omp simd
      for (int l = 0; l < W; ++l) {
        to_k[l] += ki * s[l];
        to_q[l] += qi * s[l];
      }
    }
    const float decay = std::exp(log_decay[t * num_heads + head]), write = beta[t * num_heads + head];
    const float both = kq[t * kq_stride];
    const float* v = row + v_at;
    float* o = out + (t * num_heads + head) * value_dim;
    #pragma omp simd
    for (int l = 0; l < W; ++l) {
      delta[l] = (v[l] - decay * to_k[l]) * write;
      o[l] = decay * to_q[l] + both * delta[l];  // (decay S + k delta^T)^T q
    }
    last_decay = decay;
    last_k = k;
  }
  if (last_k == nullptr) return;
  for (int64_t i = 0; i < key_dim; ++i) {
    float* __restrict__ s = state + i * value_dim;
    const float written = last_k[i];
    #pragma omp simd
    for (int l = 0; l < W; ++l) s[l] = last_decay * s[l] + written * delta[l];
  }
}

void gated_delta_net(torch::Tensor out, torch::Tensor qkv, torch::Tensor conv_weight, torch::Tensor conv_states,
                     torch::Tensor recurrent_states, torch::Tensor slots, torch::Tensor starts,
                     torch::Tensor log_decay, torch::Tensor beta, int64_t num_key_heads) {
  TORCH_CHECK(qkv.scalar_type() == torch::kFloat32 && conv_states.scalar_type() == torch::kFloat32 &&
                  recurrent_states.scalar_type() == torch::kFloat32 && out.scalar_type() == torch::kFloat32 &&
                  log_decay.scalar_type() == torch::kFloat32 && beta.scalar_type() == torch::kFloat32 &&
                  conv_weight.scalar_type() == torch::kFloat32,
              "gated_delta_net: float32 only");
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && conv_weight.is_contiguous() && out.is_contiguous() &&
                  log_decay.is_contiguous() && beta.is_contiguous(),
              "gated_delta_net: contiguous features, weights, outputs, decays and betas");
  TORCH_CHECK(conv_states.stride(2) == 1 && conv_states.stride(1) == conv_states.size(2) &&
                  recurrent_states.stride(3) == 1 && recurrent_states.stride(2) == recurrent_states.size(3) &&
                  recurrent_states.stride(1) == recurrent_states.size(2) * recurrent_states.size(3),
              "gated_delta_net: each slot's states must be contiguous");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && starts.scalar_type() == torch::kInt64 &&
                  slots.is_contiguous() && starts.is_contiguous() && starts.size(0) == slots.size(0) + 1,
              "gated_delta_net: int64 slots [seqs] and starts [seqs + 1]");
  const int64_t channels = conv_weight.size(0), width = conv_weight.size(1), num_tokens = qkv.size(0);
  const int64_t num_heads = recurrent_states.size(1), key_dim = recurrent_states.size(2);
  const int64_t value_dim = recurrent_states.size(3), num_seqs = slots.size(0);
  const int64_t key_size = num_key_heads * key_dim, history = width - 1;
  TORCH_CHECK(qkv.size(1) == channels && channels == 2 * key_size + num_heads * value_dim &&
                  num_heads % num_key_heads == 0 && width >= 2 && width <= GDN_MAX_WIDTH &&
                  out.numel() == num_tokens * num_heads * value_dim,
              "gated_delta_net: shapes do not match");
  const int64_t* slot_of = slots.data_ptr<int64_t>();
  const int64_t* start = starts.data_ptr<int64_t>();
  TORCH_CHECK(start[0] == 0 && start[num_seqs] == num_tokens, "gated_delta_net: spans must cover the tokens");
  for (int64_t seq = 0; seq < num_seqs; ++seq)
    TORCH_CHECK(start[seq] <= start[seq + 1] && slot_of[seq] >= 0 && slot_of[seq] < conv_states.size(0) &&
                    conv_states.size(0) == recurrent_states.size(0),
                "gated_delta_net: sequence ", seq, " has no span or no slot");
  auto mixed = torch::empty({num_tokens, channels}, qkv.options());
  const float* x_ptr = qkv.data_ptr<float>();
  const float* w_ptr = conv_weight.data_ptr<float>();
  float* conv_ptr = conv_states.data_ptr<float>();
  float* m_ptr = mixed.data_ptr<float>();
  const int64_t x_stride = qkv.stride(0), conv_slot_stride = conv_states.stride(0);

  // The convolution, a (sequence, block of channels) at a time, vectorised across the channels: an
  // input before the span comes from the kept window (transposed here), the rest from qkv's rows.
  constexpr int64_t BLOCK = 64;
  const int64_t channel_blocks = (channels + BLOCK - 1) / BLOCK;
  at::parallel_for(0, num_seqs * channel_blocks, 1, [&](int64_t first, int64_t last) {
    float kept[GDN_MAX_WIDTH][BLOCK], taps[GDN_MAX_WIDTH][BLOCK];
    for (int64_t item = first; item < last; ++item) {
      const int64_t seq = item / channel_blocks, c0 = (item % channel_blocks) * BLOCK;
      const int64_t block = std::min(BLOCK, channels - c0), begin = start[seq], span = start[seq + 1] - begin;
      float* state = conv_ptr + slot_of[seq] * conv_slot_stride + c0 * history;
      for (int64_t c = 0; c < block; ++c)
        for (int64_t j = 0; j < width; ++j) {
          taps[j][c] = w_ptr[(c0 + c) * width + j];
          if (j < history) kept[j][c] = state[c * history + j];
        }
      for (int64_t u = 0; u < span; ++u) {
        float* y = m_ptr + (begin + u) * channels + c0;
        float acc[BLOCK] = {};
        for (int64_t j = 0; j < width; ++j) {
          const int64_t at = u - history + j;  // the input this tap reads, relative to the span
          const float* input = at >= 0 ? x_ptr + (begin + at) * x_stride + c0 : kept[history + at];
          #pragma omp simd
          for (int64_t c = 0; c < block; ++c) acc[c] += taps[j][c] * input[c];
        }
        #pragma omp simd
        for (int64_t c = 0; c < block; ++c) y[c] = acc[c] / (1.f + std::exp(-acc[c]));
      }
      for (int64_t j = 0; j < history; ++j) {  // the last `history` inputs, oldest first
        const int64_t at = span - history + j;
        const float* input = at >= 0 ? x_ptr + (begin + at) * x_stride + c0 : kept[history + at];
        for (int64_t c = 0; c < block; ++c) state[c * history + j] = input[c];
      }
    }
  });

  // q and k L2-normalised in place (q also scaled by key_dim^-1/2), and each pair's dot product.
  auto kq = torch::empty({num_tokens, num_key_heads}, qkv.options());
  float* kq_ptr = kq.data_ptr<float>();
  const float query_scale = 1.f / std::sqrt(static_cast<float>(key_dim));
  at::parallel_for(0, num_tokens * num_key_heads, 16, [&](int64_t first, int64_t last) {
    for (int64_t item = first; item < last; ++item) {
      const int64_t t = item / num_key_heads, head = item % num_key_heads;
      float* q = m_ptr + t * channels + head * key_dim;
      float* k = q + key_size;
      float qq = 0.f, kk = 0.f;
      #pragma omp simd reduction(+ : qq, kk)
      for (int64_t i = 0; i < key_dim; ++i) {
        qq += q[i] * q[i];
        kk += k[i] * k[i];
      }
      const float q_norm = query_scale / std::sqrt(qq + 1e-6f), k_norm = 1.f / std::sqrt(kk + 1e-6f);
      float both = 0.f;
      #pragma omp simd reduction(+ : both)
      for (int64_t i = 0; i < key_dim; ++i) {
        q[i] *= q_norm;
        k[i] *= k_norm;
        both += q[i] * k[i];
      }
      kq_ptr[item] = both;
    }
  });

  // The delta rule: one (sequence, value head) per work item, longest spans first, handed out one at
  // a time (a prompt chunk's heads outweigh many decodes').
  std::vector<int64_t> order(num_seqs);
  for (int64_t i = 0; i < num_seqs; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return start[a + 1] - start[a] > start[b + 1] - start[b];
  });
  const int64_t group = num_heads / num_key_heads, items = num_seqs * num_heads;
  float* s_ptr = recurrent_states.data_ptr<float>();
  float* o_ptr = out.data_ptr<float>();
  const float* g_ptr = log_decay.data_ptr<float>();
  const float* b_ptr = beta.data_ptr<float>();
  const int64_t state_slot_stride = recurrent_states.stride(0);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    for (int64_t item = next++; item < items; item = next++) {
      const int64_t seq = order[item / num_heads], head = item % num_heads, key_head = head / group;
      float* state = s_ptr + slot_of[seq] * state_slot_stride + head * key_dim * value_dim;
      const int64_t q_at = key_head * key_dim, k_at = key_size + key_head * key_dim;
      const int64_t v_at = 2 * key_size + head * value_dim;
      int64_t j = 0;
      for (; j + VEC <= value_dim; j += VEC)
        delta_rule_columns<VEC>(state + j, value_dim, key_dim, start[seq], start[seq + 1], m_ptr, channels, q_at,
                                k_at, v_at + j, g_ptr, b_ptr, kq_ptr + key_head, num_key_heads, num_heads, head,
                                o_ptr + j);
      for (; j < value_dim; ++j)
        delta_rule_columns<1>(state + j, value_dim, key_dim, start[seq], start[seq + 1], m_ptr, channels, q_at, k_at,
                              v_at + j, g_ptr, b_ptr, kq_ptr + key_head, num_key_heads, num_heads, head, o_ptr + j);
    }
  });
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
    ``packed_rows``, ``silu_mul``, ``gated_delta_net``), or None where it cannot be built (the reason is
    logged once)."""
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
                functions=[
                    "decode_attention",
                    "rms_norm",
                    "rope_write_kv",
                    "packed_linear",
                    "packed_rows",
                    "silu_mul",
                    "gated_delta_net",
                ],
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


def gated_delta_net(
    out: torch.Tensor,
    qkv: torch.Tensor,
    conv_weight: torch.Tensor,
    state: tuple[torch.Tensor, torch.Tensor],
    metadata: AttentionMetadata,
    log_decay: torch.Tensor,
    beta: torch.Tensor,
    num_key_heads: int,
) -> bool:
    """A Gated DeltaNet layer's sequence mixing for every sequence of the batch (``GatedDeltaNet``'s
    inputs: ``qkv`` ``[tokens, channels]`` before the convolution, ``conv_weight`` ``[channels,
    width]``, the layer's (conv, recurrent) state views, ``log_decay`` and ``beta`` ``[tokens,
    value_heads]``) into ``out`` ``[tokens, value_heads, value_dim]``, states updated in place. False
    (nothing done) when the kernel does not apply (not fp32 on CPU, or not built)."""
    ops = cpu_ops() if qkv.dtype == torch.float32 and qkv.device.type == "cpu" else None
    if ops is None or metadata.state_slots is None:
        return False
    conv_states, recurrent_states = state
    starts = torch.tensor(metadata.query_start_loc, dtype=torch.int64)
    ops.gated_delta_net(
        out,
        qkv,
        conv_weight.contiguous(),
        conv_states,
        recurrent_states,
        metadata.state_slots,
        starts,
        log_decay.contiguous(),
        beta.contiguous(),
        num_key_heads,
    )
    return True
