"""KV tiers in a real engine (the offline LLM: scheduler, model runner and the tiers' worker in this process,
real block files on disk): a pool of 24 blocks that six 100-token prompts overflow, so their second pass finds
its prefixes only in the tiers. Every output is compared with an engine without tiers (the oracle), and what
the tiers did is read from the engine's own stats. make test-slow runs them again with the model in a worker
process (the tiers' worker there, its reports joined across the process boundary)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve import LLM, SamplingParams
from pdserve.kvtransfer.base import TierStats
from pdserve.kvtransfer.tiers.block_file import HEADER_BYTES, SUFFIX
from pdserve.kvtransfer.tiers.config import KVTierConfig
from pdserve.testing.processes import engine_executor

GREEDY = SamplingParams(max_tokens=8, temperature=0)
rng = random.Random(0)
PROMPTS = [[rng.randrange(10, 400) for _ in range(100)] for _ in range(6)]


def engine(tiers: KVTierConfig | None) -> LLM:
    # Every hit loads: the demo model recomputes 16 tokens faster than a block file loads, which the
    # load-or-recompute rule would see (tests/kvtransfer/tiers/test_cost.py tests the rule).
    if tiers is not None:
        tiers = dataclasses.replace(tiers, always_load=True)
    return LLM(num_kv_blocks=24, max_model_len=256, kv_tiers=tiers, **engine_executor())


def generate(llm: LLM, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in prompts], GREEDY)
    return [list(output.outputs[0].token_ids) for output in outputs]


def tier(llm: LLM, medium: str) -> TierStats:
    """The tier's stats once the stores it was given are confirmed (empty steps collect the worker's reports)."""
    connector = llm.engine.scheduler.connector
    deadline = time.monotonic() + 30
    while any(index.pending for index in connector.tiers.values()):
        assert time.monotonic() < deadline, "stores never confirmed"
        llm.engine.step()
        time.sleep(0.01)
    return llm.engine.scheduler.make_stats().kv_tiers[medium]


@pytest.fixture(scope="module")
def oracle() -> list[list[int]]:
    llm = engine(None)
    try:
        return generate(llm)
    finally:
        llm.close()


def block_files(folder: Path) -> list[Path]:
    return sorted(folder.rglob(f"*{SUFFIX}"))


def test_blocks_evicted_from_the_pool_come_back_from_disk_with_the_same_output(tmp_path, oracle):
    llm = engine(KVTierConfig(disk_path=str(tmp_path)))
    try:
        assert generate(llm) == oracle
        stored = tier(llm, "disk")
        assert stored.num_blocks == 6 * (100 // 16) and stored.hit_tokens == 0
        assert generate(llm) == oracle  # the pool holds a fraction: the rest comes from disk
        again = tier(llm, "disk")
        assert again.hit_tokens >= 4 * 6 * 16 and again.loaded_bytes > 0 and not again.skipped
    finally:
        llm.close()
    assert len(block_files(tmp_path)) == 36


def test_a_restarted_engine_loads_what_the_last_one_stored(tmp_path, oracle):
    first = engine(KVTierConfig(disk_path=str(tmp_path)))
    try:
        generate(first)
    finally:
        first.close()
    restarted = engine(KVTierConfig(disk_path=str(tmp_path)))
    try:
        assert tier(restarted, "disk").num_blocks == 36  # found at start
        assert generate(restarted, PROMPTS[:1]) == oracle[:1]
        assert tier(restarted, "disk").hit_tokens == 6 * 16  # its first prompt: every full block loaded
    finally:
        restarted.close()


def test_a_second_engine_hits_what_another_stored_in_a_shared_folder(tmp_path, oracle):
    writer = engine(KVTierConfig(shared_path=str(tmp_path)))
    reader = engine(KVTierConfig(shared_path=str(tmp_path), shared_read_only=True))
    try:
        assert tier(reader, "shared").num_blocks == 0
        generate(writer)
        assert tier(writer, "shared").num_blocks == 36  # its stores on disk before the reader asks for them
        assert generate(reader) == oracle
        assert tier(reader, "shared").hit_tokens == 6 * 6 * 16  # found by lookup: stored after it started
        assert tier(reader, "shared").stored_bytes == 0  # read-only
    finally:
        writer.close()
        reader.close()


@pytest.mark.parametrize("damage", ["corrupt", "truncated", "foreign"])
def test_a_damaged_block_file_is_recomputed_and_counted(tmp_path, oracle, damage):
    first = engine(KVTierConfig(disk_path=str(tmp_path)))
    try:
        generate(first)
    finally:
        first.close()
    files = block_files(tmp_path)
    for path in files:
        data = bytearray(path.read_bytes())
        if damage == "corrupt":
            data[HEADER_BYTES + 7] ^= 0xFF
        elif damage == "truncated":
            del data[len(data) // 2 :]
        else:  # a file of another format version at the block's path
            data[8] ^= 0x01
        path.write_bytes(bytes(data))
    llm = engine(KVTierConfig(disk_path=str(tmp_path)))
    try:
        assert generate(llm) == oracle
        stats = tier(llm, "disk")
        assert stats.hit_tokens == 0 and stats.skipped.get(damage, 0) >= 1
    finally:
        llm.close()


def test_a_half_written_file_is_never_read(tmp_path, oracle):
    first = engine(KVTierConfig(disk_path=str(tmp_path)))
    try:
        generate(first, PROMPTS[:1])
    finally:
        first.close()
    for path in block_files(tmp_path):  # as a writer that died before its rename leaves it
        path.rename(path.with_name(path.name + ".1234.abcd.tmp"))
    llm = engine(KVTierConfig(disk_path=str(tmp_path)))
    try:
        assert tier(llm, "disk").num_blocks == 0
        assert generate(llm, PROMPTS[:1]) == oracle[:1]
        assert tier(llm, "disk").hit_tokens == 0
    finally:
        llm.close()


@contextlib.contextmanager
def tiny_filesystem(folder: Path) -> Iterator[None]:
    """A 64 KiB tmpfs at ``folder`` (a real full disk); skips where this process may not mount."""
    folder.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(folder)], capture_output=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here to fill: {result.stderr.decode().strip()}")
    try:
        yield
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def test_a_full_disk_stores_nothing_and_fails_no_request(tmp_path, oracle):
    folder = tmp_path / "full"
    with tiny_filesystem(folder):
        llm = engine(KVTierConfig(disk_path=str(folder)))
        try:
            assert generate(llm) == oracle
            assert generate(llm) == oracle
            stats = tier(llm, "disk")
            assert stats.store_failures.get("disk_full", 0) >= 1
            assert stats.num_blocks * 66 * 1024 <= 64 * 1024 + 1  # what fits, at most
        finally:
            llm.close()


def test_a_hung_read_times_out_into_a_recompute_and_its_blocks_come_back_when_it_ends(tmp_path, oracle):
    """A block file that is a FIFO with no writer: opening it blocks, as a read of a hung network volume does. The
    request computes after the load timeout; the blocks of the abandoned load stay out of use until the read ends
    (the FIFO gets a writer), then return to the pool."""
    first = engine(KVTierConfig(disk_path=str(tmp_path)))
    try:
        generate(first, PROMPTS[:2])
    finally:
        first.close()
    hung = block_files(tmp_path)[0]
    hung.unlink()
    os.mkfifo(hung)
    llm = engine(KVTierConfig(disk_path=str(tmp_path), load_timeout_s=1.0))
    kv = llm.engine.scheduler.kv_cache_manager
    try:
        assert generate(llm, PROMPTS[:2]) == oracle[:2]  # both: one of them waited for the hung file
        assert kv.num_quarantined_blocks > 0
        with open(hung, "wb") as writer:  # the read ends (with nothing: a truncated file)
            writer.write(b"")
        deadline = time.monotonic() + 30
        while kv.num_quarantined_blocks:
            assert time.monotonic() < deadline, "the abandoned load's blocks never came back"
            generate(llm, PROMPTS[2:3])  # the engine steps, and takes the worker's report
        assert generate(llm, PROMPTS) == oracle
        assert kv.block_pool.num_free_blocks == kv.block_pool.num_blocks
    finally:
        llm.close()
