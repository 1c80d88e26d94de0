// pdserve's fused CPU ops (fp32 compute; the attention ops read and write a KV cache of fp32, bf16 or
// fp16): the declarations bindings.cpp exposes to Python, and the constants more than one file needs.
// Every file is compiled once per instruction-set variant
// (pdserve/kernels/build.py); what differs between variants is decided here, from the compiler's
// own macros, so a variant cannot claim an instruction set its code was not built for.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace pdserve {

// Output features per panel of a packed weight (packed_linear.cpp). Python packs weights into this
// layout and reads the number from the module (PANEL), never from a copy of its own.
constexpr int64_t PANEL = 32;

// Floats in one vector register: the width the packed linear layer's tiles and the delta rule's
// column blocks are cut to.
#if defined(__AVX512F__)
constexpr int VEC = 16;
constexpr const char* ISA = "avx512";
#elif defined(__AVX2__)
constexpr int VEC = 8;
constexpr const char* ISA = "avx2";
#else
constexpr int VEC = 8;  // GCC's generic vectors: split into whatever registers the target has
constexpr const char* ISA = "generic";
#endif

// attention.cpp
void decode_attention(at::Tensor out, at::Tensor query, at::Tensor rows, at::Tensor k_cache, at::Tensor v_cache,
                      at::Tensor block_tables, at::Tensor context_lens, double scale);
void rope_write_kv(at::Tensor qk, at::Tensor v, at::Tensor cos, at::Tensor sin, at::Tensor k_cache, at::Tensor v_cache,
                   at::Tensor block_ids, at::Tensor offsets);

// rowwise.cpp
at::Tensor rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps, bool has_residual);
at::Tensor silu_mul(at::Tensor gate_up);

// packed_linear.cpp
at::Tensor packed_linear(at::Tensor x, at::Tensor packed, int64_t out_features);
at::Tensor packed_rows(at::Tensor packed, int64_t num_rows, at::Tensor ids);

// gated_delta.cpp
void gated_delta_net(at::Tensor out, at::Tensor qkv, at::Tensor conv_weight, at::Tensor conv_states,
                     at::Tensor recurrent_states, at::Tensor slots, at::Tensor starts, at::Tensor log_decay,
                     at::Tensor beta, int64_t num_key_heads);

}  // namespace pdserve
