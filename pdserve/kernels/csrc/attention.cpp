// Attention over the paged KV cache: decode attention reading each sequence's blocks in place, and
// rotary + KV write in one pass over a step's new tokens.
//
// Decode attention: the torch reference path must gather every decoding sequence's blocks into a
// buffer before it can multiply, so a decode step reads the KV from memory and writes and re-reads
// a copy of it. This kernel reads each sequence's blocks in place through its block table, once for
// K and once for V, with the (sequence, KV head) pairs spread over torch's threads: on the 2-core
// CPU machines it roughly halves decode attention time (docs/benchmarks.md).
//
// The cache may store float32, bfloat16 or float16 (--kv-cache-dtype); queries, scores and sums are
// float32 throughout, and each K/V element is widened as it is read (the KV* types below), so a 16-bit
// cache costs half the memory traffic and no accuracy past its own rounding.

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels.h"

namespace pdserve {

// How a KV element is stored and read: the decode kernel's two inner loops (a query row's dot product with a
// K row, a V row's weighted add) per stored type, each reading the row in place and widening as it goes.
// bfloat16 is the upper half of a float32 (GCC vectorises the shift); float16 converts with F16C, 8 at a
// time (GCC does not vectorise the scalar conversion: it calls a library function per element, measured
// 3.4x slower than bfloat16). Stores round to nearest even, as torch's own conversions do, so the C++ and
// torch paths write the same bits.
struct KVFloat {
  using Storage = float;
  static inline float dot(const float* __restrict__ q, const Storage* __restrict__ k, int64_t n) {
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) sum += q[i] * k[i];
    return sum;
  }
  static inline void add(float* __restrict__ a, float w, const Storage* __restrict__ v, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) a[i] += w * v[i];
  }
  static inline Storage store(float x) { return x; }
};
struct KVBFloat16 {
  using Storage = uint16_t;
  static inline float widen(Storage x) {
    const uint32_t bits = static_cast<uint32_t>(x) << 16;
    float value;
    std::memcpy(&value, &bits, sizeof value);
    return value;
  }
  static inline float dot(const float* __restrict__ q, const Storage* __restrict__ k, int64_t n) {
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) sum += q[i] * widen(k[i]);
    return sum;
  }
  static inline void add(float* __restrict__ a, float w, const Storage* __restrict__ v, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) a[i] += w * widen(v[i]);
  }
  static inline Storage store(float x) { return c10::BFloat16(x).x; }
};
struct KVFloat16 {
  using Storage = uint16_t;
  static inline float widen(Storage x) { return static_cast<float>(c10::Half(x, c10::Half::from_bits())); }
  static inline float dot(const float* __restrict__ q, const Storage* __restrict__ k, int64_t n) {
    int64_t i = 0;
    float sum = 0.f;
#if defined(__F16C__) && defined(__FMA__)
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8)
      acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_cvtph_ps(load8(k + i)), acc);
    sum = horizontal_sum(acc);
#endif
    for (; i < n; ++i) sum += q[i] * widen(k[i]);
    return sum;
  }
  static inline void add(float* __restrict__ a, float w, const Storage* __restrict__ v, int64_t n) {
    int64_t i = 0;
#if defined(__F16C__) && defined(__FMA__)
    const __m256 weight = _mm256_set1_ps(w);
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(a + i, _mm256_fmadd_ps(weight, _mm256_cvtph_ps(load8(v + i)), _mm256_loadu_ps(a + i)));
#endif
    for (; i < n; ++i) a[i] += w * widen(v[i]);
  }
  static inline Storage store(float x) { return c10::Half(x).x; }

 private:
#if defined(__F16C__) && defined(__FMA__)
  static inline __m128i load8(const Storage* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
  static inline float horizontal_sum(__m256 x) {
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    half = _mm_add_ss(half, _mm_movehdup_ps(half));
    return _mm_cvtss_f32(half);
  }
#endif
};

// Calls body(KV{}) with the KV type of a cache of dtype ``dtype``.
template <typename Body>
static void with_kv_type(at::ScalarType dtype, const char* op, Body&& body) {
  switch (dtype) {
    case at::kFloat:
      body(KVFloat{});
      break;
    case at::kBFloat16:
      body(KVBFloat16{});
      break;
    case at::kHalf:
      body(KVFloat16{});
      break;
    default:
      TORCH_CHECK(false, op, ": a KV cache of float32, bfloat16 or float16, not ", dtype);
  }
}

// Blocks are scattered in memory: ask for the next one while computing on this one, so the
// loads overlap the arithmetic instead of stalling at each block boundary.
template <typename T>
static inline void prefetch_rows(const T* base, int64_t row_stride, int64_t rows, int64_t row_len) {
  constexpr int64_t per_line = 64 / sizeof(T);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < row_len; i += per_line) __builtin_prefetch(base + r * row_stride + i, 0, 1);
}

// out[rows[d], h, :] = softmax(scale * query[rows[d], h] . K[d, :len_d]) V[d, :len_d] for every
// decode d and query head h, reading K/V through block_tables (decodes sit among a batch's tokens
// at rows[d]: no gather or scatter of their queries is needed). Cache views are [blocks, block_size, kv_heads,
// head_dim] with any strides, head_dim contiguous. Every score is finite (no masking happens in
// here), which is what lets this file be compiled with -ffast-math (vectorised exp).
template <typename KV>
static void decode_attention_of(at::Tensor& out, const at::Tensor& query, const at::Tensor& rows,
                                const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
                                const at::Tensor& context_lens, double scale) {
  using T = typename KV::Storage;
  const int64_t num_decodes = rows.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t* row_of = rows.data_ptr<int64_t>();
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const float* q_ptr = query.data_ptr<float>();
  const T* k_ptr = static_cast<const T*>(k_cache.data_ptr());
  const T* v_ptr = static_cast<const T*>(v_cache.data_ptr());
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
        const T* block_k = k_ptr + table[start / block_size] * kb + h * kh;
        const int64_t rows = std::min(block_size, len - start);
        if (start + block_size < len)
          prefetch_rows(k_ptr + table[start / block_size + 1] * kb + h * kh, ks, block_size, head_dim);
        for (int64_t g = 0; g < group; ++g) {
          const float* __restrict__ q = q_ptr + row_of[d] * qs0 + (h * group + g) * qs1;
          for (int64_t r = 0; r < rows; ++r)
            scores[g * len + start + r] = KV::dot(q, block_k + r * ks, head_dim) * fscale;
        }
      }
      // Softmax per query head.
      for (int64_t g = 0; g < group; ++g) {
        float* __restrict__ s = scores + g * len;
        float max_score = s[0];
        for (int64_t t = 1; t < len; ++t) max_score = std::max(max_score, s[t]);
        float total = 0.f;
#pragma omp simd reduction(+ : total)
        for (int64_t t = 0; t < len; ++t) {
          s[t] = std::exp(s[t] - max_score);
          total += s[t];
        }
        const float inv = 1.f / total;
#pragma omp simd
        for (int64_t t = 0; t < len; ++t) s[t] *= inv;
      }
      // Pass 2: weighted sum of V rows.
      float* __restrict__ acc = acc_buffer.data();
      std::fill(acc, acc + group * head_dim, 0.f);
      for (int64_t start = 0; start < len; start += block_size) {
        const T* block_v = v_ptr + table[start / block_size] * vb + h * vh;
        const int64_t rows = std::min(block_size, len - start);
        if (start + block_size < len)
          prefetch_rows(v_ptr + table[start / block_size + 1] * vb + h * vh, vs, block_size, head_dim);
        for (int64_t g = 0; g < group; ++g) {
          float* __restrict__ a = acc + g * head_dim;
          const float* w = scores + g * len + start;
          for (int64_t r = 0; r < rows; ++r) KV::add(a, w[r], block_v + r * vs, head_dim);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* o = o_ptr + row_of[d] * os0 + (h * group + g) * os1;
        std::copy(acc + g * head_dim, acc + (g + 1) * head_dim, o);
      }
    }
  });
}

void decode_attention(at::Tensor out, at::Tensor query, at::Tensor rows, at::Tensor k_cache, at::Tensor v_cache,
                      at::Tensor block_tables, at::Tensor context_lens, double scale) {
  TORCH_CHECK(query.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat &&
                  k_cache.scalar_type() == v_cache.scalar_type(),
              "decode_attention: float32 queries over one KV cache dtype");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1 && query.stride(2) == 1 && out.stride(2) == 1,
              "decode_attention: head_dim must be contiguous");
  with_kv_type(k_cache.scalar_type(), "decode_attention", [&](auto kv) {
    decode_attention_of<decltype(kv)>(out, query, rows, k_cache, v_cache, block_tables, context_lens, scale);
  });
}

// Rotary embedding applied in place to the q and k heads of ``qk`` [tokens, q_heads + kv_heads,
// head_dim] ("rotate half" layout; cos/sin [tokens, head_dim] with both halves equal), then the
// k heads (the last kv_heads of qk) and ``v`` [tokens, kv_heads, head_dim] stored in their cache
// slots: one pass instead of seven torch ops.
template <typename KV>
static void rope_write_kv_of(at::Tensor& qk, const at::Tensor& v, const at::Tensor& cos, const at::Tensor& sin,
                             at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& block_ids,
                             const at::Tensor& offsets) {
  using T = typename KV::Storage;
  const int64_t tokens = qk.size(0), heads = qk.size(1), head_dim = qk.size(2), kv_heads = v.size(1);
  const int64_t half = head_dim / 2, first_k = heads - kv_heads;
  float* qk_ptr = qk.data_ptr<float>();
  const float* v_ptr = v.data_ptr<float>();
  const float* cos_ptr = cos.data_ptr<float>();
  const float* sin_ptr = sin.data_ptr<float>();
  T* kc = static_cast<T*>(k_cache.data_ptr());
  T* vc = static_cast<T*>(v_cache.data_ptr());
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
        const float* k_row = qk_ptr + t * qs0 + (first_k + j) * qs1;
        const float* v_row = v_ptr + t * vs0 + j * vs1;
        T* k_slot = kc + block * kb + slot * ks + j * kh;
        T* v_slot = vc + block * vb + slot * vsl + j * vh;
        for (int64_t i = 0; i < head_dim; ++i) {
          k_slot[i] = KV::store(k_row[i]);
          v_slot[i] = KV::store(v_row[i]);
        }
      }
    }
  });
}

void rope_write_kv(at::Tensor qk, at::Tensor v, at::Tensor cos, at::Tensor sin, at::Tensor k_cache, at::Tensor v_cache,
                   at::Tensor block_ids, at::Tensor offsets) {
  TORCH_CHECK(qk.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat && qk.stride(2) == 1 &&
                  v.stride(2) == 1 && cos.is_contiguous() && sin.is_contiguous() && k_cache.stride(3) == 1 &&
                  v_cache.stride(3) == 1 && k_cache.scalar_type() == v_cache.scalar_type(),
              "rope_write_kv: float32 q/k/v with head_dim contiguous, one KV cache dtype");
  with_kv_type(k_cache.scalar_type(), "rope_write_kv", [&](auto kv) {
    rope_write_kv_of<decltype(kv)>(qk, v, cos, sin, k_cache, v_cache, block_ids, offsets);
  });
}

}  // namespace pdserve
