"""Gated DeltaNet's sequence mixing in torch (Qwen3.5's linear-attention layers): the causal
depthwise convolution with its rolling state, and the gated delta rule with its recurrent state,
in the chunked form (prompts) and the recurrent form (decode steps).

Per value head the recurrent state ``S`` is a ``[key_dim, value_dim]`` matrix. A token with
query q, key k (both L2-normalised, q also scaled by ``key_dim ** -0.5``), value v, log-decay
g <= 0 and write strength beta in (0, 1) does::

    S = exp(g) * S
    S = S + k (beta * (v - S^T k))^T        # the delta rule: write the part of v that S mispredicts
    o = S^T q

The chunked form computes the same for ``chunk_size`` tokens at once: within a chunk the writes
depend on each other through a unit lower-triangular system (solved once per chunk), so a prompt
costs a few matmuls per chunk instead of a loop over its tokens. Key heads may be fewer than value
heads: each key head serves consecutive value heads.

The state tensors are the caller's (a request's state slot) and are updated in place, so a prompt
computed in several chunks of a scheduler step carries its state from one to the next. Everything
runs in float32 whatever the model dtype, as the reference implementation does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _heads_first(query: torch.Tensor, key: torch.Tensor, num_value_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k ``[..., key_heads, key_dim]`` → float32, one per value head, L2-normalised, q scaled."""
    group = num_value_heads // key.shape[-2]
    query = query.float().repeat_interleave(group, dim=-2)
    key = key.float().repeat_interleave(group, dim=-2)
    query = query * torch.rsqrt((query * query).sum(-1, keepdim=True) + 1e-6) * query.shape[-1] ** -0.5
    key = key * torch.rsqrt((key * key).sum(-1, keepdim=True) + 1e-6)
    return query, key


def chunked_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    log_decay: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = 64,
) -> torch.Tensor:
    """Sequences' tokens, any leading batch dimensions ``...``: q, k ``[..., tokens, key_heads,
    key_dim]``, v ``[..., tokens, value_heads, value_dim]``, log_decay and beta ``[..., tokens,
    value_heads]``; ``state`` ``[..., value_heads, key_dim, value_dim]`` (float32) is read and
    replaced by the state after the last token. Returns the outputs ``[..., tokens, value_heads,
    value_dim]`` in v's dtype.

    Sequences of different lengths batch by padding at the end with beta = 0 (nothing written) and
    log_decay = 0 (nothing forgotten): a padded token leaves the state as it is."""
    num_tokens, num_heads = value.shape[-3], value.shape[-2]
    query, key = _heads_first(query, key, num_heads)
    q, k = query.transpose(-3, -2), key.transpose(-3, -2)  # [..., heads, tokens, key_dim]
    v = value.float().transpose(-3, -2)
    g, b = log_decay.float().transpose(-1, -2), beta.float().transpose(-1, -2)  # [..., heads, tokens]
    value_dim = v.shape[-1]
    out = torch.empty_like(v)
    s = state.float().clone()
    for start in range(0, num_tokens, chunk_size):
        end = min(start + chunk_size, num_tokens)
        qc, kc, vc = q[..., start:end, :], k[..., start:end, :], v[..., start:end, :]
        bc = b[..., start:end, None]
        cumulative = g[..., start:end].cumsum(-1)  # log of the decay from the chunk's start to each token
        n = end - start
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        # decay[i, j]: from token j to token i (i >= j); 0 above the diagonal.
        decay = (cumulative[..., :, None] - cumulative[..., None, :]).masked_fill(~causal, float("-inf")).exp()
        kb = kc * bc
        # Token i's write corrects for the earlier tokens' writes in the chunk: (I + strictly lower) x = rhs.
        system = (kb @ kc.transpose(-1, -2)) * decay
        rhs = torch.cat([vc * bc, kb * cumulative.exp()[..., None]], dim=-1)
        solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        writes, reads = solved[..., :value_dim], solved[..., value_dim:]
        new_values = writes - reads @ s  # what each token writes, given the state at the chunk's start
        attention = (qc @ kc.transpose(-1, -2)) * decay
        out[..., start:end, :] = (qc * cumulative.exp()[..., None]) @ s + attention @ new_values
        to_end = (cumulative[..., -1:] - cumulative).exp()[..., None]
        s = s * cumulative[..., -1].exp()[..., None, None] + (kc * to_end).transpose(-1, -2) @ new_values
    state.copy_(s)
    return out.transpose(-3, -2).to(value.dtype)


def recurrent_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    log_decay: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
) -> torch.Tensor:
    """One token of each of a batch of sequences (a decode step): q, k ``[batch, key_heads,
    key_dim]``, v ``[batch, value_heads, value_dim]``, log_decay and beta ``[batch, value_heads]``;
    ``states`` ``[batch, value_heads, key_dim, value_dim]`` (float32, contiguous) updated in place.
    Returns ``[batch, value_heads, value_dim]`` in v's dtype.

    Decode steps are bound by reading and writing the states, so the old state is read once, by one
    batched matmul for both ``S^T k`` and ``S^T q``; with d the decay and delta the write,
    ``S' = d S + k delta^T`` is made in place and the output follows from the old reads:
    ``S'^T q = d S^T q + (k . q) delta``."""
    batch, num_heads, value_dim = value.shape
    q, k = _heads_first(query, key, num_heads)
    key_dim = k.shape[-1]
    decay = log_decay.float().exp()[..., None]  # [batch, heads, 1]
    flat = states.view(batch * num_heads, key_dim, value_dim)
    reads = torch.bmm(torch.stack([k, q], dim=-2).view(-1, 2, key_dim), flat).view(batch, num_heads, 2, value_dim)
    delta = (value.float() - reads[..., 0, :] * decay) * beta.float()[..., None]
    flat.mul_(decay.view(-1, 1, 1))
    flat.baddbmm_(k.reshape(-1, key_dim, 1), delta.view(-1, 1, value_dim))
    out = reads[..., 1, :] * decay + (k * q).sum(-1, keepdim=True) * delta
    return out.to(value.dtype)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """One sequence's tokens ``[tokens, channels]`` through a depthwise causal convolution
    (``weight`` ``[channels, width]``) then SiLU; ``state`` ``[channels, width - 1]`` holds the
    inputs before these tokens (oldest first) and is replaced by the last ``width - 1`` inputs."""
    history = torch.cat([state.to(x.dtype), x.t()], dim=-1)  # [channels, width - 1 + tokens]
    state.copy_(history[:, history.shape[-1] - state.shape[-1] :])
    out = F.conv1d(history.unsqueeze(0), weight.unsqueeze(1), groups=weight.shape[0])
    return F.silu(out[0].t())


def causal_conv1d_step(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
    """One token of each of a batch of sequences, ``[batch, channels]``; ``states`` ``[batch,
    channels, width - 1]`` updated in place."""
    window = torch.cat([states.to(x.dtype), x.unsqueeze(-1)], dim=-1)  # [batch, channels, width]
    states.copy_(window[..., 1:])
    return F.silu((window * weight).sum(-1))
