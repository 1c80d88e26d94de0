"""The CPU linear-layer kernel (``cpu_kernels.packed_linear``) against torch's matmul, per batch size.

The shapes are ``bench/throughput.py``'s ~110M Llama: per layer the qkv (768 -> 2304), o (768 -> 768),
gate/up (768 -> 4096) and down (2048 -> 768) projections, 12 layers of them (340 MB of fp32 weights,
more than the last-level cache: every pass reads them from memory, as a decode step does), and the
tied LM head (768 -> 32000, 98 MB). For each row count M it times one pass over all 12 layers and
one LM head, best of ``--repeats``:

- ``torch.mm`` on the ``[in, out]`` layout the layers used before (MKL on x86);
- ``F.linear`` on the ``[out, in]`` layout (the LM head's, before);
- ``packed_linear`` on the packed panels, which is what the engine runs now.

Results are checked equal (to float rounding) before timing. Last line: JSON with the ratios.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import pdserve  # noqa: F401  (before torch loads: how its OpenMP threads wait, pdserve.OPENMP_ENV)

# isort: split
import torch
import torch.nn.functional as F

from pdserve.kernels import cpu_kernels

LAYER_SHAPES = [(768, 2304), (768, 768), (768, 4096), (2048, 768)]
LAYERS = 12
VOCAB = 32000


def best_ms(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def measure(rows: int, weights: list, packed: list, table: torch.Tensor, packed_table: torch.Tensor, repeats: int):
    """(layers torch.mm ms, layers packed ms, LM head F.linear ms, LM head packed ms) at ``rows`` rows."""
    generator = torch.Generator().manual_seed(rows)
    inputs = {k: torch.randn(rows, k, generator=generator) for k, _ in LAYER_SHAPES}
    hidden = torch.randn(rows, 768, generator=generator)
    for (k, n), w, p in zip(LAYER_SHAPES, weights[0], packed[0], strict=True):
        torch.testing.assert_close(cpu_kernels.packed_linear(inputs[k], p, n), inputs[k] @ w, atol=1e-3, rtol=1e-4)
    head = F.linear(hidden, table)
    torch.testing.assert_close(cpu_kernels.packed_linear(hidden, packed_table, VOCAB), head, atol=1e-3, rtol=1e-4)

    def layers_mm() -> None:
        for layer in weights:
            for (k, _), w in zip(LAYER_SHAPES, layer, strict=True):
                torch.mm(inputs[k], w)

    def layers_packed() -> None:
        for layer in packed:
            for (k, n), p in zip(LAYER_SHAPES, layer, strict=True):
                cpu_kernels.packed_linear(inputs[k], p, n)

    return (
        best_ms(layers_mm, repeats),
        best_ms(layers_packed, repeats),
        best_ms(lambda: F.linear(hidden, table), repeats),
        best_ms(lambda: cpu_kernels.packed_linear(hidden, packed_table, VOCAB), repeats),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256, 2048])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if cpu_kernels.cpu_ops() is None:
        raise SystemExit("the CPU kernels could not be built (see the warning above)")
    generator = torch.Generator().manual_seed(0)
    weights = [[torch.randn(k, n, generator=generator) / k**0.5 for k, n in LAYER_SHAPES] for _ in range(LAYERS)]
    packed = [[cpu_kernels.pack_weight(w) for w in layer] for layer in weights]
    table = torch.randn(VOCAB, 768, generator=generator)
    packed_table = cpu_kernels.pack_weight(table.t())
    capability = torch.backends.cpu.get_cpu_capability()
    print(f"cpu: {cpu_name()}, torch threads {torch.get_num_threads()}, torch CPU capability {capability}")
    print("    M | layers: torch.mm ms, packed ms, speed-up | LM head: F.linear ms, packed ms, speed-up")
    ratios = {}
    for rows in args.rows:
        mm, pk, head, head_pk = measure(rows, weights, packed, table, packed_table, args.repeats)
        ratios[rows] = {"layers": round(mm / pk, 2), "lm_head": round(head / head_pk, 2)}
        print(f"{rows:>5} | {mm:8.1f} {pk:8.1f} {mm / pk:6.2f}x | {head:8.1f} {head_pk:8.1f} {head / head_pk:6.2f}x")
    print(json.dumps({"bench": "cpu_matmul", "cpu": cpu_name(), "capability": capability, "speedup": ratios}))


if __name__ == "__main__":
    main()
