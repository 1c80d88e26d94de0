"""A Gated DeltaNet layer (Qwen3.5's linear attention): its projections, and the sequence mixing of
a scheduled batch over the requests' state slots.

Tokens arrive flattened, as for attention; ``metadata`` says where each sequence's tokens are and
``metadata.state_slots`` which slot holds its state. A layer's state is two tensors indexed by
slot: the convolution's last ``width - 1`` inputs ``[slots, channels, width - 1]`` and the
recurrent state ``[slots, value_heads, key_dim, value_dim]`` (float32). The model runner zeroes a
slot before its request's first token; after that every step continues from what the slot holds,
so a prompt may be computed over several steps (chunked prefill). Decodes (one token each) run
batched through the recurrent form; prompt chunks batched through the chunked form, padded to the
longest. On a CPU in float32 one fused kernel (``cpu_kernels.gated_delta_net``) does both, in the
recurrent form over the slots in place.

Under tensor parallelism a rank holds its share of the key heads and of the value heads (they
group alike: value head j reads key head j // group), so its slots hold their states only; the
output projection is row-parallel and all-reduces.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from pdserve.kernels import cpu_kernels, gated_delta
from pdserve.kernels.metadata import AttentionMetadata
from pdserve.models.config import ModelConfig
from pdserve.models.linear import Linear, RowParallelLinear
from pdserve.models.parallel import TensorParallel


class GatedRMSNorm(nn.Module):
    """RMSNorm over each value head's output, then times SiLU of the gate (in float32)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (normed * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.num_key_heads = config.linear_num_key_heads
        self.num_value_heads = config.linear_num_value_heads
        self.key_dim = config.linear_key_head_dim
        self.value_dim = config.linear_value_head_dim
        self.conv_dim = config.linear_conv_dim
        value_size = self.num_value_heads * self.value_dim
        # The checkpoint's in_proj_qkv, in_proj_z, in_proj_b and in_proj_a, fused into one matmul.
        self.split_sizes = [self.conv_dim, value_size, self.num_value_heads, self.num_value_heads]
        self.in_proj = Linear(config.hidden_size, sum(self.split_sizes), bias=False)
        self.conv1d_weight = nn.Parameter(torch.empty(self.conv_dim, 1, config.linear_conv_kernel_dim))
        self.dt_bias = nn.Parameter(torch.empty(self.num_value_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_value_heads))
        self.norm = GatedRMSNorm(self.value_dim, config.rms_norm_eps)
        self.out_proj = RowParallelLinear(value_size, config.hidden_size, False, tp)

    def forward(
        self,
        rope: object,
        hidden: torch.Tensor,
        state: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """The layer's output for the batch's tokens (``rope`` unused: position is in the state)."""
        conv_states, recurrent_states = state
        num_tokens = hidden.shape[0]
        qkv, z, b, a = self.in_proj(hidden).split(self.split_sizes, dim=-1)
        beta = b.sigmoid()
        log_decay = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        out = torch.empty(num_tokens, self.num_value_heads, self.value_dim, dtype=hidden.dtype, device=hidden.device)
        slots = metadata.state_slots
        assert slots is not None, "a linear-attention layer needs the batch's state slots"
        conv_weight = self.conv1d_weight[:, 0]
        if cpu_kernels.gated_delta_net(out, qkv, conv_weight, state, metadata, log_decay, beta, self.num_key_heads):
            return self._output(out, z)
        tokens = metadata.decode_token_indices
        if tokens.numel():
            # Gathered, computed on, written back: one token of each decoding sequence at once.
            decode_slots = slots[metadata.decode_seq_indices]
            conv = conv_states[decode_slots]
            mixed = gated_delta.causal_conv1d_step(qkv[tokens], conv_weight, conv)
            conv_states[decode_slots] = conv
            recurrent = recurrent_states[decode_slots]
            out[tokens] = gated_delta.recurrent_gated_delta_rule(
                *self._heads(mixed), log_decay[tokens], beta[tokens], recurrent
            )
            recurrent_states[decode_slots] = recurrent
        if metadata.prefill_seq_indices:
            self._prompt_chunks(qkv, log_decay, beta, state, metadata, out)
        return self._output(out, z)

    def _output(self, out: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The mixed values ``[tokens, value_heads, value_dim]`` normed, gated by ``z`` and projected."""
        gated = self.norm(out, z.view(out.shape))
        return self.out_proj(gated.view(out.shape[0], -1))

    def _prompt_chunks(
        self,
        qkv: torch.Tensor,
        log_decay: torch.Tensor,
        beta: torch.Tensor,
        state: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
        out: torch.Tensor,
    ) -> None:
        """The batch's prompt chunks (more than one token each): each through its convolution, then
        all together through the chunked delta rule, padded to the longest (a padded token writes
        nothing and forgets nothing)."""
        conv_states, recurrent_states = state
        assert metadata.state_slots is not None
        conv_weight = self.conv1d_weight[:, 0]
        starts, seqs = metadata.query_start_loc, metadata.prefill_seq_indices
        spans = [(starts[seq], starts[seq + 1]) for seq in seqs]
        slots = metadata.state_slots[seqs]
        mixed = [
            gated_delta.causal_conv1d(qkv[start:end], conv_weight, conv_states[int(slot)])
            for (start, end), slot in zip(spans, slots, strict=True)
        ]
        if len(spans) == 1:
            (start, end), recurrent = spans[0], recurrent_states[int(slots[0])]
            out[start:end] = gated_delta.chunked_gated_delta_rule(
                *self._heads(mixed[0]), log_decay[start:end], beta[start:end], recurrent
            )
            return
        recurrent = recurrent_states[slots]
        chunks = gated_delta.chunked_gated_delta_rule(
            *self._heads(pad_sequence(mixed, batch_first=True)),
            pad_sequence([log_decay[start:end] for start, end in spans], batch_first=True),
            pad_sequence([beta[start:end] for start, end in spans], batch_first=True),
            recurrent,
        )
        recurrent_states[slots] = recurrent
        for index, (start, end) in enumerate(spans):
            out[start:end] = chunks[index, : end - start]

    def _heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The convolution's output ``[..., tokens, channels]`` as q, k ``[..., tokens, key_heads,
        key_dim]`` and v ``[..., tokens, value_heads, value_dim]``."""
        key_size = self.num_key_heads * self.key_dim
        q, k, v = mixed.split([key_size, key_size, mixed.shape[-1] - 2 * key_size], dim=-1)
        leading = mixed.shape[:-1]
        return (
            q.view(*leading, self.num_key_heads, self.key_dim),
            k.view(*leading, self.num_key_heads, self.key_dim),
            v.view(*leading, self.num_value_heads, self.value_dim),
        )
