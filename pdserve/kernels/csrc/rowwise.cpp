// Row-wise fused ops: residual add + RMSNorm, and SiLU * up. At decode batch sizes a layer's norms
// and activations are a handful of tiny tensors, and torch's dispatches (five per norm) cost more
// than the arithmetic; one fused call per op does it all in one pass over each row (≈10% of a
// batch-64 decode step on the 110M Llama).

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>
#include <cmath>

#include "kernels.h"

namespace pdserve {

// out = weight * r / sqrt(mean(r^2) + eps) for each row r, where r = residual + x and residual is
// updated in place (has_residual), or r = x. All tensors [rows, hidden], contiguous.
at::Tensor rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps, bool has_residual) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && weight.is_contiguous(),
              "rms_norm: contiguous float32 only");
  TORCH_CHECK(!has_residual || (residual.is_contiguous() && residual.sizes() == x.sizes()),
              "rms_norm: residual must match x");
  const int64_t rows = x.size(0), hidden = x.size(1);
  at::Tensor out = at::empty_like(x);
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
#pragma omp simd reduction(+ : squares)
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
at::Tensor silu_mul(at::Tensor gate_up) {
  TORCH_CHECK(
      gate_up.scalar_type() == at::kFloat && gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
      "silu_mul: float32 [tokens, 2 * inter] with features contiguous");
  const int64_t tokens = gate_up.size(0), inter = gate_up.size(1) / 2, stride = gate_up.stride(0);
  auto out = at::empty({tokens, inter}, gate_up.options());
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

}  // namespace pdserve
