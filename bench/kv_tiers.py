"""KV tiers: TTFT after an engine restart (disk tier) against a cold prefill, and the disk tier's load path
against the disk's sequential read bandwidth.

Model and engine: the ~85M Llama of bench/pd_vs_colocated.py (fp32; 12 layers x 12 KV heads x 64 x 2 x 4 bytes
= 72 KiB of KV per token, 1.125 MiB per 16-token block), one colocated engine (`pdserve serve --mode colocated`,
both cores, 2 torch threads, a 1 GiB KV pool, --max-model-len 2048). Every engine is fresh and gets one short
warm-up request (an unrelated 40-token prompt) before the measured one. The measured request is one long prompt
(--prompt-tokens, default 1992: 124 full blocks and 8 tokens; seeded random token ids) to /v1/completions,
streamed, max_tokens 1, temperature 0; TTFT is the client's time to the first chunk. Per repeat (--repeats, 3):

- cold: an engine without a tier;
- cold+store: an engine with --kv-tier-disk on a fresh, empty folder (the same prefill, plus the tier's stores:
  an engine-thread copy of each block and the I/O thread's writes). Then the bench waits (bounded, 60 s) until the
  engine's pdserve_kv_tier_stored_bytes_total shows every full block of the prompt stored, and stops it (SIGTERM).
  The worker side's store reports reach the scheduler only in a step, so an idle engine never confirms its last
  stores: while waiting, the bench sends 1-token requests (no full block) to make it step;
- restarted: a new engine on that folder (it finds the files at start) sends the same prompt: the prompt's blocks
  load from the disk tier, the rest is computed. The files were just written, so they are in the page cache;
- restarted, dropped: the same folder after os.sync() and posix_fadvise(DONTNEED) on every block file (the
  page-cache share of the prompt's files is checked with mincore(2) just before the request, and printed).

The restarted engines run with --kv-tier-always-load (the first load of a fresh engine loads anyway: its cost
model knows no bandwidth yet; the flag only makes that certain). Figures: median TTFT of each, the ratios
cold / restarted, the restarted requests' tier hit tokens, and the engine's own load time and bytes
(pdserve_kv_tier_load_seconds, pdserve_kv_tier_loaded_bytes_total: the load's GB/s inside the engine).

Disk bandwidth, in this process, no engine: block files written with the tier's own BlockFolder.write (random
payloads), for the bench model's block (1.125 MiB; --disk-mib of them, default 1024) and the demo model's (64 KiB;
--demo-mib, default 256), at most a quarter of the free space each, read back with BlockFolder.read_into (the exact
load call: header checks, the payload read straight into its row of a preallocated buffer, BLAKE3) against a
plain sequential read of one file of the same total bytes (written with 8 MiB writes, read with 8 MiB readinto
into the same buffer). Each both cold (after os.sync() and fadvise DONTNEED on every file, the page-cache share
checked with mincore) and warm (read once, then timed), --disk-repeats (5) times, each repeat reading both ways
back to back; the ratio is given of the medians and as the median of the repeats' ratios (steadier when the disk's
speed drifts). The goal is the load path >= 50% of the sequential read in the same state. A "cold" read on a
virtual disk may still be served from the host's cache: the guest's page cache is what fadvise drops. A what-if
row (not the tier's code): fadvise(WILLNEED) on every file of the load first, then read_into each, cold. Then a
per-block profile of the load path's phases (open, header read and checks, payload read, end-of-file check,
close, BLAKE3) over the same files, cold and warm: a replica of read_into with timers, so its total is a little
above the real call's.

About 3.5 minutes on 2 cores (12 engine starts; 1.25 GiB of block files read about 30 times over). Prints
tables; with --plot DIR writes DIR/kv_tiers_restart.png and DIR/kv_tiers_disk.png. Last line JSON
{"bench": "kv_tiers", ...}.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import mmap
import os
import random
import shutil
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
from pd_vs_colocated import build_model, free_port, start
from plots import add_plot_argument, bar_chart

from pdserve.kvtransfer.tiers.block_file import _FIXED, HEADER_BYTES, SUFFIX, BlockFolder
from pdserve.models.config import ModelConfig
from pdserve.testing.metrics import metric, scrape
from pdserve.testing.processes import Process, cpu_engine_flags

MAX_MODEL_LEN = 2048
ENGINE_FLAGS = cpu_engine_flags("1GiB", max_model_len=MAX_MODEL_LEN, served_model_name="bench")
BLOCK_SIZE = 16
WARMUP_TOKENS = 40
NUDGE = [5]
DEMO_BLOCK_BYTES = BLOCK_SIZE * 2 * 4 * 2 * 64 * 4  # the demo model: 4 layers, 2 KV heads of 64, fp32
COMPAT = "ab" * 16  # any valid compatibility hash: the bench's own folder
CHUNK = 8 << 20
STORE_WAIT_S = 60.0
DISK = {"medium": "disk"}


# ----- the page cache ---------------------------------------------------------------------------------------------

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
PAGE = mmap.PAGESIZE


def block_files(folder: Path) -> list[Path]:
    return sorted(folder.rglob(f"*{SUFFIX}"))


def drop_cache(paths: list[Path]) -> None:
    """Write back everything, then ask the kernel to drop these files' pages (clean pages go)."""
    os.sync()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident(paths: list[Path]) -> float:
    """The share of these files' pages in the page cache (mincore(2) over a read-only mapping of each)."""
    pages = in_cache = 0
    for path in paths:
        size = path.stat().st_size
        if size == 0:
            continue
        count = (size + PAGE - 1) // PAGE
        vector = (ctypes.c_ubyte * count)()
        fd = os.open(path, os.O_RDONLY)
        try:
            address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if address in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap {path}")
            try:
                if _libc.mincore(address, size, vector) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore {path}")
            finally:
                _libc.munmap(address, size)
        finally:
            os.close(fd)
        pages += count
        in_cache += sum(byte & 1 for byte in vector)
    return in_cache / max(pages, 1)


def filesystem(path: Path) -> str:
    """The device, type and mount point of the file system holding ``path`` (from /proc/self/mounts)."""
    resolved, best = str(path.resolve()), ("?", "?", "")
    with open("/proc/self/mounts") as mounts:
        for line in mounts:
            device, mount, kind = line.split()[:3]
            inside = resolved == mount or resolved.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) >= len(best[2]):
                best = (device, kind, mount)
    return f"{best[0]} ({best[1]}, mounted at {best[2]})"


# ----- part 1: restart ----------------------------------------------------------------------------------------------


def ttft_s(url: str, prompt: list[int]) -> float:
    """Seconds to the first streamed chunk of a max_tokens 1 completion of ``prompt`` (token ids)."""
    body = json.dumps(
        {"model": "bench", "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True, "ignore_eos": True}
    ).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    started = time.perf_counter()
    first = None
    with urllib.request.urlopen(request, timeout=300) as response:
        for line in response:
            if first is None and line.startswith(b"data:") and b'"choices"' in line:
                first = time.perf_counter() - started
        if first is None:
            raise RuntimeError("the stream ended without a chunk")
    return first


def tier_counters(url: str) -> dict[str, float]:
    values = scrape(url)
    return {
        "hit_tokens": metric(values, "pdserve_kv_tier_hit_tokens_total", **DISK),
        "loaded_bytes": metric(values, "pdserve_kv_tier_loaded_bytes_total", **DISK),
        "stored_bytes": metric(values, "pdserve_kv_tier_stored_bytes_total", **DISK),
        "load_seconds": metric(values, "pdserve_kv_tier_load_seconds_sum", **DISK),
        "loads": metric(values, "pdserve_kv_tier_load_seconds_count", **DISK),
        "skipped": sum(v for k, v in values.items() if k.startswith("pdserve_kv_tier_blocks_skipped_total")),
        "prefix_hits": metric(values, "pdserve_prefix_cache_hits_total"),
    }


def engine(name: str, model: Path, scratch: Path, tier: Path | None) -> Process:
    port = free_port()
    argv = ["serve", "--mode", "colocated", "--port", str(port), "--model", str(model), *ENGINE_FLAGS]
    if tier is not None:
        argv += ["--kv-tier-disk", str(tier), "--kv-tier-always-load"]
    process = start(name, port, argv, scratch, "0,1", 2)
    try:
        process.wait_healthy(300)
    except BaseException:
        process.stop()
        raise
    return process


def measure(
    name: str, model: Path, scratch: Path, tier: Path | None, prompt: list[int], warmup: list[int], store: bool
) -> dict:
    """One fresh engine: warm-up, the measured request, its tier counters' differences; waits for the stores when
    ``store``; stopped in every case."""
    process = engine(name, model, scratch, tier)
    started = time.monotonic()
    try:
        ttft_s(process.url, warmup)
        before = tier_counters(process.url)
        cached = resident(block_files(tier)) if tier is not None and not store else None
        seconds = ttft_s(process.url, prompt)
        after = tier_counters(process.url)
        result = {"ttft_ms": seconds * 1e3, "resident": cached}
        result.update({key: after[key] - before[key] for key in after})
        if store:
            want = (len(prompt) // BLOCK_SIZE) * block_bytes_of(model)
            deadline = time.monotonic() + STORE_WAIT_S
            while after["stored_bytes"] - before["stored_bytes"] < want and time.monotonic() < deadline:
                # The worker side's store reports reach the scheduler in a step: an idle engine never confirms
                # its last stores, so a 1-token request (no full block) makes it step.
                ttft_s(process.url, NUDGE)
                time.sleep(0.1)
                after = tier_counters(process.url)
            result["stored_bytes"] = after["stored_bytes"] - before["stored_bytes"]
            result["stored_all"] = result["stored_bytes"] >= want
        result["engine_s"] = time.monotonic() - started
        return result
    finally:
        process.stop()


_BLOCK_BYTES: dict[Path, int] = {}


def block_bytes_of(model: Path) -> int:
    if model not in _BLOCK_BYTES:
        import torch

        _BLOCK_BYTES[model] = BLOCK_SIZE * ModelConfig.from_folder(model).kv_bytes_per_token(torch.float32)
    return _BLOCK_BYTES[model]


def restart_part(model: Path, scratch: Path, args: argparse.Namespace) -> dict[str, list[dict]]:
    rng = random.Random(7)
    prompt = [rng.randrange(10, 1000) for _ in range(args.prompt_tokens)]
    warmup = [rng.randrange(10, 1000) for _ in range(WARMUP_TOKENS)]
    runs: dict[str, list[dict]] = {"cold": [], "cold+store": [], "restarted": [], "restarted, dropped": []}
    for repeat in range(args.repeats):
        tier = scratch / f"tier-{repeat}"
        tier.mkdir()
        try:
            runs["cold"].append(measure(f"cold-{repeat}", model, scratch, None, prompt, warmup, False))
            stored = measure(f"store-{repeat}", model, scratch, tier, prompt, warmup, True)
            runs["cold+store"].append(stored)
            if not stored["stored_all"]:
                print(f"repeat {repeat}: only {stored['stored_bytes']:.0f} bytes stored after {STORE_WAIT_S:g} s")
            stored["resident_after"] = resident(block_files(tier))
            runs["restarted"].append(measure(f"restarted-{repeat}", model, scratch, tier, prompt, warmup, False))
            drop_cache(block_files(tier))
            runs["restarted, dropped"].append(measure(f"dropped-{repeat}", model, scratch, tier, prompt, warmup, False))
        finally:
            shutil.rmtree(tier, ignore_errors=True)
        print(
            f"repeat {repeat}: "
            + ", ".join(f"{name} {values[-1]['ttft_ms']:.0f} ms" for name, values in runs.items() if values),
            flush=True,
        )
    return runs


# ----- part 2: disk bandwidth ----------------------------------------------------------------------------------------


def write_blocks(root: Path, block_bytes: int, count: int) -> tuple[BlockFolder, list[bytes], Path, float]:
    """``count`` block files through BlockFolder.write, and one file of the same payloads back to back; the
    seconds spent in BlockFolder.write."""
    folder = BlockFolder(str(root / "blocks"), COMPAT)
    rng = np.random.default_rng(11)
    hashes = [rng.bytes(32) for _ in range(count)]
    big = root / "sequential.bin"
    writing = 0.0
    with open(big, "wb", buffering=0) as sequential:
        pending = bytearray()
        for block_hash in hashes:
            payload = rng.bytes(block_bytes)
            started = time.perf_counter()
            folder.write(block_hash, payload)
            writing += time.perf_counter() - started
            pending += payload
            if len(pending) >= CHUNK:
                sequential.write(pending)
                pending.clear()
        sequential.write(pending)
    return folder, hashes, big, writing


def read_blocks(folder: BlockFolder, hashes: list[bytes], rows: np.ndarray) -> float:
    started = time.perf_counter()
    for index, block_hash in enumerate(hashes):
        folder.read_into(block_hash, memoryview(rows[index]))
    return time.perf_counter() - started


def read_blocks_prefetched(folder: BlockFolder, hashes: list[bytes], rows: np.ndarray) -> float:
    """A what-if, not the tier's path: posix_fadvise(WILLNEED) on every file of the load first (the kernel reads
    them ahead, in parallel), then read_into each."""
    started = time.perf_counter()
    for block_hash in hashes:
        fd = os.open(folder.path(block_hash), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)
    for index, block_hash in enumerate(hashes):
        folder.read_into(block_hash, memoryview(rows[index]))
    return time.perf_counter() - started


def read_sequential(path: Path, buffer: np.ndarray) -> float:
    view = memoryview(buffer.reshape(-1))
    started = time.perf_counter()
    with open(path, "rb", buffering=0) as file:
        offset = 0
        while offset < len(view):
            got = file.readinto(view[offset : offset + CHUNK])
            if not got:
                break
            offset += got
    seconds = time.perf_counter() - started
    if offset != len(view):
        raise RuntimeError(f"{path}: read {offset} of {len(view)} bytes")
    return seconds


def profile_blocks(folder: BlockFolder, hashes: list[bytes], rows: np.ndarray) -> dict[str, float]:
    """read_into's phases, timed (a replica with the same calls): mean microseconds per block."""
    import blake3

    phases = dict.fromkeys(("open", "header", "payload", "eof check", "close", "blake3"), 0.0)
    clock = time.perf_counter
    for index, block_hash in enumerate(hashes):
        destination = memoryview(rows[index])
        t0 = clock()
        file = open(folder.path(block_hash), "rb", buffering=0)  # noqa: SIM115 (timed apart from its close)
        t1 = clock()
        header = file.read(HEADER_BYTES)
        _, _, _, _, _, size, compat, stored_hash, checksum = _FIXED.unpack(header)
        assert compat.rstrip(b"\0").decode() == folder.compat_hash and stored_hash == block_hash
        assert size == len(destination)
        t2 = clock()
        got = file.readinto(destination)
        t3 = clock()
        assert got == size and not file.read(1)
        t4 = clock()
        file.close()
        t5 = clock()
        assert blake3.blake3(destination).digest() == checksum
        t6 = clock()
        for name, seconds in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5), strict=True):
            phases[name] += seconds
    return {name: seconds / len(hashes) * 1e6 for name, seconds in phases.items()}


def in_memory_rates(buffer: np.ndarray) -> dict[str, float]:
    """GB/s of BLAKE3 (one thread, as read_into runs it; and all cores) and of a memory copy over ``buffer``."""
    import blake3

    flat = buffer.reshape(-1)
    size = min(len(flat), 256 << 20)
    view = memoryview(flat[:size])
    target = np.empty(size, dtype=np.uint8)
    target.fill(1)
    rates = {}
    for name, work in (
        ("blake3 1 thread", lambda: blake3.blake3(view).digest()),
        ("blake3 all cores", lambda: blake3.blake3(view, max_threads=blake3.blake3.AUTO).digest()),
        ("memcpy", lambda: np.copyto(target, flat[:size])),
    ):
        work()
        times = []
        for _ in range(3):
            started = time.perf_counter()
            work()
            times.append(time.perf_counter() - started)
        rates[name] = size / min(times) / 1e9
    return rates


def disk_part(scratch: Path, block_bytes: int, label: str, total: int, repeats: int) -> dict:
    count = max(1, total // block_bytes)
    root = scratch / f"disk-{label}"
    root.mkdir()
    try:
        folder, hashes, big, written_s = write_blocks(root, block_bytes, count)
        files = block_files(folder.folder)
        rows = np.ones((count, block_bytes), dtype=np.uint8)  # preallocated and touched, like a KV pool
        nbytes = rows.nbytes
        keys = ("load cold", "seq cold", "load warm", "seq warm", "prefetched cold")
        times: dict[str, list[float]] = {key: [] for key in keys}
        residency: dict[str, list[float]] = {"load cold": [], "seq cold": [], "prefetched cold": []}
        for _ in range(repeats):
            drop_cache(files)
            residency["load cold"].append(resident(files))
            times["load cold"].append(read_blocks(folder, hashes, rows))
            drop_cache(files)
            residency["prefetched cold"].append(resident(files))
            times["prefetched cold"].append(read_blocks_prefetched(folder, hashes, rows))
            drop_cache([big])
            residency["seq cold"].append(resident([big]))
            times["seq cold"].append(read_sequential(big, rows))
        read_blocks(folder, hashes, rows)
        read_sequential(big, rows)
        for _ in range(repeats):
            times["load warm"].append(read_blocks(folder, hashes, rows))
            times["seq warm"].append(read_sequential(big, rows))
        drop_cache(files)
        profile_cold = profile_blocks(folder, hashes, rows)
        profile_warm = profile_blocks(folder, hashes, rows)
        return {
            "label": label,
            "block_bytes": block_bytes,
            "blocks": count,
            "bytes": nbytes,
            "write_gbps": nbytes / written_s / 1e9,
            "gbps": {key: nbytes / statistics.median(values) / 1e9 for key, values in times.items()},
            "all_gbps": {key: [round(nbytes / v / 1e9, 3) for v in values] for key, values in times.items()},
            # Each repeat reads both ways back to back: the median of those pairs' ratios is steadier than the
            # ratio of the medians when the (shared, virtual) disk's speed drifts during the run.
            "paired": {
                state: statistics.median(
                    seq / load for load, seq in zip(times[f"load {state}"], times[f"seq {state}"], strict=True)
                )
                for state in ("cold", "warm")
            },
            "resident_before_cold": {key: max(values) for key, values in residency.items()},
            "profile_cold_us": profile_cold,
            "profile_warm_us": profile_warm,
            "in_memory_gbps": in_memory_rates(rows) if label == "bench" else None,
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)


# ----- output -------------------------------------------------------------------------------------------------------


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(run[key] for run in runs)


def print_restart(runs: dict[str, list[dict]], block_bytes: int, prompt_tokens: int) -> dict:
    print(f"\nRestart: {prompt_tokens}-token prompt, max_tokens 1, {len(runs['cold'])} fresh engines per row")
    print(
        f"{'engine':<20} {'TTFT p50 ms':>11} {'all (ms)':<24} {'tier hit tok':>12} {'loaded MiB':>10} "
        f"{'load ms':>8} {'load GB/s':>9} {'in cache':>8}"
    )
    cold = median_of(runs["cold"], "ttft_ms")
    summary = {}
    for name, values in runs.items():
        load_s = median_of(values, "load_seconds")
        loaded = median_of(values, "loaded_bytes")
        cached = [v["resident"] for v in values if v["resident"] is not None]
        each = " ".join(f"{v['ttft_ms']:.0f}" for v in values)
        print(
            f"{name:<20} {median_of(values, 'ttft_ms'):11.0f} "
            f"{each:<24} {median_of(values, 'hit_tokens'):12.0f} "
            f"{loaded / 2**20:10.1f} {load_s * 1e3:8.1f} {loaded / load_s / 1e9 if load_s else 0:9.2f} "
            f"{f'{max(cached):.0%}' if cached else '-':>8}"
        )
        summary[name] = {
            "ttft_ms": round(median_of(values, "ttft_ms"), 1),
            "hit_tokens": int(median_of(values, "hit_tokens")),
            "load_ms": round(load_s * 1e3, 1),
            "load_gbps": round(loaded / load_s / 1e9, 3) if load_s else None,
            "skipped": int(sum(v["skipped"] for v in values)),
        }
    for name in ("restarted", "restarted, dropped"):
        print(f"cold / {name}: {cold / summary[name]['ttft_ms']:.2f}x (goal >= 3x)")
    print(f"cold+store / cold: {summary['cold+store']['ttft_ms'] / cold:.2f} (what storing costs the first prefill)")
    stored = [v.get("stored_all") for v in runs["cold+store"]]
    after = " ".join(f"{v['resident_after']:.0%}" for v in runs["cold+store"])
    print(f"every full block stored before the restart: {all(stored)}; block {block_bytes} bytes")
    print(f"page cache share of the tier's files when the storing engine had stopped (mincore): {after}")
    return summary


def print_disk(results: list[dict]) -> None:
    for r in results:
        g = r["gbps"]
        print(
            f"\nDisk: {r['label']} blocks of {r['block_bytes']} bytes, {r['blocks']} files, "
            f"{r['bytes'] / 2**20:.0f} MiB (written through BlockFolder.write at {r['write_gbps']:.2f} GB/s)"
        )
        print(
            f"{'':<6} {'load path GB/s':>14} {'sequential GB/s':>15} {'ratio':>6} {'paired':>6}   "
            "runs (load | sequential)"
        )
        for state in ("cold", "warm"):
            load, seq = g[f"load {state}"], g[f"seq {state}"]
            runs = f"{r['all_gbps'][f'load {state}']} | {r['all_gbps'][f'seq {state}']}"
            print(f"{state:<6} {load:14.2f} {seq:15.2f} {load / seq:6.0%} {r['paired'][state]:6.0%}   {runs}")
        print("(ratio: of the medians; paired: the median of each repeat's back-to-back ratio)")
        print(
            f"what-if, cold: fadvise(WILLNEED) on every file first, then read_into: {g['prefetched cold']:.2f} GB/s "
            f"({g['prefetched cold'] / g['seq cold']:.0%} of sequential)"
        )
        cached = r["resident_before_cold"]
        print(
            f"page cache before the cold reads (mincore): block files "
            f"{max(cached['load cold'], cached['prefetched cold']):.1%}, "
            f"sequential file {cached['seq cold']:.1%}"
        )
        for state in ("cold", "warm"):
            g_state = g[f"load {state}"]
            if state == "cold" and g_state > 0.8 * g["load warm"]:
                print("  NOTE: the cold load is within 80% of the warm one: the drop may not have reached the disk")
        for state in ("cold", "warm"):
            phases = r[f"profile_{state}_us"]
            total = sum(phases.values())
            parts = ", ".join(f"{name} {us:.1f}" for name, us in phases.items())
            print(f"per block, {state} (us): {parts}; total {total:.1f} ({r['block_bytes'] / total / 1e3:.2f} GB/s)")
        if r["in_memory_gbps"]:
            print("in memory (GB/s): " + ", ".join(f"{k} {v:.2f}" for k, v in r["in_memory_gbps"].items()))


def plot(summary: dict, disk: list[dict], folder: Path) -> None:
    bar_chart(
        folder,
        "kv_tiers_restart",
        "TTFT of one long prompt, fresh engines (bench/kv_tiers.py)",
        "TTFT p50 (ms)",
        {name: {"TTFT": values["ttft_ms"]} for name, values in summary.items()},
    )
    bar_chart(
        folder,
        "kv_tiers_disk",
        "disk tier load path vs sequential read (bench/kv_tiers.py)",
        "GB/s",
        {
            f"{r['label']} {state}": {"load path": r["gbps"][f"load {state}"], "sequential": r["gbps"][f"seq {state}"]}
            for r in disk
            for state in ("cold", "warm")
        },
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=1992)
    parser.add_argument("--repeats", type=int, default=3, help="fresh engines per restart measurement")
    parser.add_argument("--disk-mib", type=int, default=1024, help="MiB of block files of the bench model's size")
    parser.add_argument("--demo-mib", type=int, default=256, help="MiB of block files of the demo model's size")
    parser.add_argument("--disk-repeats", type=int, default=5)
    parser.add_argument("--skip-restart", action="store_true", help="only the disk bandwidth part")
    add_plot_argument(parser)
    args = parser.parse_args()
    if not 0 < args.prompt_tokens < MAX_MODEL_LEN:
        parser.error(f"--prompt-tokens must be below {MAX_MODEL_LEN}")
    with tempfile.TemporaryDirectory(prefix="kv-tiers-") as scratch_name:
        scratch = Path(scratch_name)
        free = shutil.disk_usage(scratch).free
        total = min(args.disk_mib << 20, free // 4)
        print(
            f"temporary folder {scratch} on {filesystem(scratch)}: {free / 2**30:.0f} GiB free; "
            f"load average {os.getloadavg()[0]:.2f}"
        )
        model = scratch / "model"
        build_model(model)
        block_bytes = block_bytes_of(model)
        summary = {}
        if not args.skip_restart:
            runs = restart_part(model, scratch, args)
            summary = print_restart(runs, block_bytes, args.prompt_tokens)
        disk = [
            disk_part(scratch, size, label, min(total, mib << 20), args.disk_repeats)
            for label, size, mib in (("bench", block_bytes, args.disk_mib), ("demo", DEMO_BLOCK_BYTES, args.demo_mib))
        ]
        print_disk(disk)
    print(f"load average at the end: {os.getloadavg()[0]:.2f} (2 cores: other processes share them)")
    if args.plot:
        plot(summary, disk, args.plot)
    result: dict = {"bench": "kv_tiers", "prompt_tokens": args.prompt_tokens, "block_bytes": block_bytes}
    if summary:
        cold = summary["cold"]["ttft_ms"]
        result.update(
            {
                "ttft_ms": {name: values["ttft_ms"] for name, values in summary.items()},
                "ratio_cold_over_restarted": round(cold / summary["restarted"]["ttft_ms"], 2),
                "ratio_cold_over_restarted_dropped": round(cold / summary["restarted, dropped"]["ttft_ms"], 2),
                "restarted_hit_tokens": summary["restarted"]["hit_tokens"],
                "engine_load_ms": {name: summary[name]["load_ms"] for name in ("restarted", "restarted, dropped")},
                "engine_load_gbps": {name: summary[name]["load_gbps"] for name in ("restarted", "restarted, dropped")},
                "blocks_skipped": sum(values["skipped"] for values in summary.values()),
            }
        )
    for r in disk:
        g = r["gbps"]
        result[f"disk_{r['label']}"] = {
            **{key.replace(" ", "_") + "_gbps": round(value, 3) for key, value in g.items()},
            "ratio_cold": round(g["load cold"] / g["seq cold"], 3),
            "ratio_warm": round(g["load warm"] / g["seq warm"], 3),
            "ratio_prefetched_cold": round(g["prefetched cold"] / g["seq cold"], 3),
            "ratio_cold_paired": round(r["paired"]["cold"], 3),
            "ratio_warm_paired": round(r["paired"]["warm"], 3),
            "resident_before_cold": round(max(r["resident_before_cold"].values()), 3),
            "per_block_cold_us": {name: round(us, 1) for name, us in r["profile_cold_us"].items()},
            "per_block_warm_us": {name: round(us, 1) for name, us in r["profile_warm_us"].items()},
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
