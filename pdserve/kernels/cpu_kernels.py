"""Fused C++ ops for the CPU path (fp32; the KV cache in fp32, bf16 or fp16): decode paged attention,
rotary + KV write, residual-add + RMSNorm, SiLU * up, linear layers over packed weights and the Gated
DeltaNet layer. The C++ is in
``csrc/`` (one file per op family; each says what its ops save over torch's); this module loads it
and wraps its ops for the models.

Decode attention reads each sequence's KV blocks in place through its block table (the torch path
gathers them into a copy first); rotary + KV write is one pass over the new tokens (seven torch ops
otherwise); the norm and SwiGLU are one call each where torch dispatches several. Linear layers run
over weights repacked once, after loading, into panels of ``PANEL`` output features (the extension
says how many), each one contiguous stream: decode's few-row matmuls run 1.5-4x faster than MKL's GEMM
(docs/benchmarks.md); ``packed_rows`` reads rows back out of a packed table (a tied embedding's
lookups). The Gated DeltaNet kernel runs the convolution and the delta rule of every sequence of a
batch over the states in place.

Loading: the kernels are compiled at install (``pdserve build-kernels``, ``python -m
pdserve.kernels.build``: ``build.py`` says for what and where), and a start only loads the best
variant the CPU runs: AVX-512, else AVX2, else a build for the host's own instruction set.
``PDSERVE_CPU_KERNELS`` pins a variant by name (``avx2`` on an AVX-512 host measures what AVX2
machines get). Where the variant is not built, or its build is out of date, it is compiled at that
start (about a minute on 2 cores), and the log says so. Where that is impossible too (no compiler)
callers fall back to torch ops (same results to float rounding); ``cpu_ops()`` returns None then and
says why once.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
from types import ModuleType

import torch

from pdserve.kernels import build, reference
from pdserve.kernels.metadata import AttentionMetadata

logger = logging.getLogger(__name__)

VARIANT_ENV = "PDSERVE_CPU_KERNELS"
# What the attention kernels read and write a KV cache in (they compute in float32 either way).
KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def choose_variant(host_flags: frozenset[str], pinned: str | None = None) -> build.Variant:
    """The variant to load on a CPU with ``host_flags``: the one named by ``pinned`` (from
    ``PDSERVE_CPU_KERNELS``) if any, else the best shipped one the CPU runs, else ``native``."""
    if not pinned:
        return next((variant for variant in build.SHIPPED if variant.runs_on(host_flags)), build.NATIVE)
    variant = build.VARIANTS.get(pinned)
    if variant is None:
        raise ValueError(f"{VARIANT_ENV}={pinned}: not one of {', '.join(build.VARIANTS)}")
    if not variant.runs_on(host_flags):  # it would die of SIGILL at the first instruction the CPU lacks
        raise RuntimeError(f"{VARIANT_ENV}={pinned}: this CPU lacks {' '.join(sorted(variant.cpu_flags - host_flags))}")
    return variant


@functools.cache
def load(variant: build.Variant) -> ModuleType:
    """The extension module of ``variant``, from its current build, compiled first where there is none."""
    path = build.library_path(variant)
    if not path.exists():
        stale = any(path.parent.glob(f"{variant.module}-*.so"))
        logger.warning(
            "CPU kernels (%s) %s: compiling now, about a minute (run `pdserve build-kernels` after installing)",
            variant.name,
            "out of date (their sources, flags or torch changed)" if stale else "not built at install",
        )
        path = build.build(variant)
    spec = importlib.util.spec_from_file_location(variant.module, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def cpu_ops() -> ModuleType | None:
    """The compiled extension (``decode_attention``, ``rms_norm``, ``rope_write_kv``, ``packed_linear``,
    ``packed_rows``, ``silu_mul``, ``gated_delta_net``; ``PANEL``, and ``ISA`` and ``VECTOR_FLOATS``:
    what it was compiled for), or None where it can be neither loaded nor built (the reason is logged
    once)."""
    try:
        return load(choose_variant(build.host_cpu_flags(), os.environ.get(VARIANT_ENV)))
    except Exception as error:  # no compiler, headers or build directory, a pin this CPU cannot run: loudly
        logger.warning(
            "CPU kernels unavailable (%s); using torch ops",
            str(error).splitlines()[0] if str(error) else type(error).__name__,
        )
        return None


def _ops() -> ModuleType:
    """The extension, for callers that run only where it is loaded (packed weights exist only then)."""
    ops = cpu_ops()
    if ops is None:
        raise RuntimeError("the CPU kernels are unavailable (the log says why)")
    return ops


def pack_weight(weight_t: torch.Tensor) -> torch.Tensor:
    """``[in, out]`` -> the kernel's panels ``[ceil(out / PANEL), in, PANEL]``, zero-padded (``PANEL``:
    the extension's)."""
    panel = _ops().PANEL
    in_features, out_features = weight_t.shape
    full, tail = divmod(out_features, panel)
    packed = weight_t.new_zeros(full + (tail > 0), in_features, panel)
    # Panel by panel view of the same numbers: no transient copy of a large table.
    packed[:full].copy_(weight_t[:, : full * panel].view(in_features, full, panel).permute(1, 0, 2))
    if tail:
        packed[full, :, :tail] = weight_t[:, full * panel :]
    return packed


def packed_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """``x @ W.T`` for a weight packed by ``pack_weight``; ``x`` is ``[..., in]``."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    return _ops().packed_linear(rows, packed, out_features).view(*x.shape[:-1], out_features)


def packed_rows(packed: torch.Tensor, num_rows: int, ids: torch.Tensor) -> torch.Tensor:
    """``W[ids]`` (``[*ids.shape, in]``) from a weight packed by ``pack_weight`` that has ``num_rows`` rows."""
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    return _ops().packed_rows(packed, num_rows, flat).view(*ids.shape, packed.shape[1])


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
    kv_scales: tuple[float, float] = reference.NO_SCALES,
) -> bool:
    """Rotate ``qk`` [tokens, q_heads + kv_heads, head_dim] in place and store its k heads and
    ``value`` in the cache; False (nothing done) when the kernel does not apply (then the caller
    uses torch ops). ``kv_scales`` are an 8-bit cache's, which this kernel does not write."""
    applies = qk.dtype == torch.float32 and qk.device.type == "cpu" and k_cache.dtype in KV_DTYPES
    ops = cpu_ops() if applies else None
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
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    kv_scales: tuple[float, float] = reference.NO_SCALES,
) -> torch.Tensor:
    """``reference.paged_attention`` with the decodes computed by the fused kernel (fp32 queries over a
    ``KV_DTYPES`` cache, when it could be built); prefill chunks, other dtypes and kernel-less hosts use
    the reference (an 8-bit cache's ``kv_scales`` with it)."""
    ops = cpu_ops() if query.dtype == torch.float32 and k_cache.dtype in KV_DTYPES else None
    if ops is None:
        return reference.paged_attention(query, k_cache, v_cache, metadata, scale, kv_scales)
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
    ops.gated_delta_net(
        out,
        qkv,
        conv_weight.contiguous(),
        conv_states,
        recurrent_states,
        metadata.state_slots,
        metadata.query_starts,
        log_decay.contiguous(),
        beta.contiguous(),
        num_key_heads,
    )
    return True
