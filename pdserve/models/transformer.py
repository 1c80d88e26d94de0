"""The shared building blocks of every family's decoder (RMSNorm, the vocabulary-parallel
embedding, attention, the SwiGLU MLP, the decoder layer) and the decoder-only model made of them.
Which variant a family uses its declaration says (``models/family.py``, one module per family),
and ModelConfig carries: biases on q/k/v, RMSNorm over q and k heads, an output gate, rotary over
part of a head; which layers route tokens to experts (``models/moe.py``) instead of one MLP; which
mix tokens with Gated DeltaNet linear attention (``models/gated_deltanet.py``) instead of attention.

q/k/v and gate/up projections are fused into one matmul each (the loader fills each part from the
checkpoint's separate tensors). Tokens arrive flattened across the batch, ``[num_tokens, hidden]``,
with their positions; attention goes through the paged KV cache, linear attention through each
request's state slot (a layer's "cache" is then its state tensors).

Under tensor parallelism (``models/parallel.py``) a rank's modules are built from its share of the
model (``rank_config``: its heads, KV heads and intermediate features); o and down projections
all-reduce, the embedding and the LM head split the vocabulary. One rank computes as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels import cpu_kernels
from pdserve.kernels.activation import swiglu
from pdserve.kernels.metadata import AttentionMetadata
from pdserve.models.attention import AttentionBackend
from pdserve.models.config import ModelConfig
from pdserve.models.gated_deltanet import GatedDeltaNet
from pdserve.models.linear import Linear, RowParallelLinear
from pdserve.models.moe import SparseMoeBlock
from pdserve.models.parallel import TensorParallel
from pdserve.models.rope import RotaryEmbedding, apply_rotary

# One layer's (K, V), each [blocks, block_size, kv_heads, head_dim]; for a linear-attention layer its
# (convolution, recurrent) state tensors, indexed by state slot.
KVCache = tuple[torch.Tensor, torch.Tensor]
Rope = tuple[torch.Tensor, torch.Tensor]  # the batch's (cos, sin), from RotaryEmbedding.for_positions


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm of ``x``; given ``residual``, of ``residual + x``, returning (normed, the sum), the
        sum being the next residual (it may be computed in ``residual``'s memory)."""
        fused = cpu_kernels.rms_norm(x, self.weight, self.eps, residual)
        if fused is not None:
            return fused if residual is None else (fused, residual)
        if residual is not None:
            x = residual = residual + x
        # In float32 whatever the model dtype, as the reference implementations do.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        normed = self.weight * x32.to(x.dtype)
        return normed if residual is None else (normed, residual)


class VocabParallelEmbedding(nn.Module):
    """The embedding table split by vocabulary rows: a rank looks up the ids in its range, zeros
    the rest, and the sum over ranks is the embedding. The same rows give the LM head's logits
    when the model ties them; on a CPU running fp32 the table is then kept only in the packed
    kernel's panels (``pack_for_cpu``), where the LM head reads it fastest."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.ranges = tp.vocab_ranges(vocab_size)
        self.start, self.end = self.ranges[tp.rank]
        self.weight = nn.Parameter(torch.empty(self.end - self.start, hidden_size))
        self.register_buffer("packed", None, persistent=False)

    @torch.no_grad()
    def pack_for_cpu(self) -> None:
        self.packed = cpu_kernels.pack_weight(self.weight.t())
        del self.weight

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return cpu_kernels.packed_rows(self.packed, self.end - self.start, ids)
        return F.embedding(ids, self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._lookup(input_ids)
        outside = (input_ids < self.start) | (input_ids >= self.end)
        local = (input_ids - self.start).masked_fill_(outside, 0)
        return self.tp.all_reduce(self._lookup(local).masked_fill_(outside.unsqueeze(-1), 0.0))

    def local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden @ table.T``: this rank's columns of the logits, for a model whose LM head is tied."""
        if self.packed is not None:
            return cpu_kernels.packed_linear(hidden, self.packed, self.end - self.start)
        return F.linear(hidden, self.weight)

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        """The whole vocabulary's logits from every rank's columns."""
        return self.tp.all_gather_columns(local, [end - start for start, end in self.ranges])


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, tp: TensorParallel) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.rotary_dim = config.rotary_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        # A gated model's q projection gives each head its query then its gate, side by side.
        self.gated = config.attn_output_gate
        self.q_width = 2 * self.q_size if self.gated else self.q_size
        self.scale = config.head_dim**-0.5
        self.qkv_proj = Linear(config.hidden_size, self.q_width + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = RowParallelLinear(self.q_size, config.hidden_size, config.o_bias, tp)
        # An 8-bit KV cache's (k, v) scales: the checkpoint's ``self_attn.k_scale`` / ``v_scale`` where it has
        # them (the loader sets them), else 1.0. Other cache dtypes ignore them.
        self.kv_scales = (1.0, 1.0)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.backend = backend

    def forward(self, rope: Rope, hidden: torch.Tensor, kv_cache: KVCache, metadata: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        k_end = self.q_width + self.kv_size
        v = qkv[:, k_end:].view(num_tokens, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        if self.q_norm is None and not self.gated:
            # q and k heads sit side by side in qkv: rotate them in place, in one pass.
            qk = qkv[:, :k_end].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        else:
            q = qkv[:, : self.q_width].view(num_tokens, self.num_heads, -1)[..., : self.head_dim]
            k = qkv[:, self.q_width : k_end].view(num_tokens, self.num_kv_heads, self.head_dim)
            if self.q_norm is not None and self.k_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            qk = torch.cat([q, k], dim=1)
        if self.rotary_dim == self.head_dim:
            self.backend.rotate_and_cache(qk, v, *rope, k_cache, v_cache, metadata, self.kv_scales)
        else:  # partial rotary: the leading features of each head turn, the rest pass as they are
            turned = qk[..., : self.rotary_dim]
            turned.copy_(apply_rotary(turned, *rope))
            self.backend.write_kv(qk[:, self.num_heads :], v, k_cache, v_cache, metadata, self.kv_scales)
        q = qk[:, : self.num_heads]
        out = self.backend.paged_attention(q, k_cache, v_cache, metadata, self.scale, self.kv_scales)
        if self.gated:
            gate = qkv[:, : self.q_width].view(num_tokens, self.num_heads, -1)[..., self.head_dim :]
            out = out.view(num_tokens, self.num_heads, self.head_dim) * torch.sigmoid(gate)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, config.mlp_bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, tp: TensorParallel, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # The token mixer: attention on paged KV, or (hybrid models) linear attention on a state slot.
        self.self_attn = None if index in config.linear_layers else Attention(config, backend, tp)
        self.linear_attn = GatedDeltaNet(config, tp) if index in config.linear_layers else None
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: nn.Module = SparseMoeBlock(config, tp) if index in config.moe_layers else MLP(config, tp)

    def forward(
        self,
        rope: Rope,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it): the residual add is deferred
        into the next norm, where it fuses."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        mixer: nn.Module | None = self.linear_attn if self.self_attn is None else self.self_attn
        assert mixer is not None
        hidden = mixer(rope, hidden, kv_cache, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class CausalLM(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        rotary: RotaryEmbedding,
        tp: TensorParallel | None = None,
    ) -> None:
        """``config``: the model as this rank holds it (``parallel.rank_config``)."""
        super().__init__()
        tp = tp or TensorParallel()
        self.config = config
        self.rotary = rotary
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(config, backend, tp, index) for index in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        rows = self.embed_tokens.end - self.embed_tokens.start
        self.lm_head = None if config.tie_word_embeddings else Linear(config.hidden_size, rows, bias=False)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache], metadata: AttentionMetadata
    ) -> torch.Tensor:
        """Final hidden states ``[num_tokens, hidden]`` of a flattened batch."""
        hidden = self.embed_tokens(input_ids)
        residual = None
        rope = self.rotary.for_positions(positions)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(rope, hidden, residual, kv_cache, metadata)
        return self.norm(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self.embed_tokens.local_logits(hidden) if self.lm_head is None else self.lm_head(hidden)
        return self.embed_tokens.gather_logits(local)

    def pack_for_cpu(self) -> None:
        """Repack the weights of every linear layer (and of a tied embedding table: the LM head's)
        for the CPU kernels (fp32 on a CPU where they are built); the unpacked copies are dropped.
        An untied table is only looked up, which contiguous rows serve best: it stays as it is."""
        for module in self.modules():
            if isinstance(module, (Linear, SparseMoeBlock)) or (module is self.embed_tokens and self.lm_head is None):
                module.pack_for_cpu()
