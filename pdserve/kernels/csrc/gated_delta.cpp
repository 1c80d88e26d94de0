// Gated DeltaNet (Qwen3.5's linear attention): the convolution and the gated delta rule of every
// sequence in the batch, decodes and prompt chunks alike, in the recurrent form over the states in
// place.

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

#include "kernels.h"

namespace pdserve {

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

void gated_delta_net(at::Tensor out, at::Tensor qkv, at::Tensor conv_weight, at::Tensor conv_states,
                     at::Tensor recurrent_states, at::Tensor slots, at::Tensor starts, at::Tensor log_decay,
                     at::Tensor beta, int64_t num_key_heads) {
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && conv_states.scalar_type() == at::kFloat &&
                  recurrent_states.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat &&
                  log_decay.scalar_type() == at::kFloat && beta.scalar_type() == at::kFloat &&
                  conv_weight.scalar_type() == at::kFloat,
              "gated_delta_net: float32 only");
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && conv_weight.is_contiguous() && out.is_contiguous() &&
                  log_decay.is_contiguous() && beta.is_contiguous(),
              "gated_delta_net: contiguous features, weights, outputs, decays and betas");
  TORCH_CHECK(conv_states.stride(2) == 1 && conv_states.stride(1) == conv_states.size(2) &&
                  recurrent_states.stride(3) == 1 && recurrent_states.stride(2) == recurrent_states.size(3) &&
                  recurrent_states.stride(1) == recurrent_states.size(2) * recurrent_states.size(3),
              "gated_delta_net: each slot's states must be contiguous");
  TORCH_CHECK(slots.scalar_type() == at::kLong && starts.scalar_type() == at::kLong && slots.is_contiguous() &&
                  starts.is_contiguous() && starts.size(0) == slots.size(0) + 1,
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
  auto mixed = at::empty({num_tokens, channels}, qkv.options());
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
  auto kq = at::empty({num_tokens, num_key_heads}, qkv.options());
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
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return start[a + 1] - start[a] > start[b + 1] - start[b]; });
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
        delta_rule_columns<VEC>(state + j, value_dim, key_dim, start[seq], start[seq + 1], m_ptr, channels, q_at, k_at,
                                v_at + j, g_ptr, b_ptr, kq_ptr + key_head, num_key_heads, num_heads, head, o_ptr + j);
      for (; j < value_dim; ++j)
        delta_rule_columns<1>(state + j, value_dim, key_dim, start[seq], start[seq + 1], m_ptr, channels, q_at, k_at,
                              v_at + j, g_ptr, b_ptr, kq_ptr + key_head, num_key_heads, num_heads, head, o_ptr + j);
    }
  });
}

}  // namespace pdserve
