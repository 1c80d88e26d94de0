// Linear layers over packed weights: a weight is repacked once, after loading, into panels of PANEL
// output features, each one contiguous stream over the input features; a tile of rows keeps its
// sums in registers across a whole panel. Decode's few-row matmuls run 1.5-4x faster than MKL's GEMM
// on the [in, out] layout, and prompt-sized ones somewhat faster (docs/benchmarks.md); only the
// packed copy is kept. packed_rows reads rows back out of a packed table (a tied embedding's lookups).

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstring>

#include "kernels.h"

namespace pdserve {

// A weight W [out, in] is stored as panels of PANEL output features: packed[p, k, j] =
// W[p * PANEL + j, k], zero past the last feature. A panel is one contiguous stream, so a thread
// reads its share of the weights front to back (what the prefetchers want), and a tile of rows
// keeps its PANEL-wide sums in registers over the whole input: each weight vector loaded feeds
// ROWS fused multiply-adds. MKL's GEMM, on the [in, out] layout, costs about as much for 4 rows
// as this does for 64 on the CPUs measured (docs/benchmarks.md).

// Rows per tile: 12 registers hold sums, of AVX-512's 32 (6 rows x 2 vectors) or AVX2's 16 (3 rows x
// 4 vectors). PANEL and VEC come from kernels.h.
constexpr int ROWS = VEC == 16 ? 6 : 3;
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
static void panel_tail(int64_t left, const float* x, int64_t in, const float* panel, float* out, int64_t out_stride,
                       int64_t width) {
  if constexpr (TILE > 0) {
    if (left == TILE) return panel_tile<TILE>(x, in, panel, out, out_stride, width);
    panel_tail<TILE - 1>(left, x, in, panel, out, out_stride, width);
  }
}

// x [rows, in] @ W.T -> [rows, out_features], W packed as above.
at::Tensor packed_linear(at::Tensor x, at::Tensor packed, int64_t out_features) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat, "packed_linear: float32 only");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && packed.is_contiguous(), "packed_linear: contiguous 2-D input");
  const int64_t rows = x.size(0), in = x.size(1), panels = packed.size(0);
  TORCH_CHECK(packed.dim() == 3 && packed.size(1) == in && packed.size(2) == PANEL &&
                  (out_features + PANEL - 1) / PANEL == panels,
              "packed_linear: weight panels do not match the input");
  auto out = at::empty({rows, out_features}, x.options());
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
at::Tensor packed_rows(at::Tensor packed, int64_t num_rows, at::Tensor ids) {
  TORCH_CHECK(packed.is_contiguous() && ids.scalar_type() == at::kLong && ids.is_contiguous(),
              "packed_rows: contiguous panels and int64 ids");
  const int64_t count = ids.numel(), in = packed.size(1);
  const int64_t* id_ptr = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < count; ++t)
    TORCH_CHECK(id_ptr[t] >= 0 && id_ptr[t] < num_rows, "packed_rows: index ", id_ptr[t], " out of range");
  auto out = at::empty({count, in}, packed.options());
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

}  // namespace pdserve
