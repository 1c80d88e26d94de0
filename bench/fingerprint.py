"""The weights fingerprint's cost on a 1 GiB checkpoint (pdserve/models/fingerprint.py).

Writes a 1 GiB safetensors file (16 float32 tensors of 64 MiB) to a temporary folder, then times, with the file
evicted from the page cache before each cold measurement (posix_fadvise DONTNEED: no root needed):
(a) the fingerprint with an empty digest cache, the file cold (one read of every byte, BLAKE3);
(b) the fingerprint again (the digest cache: nothing read);
(c) loading every tensor with safetensors, the file cold;
(d) the same load right after (a)'s read (what an engine's start does: fingerprint, then load).
Median of 3 each. Last line: {"bench": "fingerprint", ...}.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

TENSORS = 16
TENSOR_BYTES = 64 << 20
REPEATS = 3


def _evict(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
        os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(descriptor)


def _load(path: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as checkpoint:
        for name in checkpoint.keys():  # noqa: SIM118 (safe_open is not a dict)
            checkpoint.get_tensor(name).sum()


def _timed(action, repeats: int = REPEATS, before=None) -> float:
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    import pdserve  # noqa: F401 (before torch: its OpenMP settings)

    # isort: split
    import torch
    from safetensors.torch import save_file

    from pdserve.models.fingerprint import weights_fingerprint

    with tempfile.TemporaryDirectory() as folder:
        model = Path(folder) / "model"
        model.mkdir()
        generator = torch.Generator().manual_seed(0)
        tensors = {f"t{i}": torch.rand(TENSOR_BYTES // 4, generator=generator) for i in range(TENSORS)}
        weights = model / "model.safetensors"
        save_file(tensors, str(weights))
        del tensors
        (model / "config.json").write_text("{}")
        size = weights.stat().st_size
        caches = iter(range(1000))

        def cold() -> None:
            _evict(weights)

        fresh = _timed(lambda: weights_fingerprint(model, Path(folder) / f"cache{next(caches)}"), before=cold)
        cached_dir = Path(folder) / "kept"
        weights_fingerprint(model, cached_dir)
        cached = _timed(lambda: weights_fingerprint(model, cached_dir))
        load_cold = _timed(lambda: _load(weights), before=cold)

        def fingerprint_then_load() -> tuple[float, float]:
            cold()
            start = time.perf_counter()
            weights_fingerprint(model, Path(folder) / f"cache{next(caches)}")
            middle = time.perf_counter()
            _load(weights)
            return middle - start, time.perf_counter() - middle

        pairs = [fingerprint_then_load() for _ in range(REPEATS)]
        load_warm = statistics.median(load for _, load in pairs)
        both = statistics.median(first + load for first, load in pairs)
    gib = size / (1 << 30)
    print(f"checkpoint: {gib:.2f} GiB, {TENSORS} tensors; median of {REPEATS}")
    print(f"(a) fingerprint, empty digest cache, file cold: {fresh:.2f} s ({size / fresh / 1e9:.2f} GB/s)")
    print(f"(b) fingerprint, digest cached:                 {cached * 1e3:.2f} ms")
    print(f"(c) load, file cold:                            {load_cold:.2f} s")
    print(f"(d) load right after the fingerprint's read:    {load_warm:.2f} s (fingerprint + load: {both:.2f} s)")
    print(
        json.dumps(
            {
                "bench": "fingerprint",
                "gib": round(gib, 2),
                "fresh_s": round(fresh, 3),
                "cached_ms": round(cached * 1e3, 3),
                "load_cold_s": round(load_cold, 3),
                "load_after_fingerprint_s": round(load_warm, 3),
                "fingerprint_and_load_s": round(both, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
