"""The tiers' worker side over a real CPU KV cache and real folders: stores snapshot after the forward and are
written by the I/O thread, loads copy checked bytes into other blocks, a bad file fails its load, deletes,
step timing, the backlog bound, and shutdown."""

from __future__ import annotations

import errno
import os
import resource
import threading
import time

import pytest
import torch

from pdserve.kvtransfer.base import KVConnectorOutput
from pdserve.kvtransfer.tiers import worker as worker_module
from pdserve.kvtransfer.tiers.block_file import HEADER_BYTES, BlockFolder
from pdserve.kvtransfer.tiers.config import KVTierConfig
from pdserve.kvtransfer.tiers.worker import TierWorker
from pdserve.kvtransfer.work import TierLoad, TierStore, TransferWork
from pdserve.kvtransfer.workers import TimedWorker

from .helpers import COMPAT, block_hash, collect_until

NUM_BLOCKS, LAYERS, HEADS, BLOCK_SIZE, HEAD_DIM = 8, 2, 2, 4, 8
H = [block_hash(n) for n in range(8)]


def _kv_cache(dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, LAYERS, 2, HEADS, BLOCK_SIZE, HEAD_DIM)
    return torch.randn(shape, generator=generator).to(dtype)


def _config(tmp_path, **overrides) -> KVTierConfig:
    return KVTierConfig(disk_path=str(tmp_path / "disk"), shared_path=str(tmp_path / "shared"), **overrides)


@pytest.fixture
def make_worker():
    workers: list[TierWorker] = []

    def make(config: KVTierConfig, kv_cache: torch.Tensor, rank: int = 0, ranks: int = 1) -> TierWorker:
        worker = TierWorker(config, kv_cache, COMPAT, rank, ranks)
        workers.append(worker)
        return worker

    yield make
    for worker in workers:
        worker.close()


def _block_bytes(kv_cache: torch.Tensor, block_id: int) -> bytes:
    return kv_cache[block_id].contiguous().view(torch.uint8).numpy().tobytes()


def _file_payload(root, digest: bytes, num_bytes: int, rank: int = 0, ranks: int = 1) -> bytes:
    destination = bytearray(num_bytes)
    BlockFolder(str(root), COMPAT, rank, ranks).read_into(digest, memoryview(destination))
    return bytes(destination)


def _step(worker: TierWorker, work: TransferWork) -> KVConnectorOutput | None:
    """One engine step: the order before the forward, the report after it."""
    worker.submit(work)
    return worker.collect()


def _store(worker: TierWorker, stores: list[TierStore]) -> KVConnectorOutput:
    first = _step(worker, TransferWork(tier_stores=stores))
    expected = sum(len(store.media) for store in stores)
    return collect_until(
        worker.collect, lambda out: len(out.tier_stored) + len(out.tier_store_failures) >= expected, first
    )


def _load(worker: TierWorker, load: TierLoad) -> KVConnectorOutput:
    first = _step(worker, TransferWork(tier_loads=[load]))
    rid = load.request_id
    return collect_until(worker.collect, lambda out: rid in out.finished_recving or rid in out.failed_recving, first)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_stored_blocks_read_back_equal_and_load_into_other_blocks(tmp_path, make_worker, dtype):
    kv_cache = _kv_cache(dtype)
    worker = make_worker(_config(tmp_path), kv_cache)
    block_bytes = kv_cache[0].numel() * kv_cache.element_size()
    assert worker.block_bytes == block_bytes
    original = {1: _block_bytes(kv_cache, 1), 2: _block_bytes(kv_cache, 2)}

    report = _store(worker, [TierStore(1, H[1], ["disk", "shared"]), TierStore(2, H[2], ["disk"])])
    assert sorted(report.tier_stored) == sorted([("disk", H[1]), ("shared", H[1]), ("disk", H[2])])
    assert not report.tier_store_failures
    assert _file_payload(tmp_path / "disk", H[1], block_bytes) == original[1]
    assert _file_payload(tmp_path / "shared", H[1], block_bytes) == original[1]
    assert _file_payload(tmp_path / "disk", H[2], block_bytes) == original[2]

    report = _load(worker, TierLoad("r", [(5, "disk", H[1], -1), (6, "shared", H[1], -1), (7, "disk", H[2], -1)]))
    assert report.finished_recving == {"r"} and not report.failed_recving and not report.tier_load_failures
    assert _block_bytes(kv_cache, 5) == original[1]
    assert _block_bytes(kv_cache, 6) == original[1]
    assert _block_bytes(kv_cache, 7) == original[2]
    loaded = {medium: num_bytes for medium, num_bytes, _ in report.tier_loads}
    assert loaded == {"disk": 2 * block_bytes, "shared": block_bytes}
    assert all(seconds > 0 for _, _, seconds in report.tier_loads)


def test_a_store_snapshots_its_block_after_the_forward(tmp_path, make_worker):
    kv_cache = _kv_cache()
    worker = make_worker(_config(tmp_path), kv_cache)
    worker.submit(TransferWork(tier_stores=[TierStore(1, H[1], ["disk"])]))
    kv_cache[1].fill_(1.5)  # the forward writes the block
    written = _block_bytes(kv_cache, 1)
    first = worker.collect()  # the snapshot is taken here
    kv_cache[1].fill_(-2.0)  # the block is reused while the write may still be under way
    collect_until(worker.collect, lambda out: out.tier_stored == [("disk", H[1])], first)
    assert _file_payload(tmp_path / "disk", H[1], len(written)) == written


@pytest.mark.parametrize(
    ("damage", "reason"),
    [("flip", "corrupt"), ("truncate", "truncated"), ("remove", "missing"), ("foreign", "foreign")],
)
def test_a_bad_file_fails_the_load_with_its_reason(tmp_path, make_worker, damage, reason):
    kv_cache = _kv_cache()
    worker = make_worker(_config(tmp_path), kv_cache)
    _store(worker, [TierStore(1, H[1], ["disk"]), TierStore(2, H[2], ["disk"])])
    path = BlockFolder(str(tmp_path / "disk"), COMPAT).path(H[2])
    if damage == "flip":
        data = bytearray(path.read_bytes())
        data[HEADER_BYTES + 5] ^= 0x01
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        os.truncate(path, HEADER_BYTES + 3)
    elif damage == "remove":
        path.unlink()
    else:  # block 1's file at block 2's path
        path.write_bytes(BlockFolder(str(tmp_path / "disk"), COMPAT).path(H[1]).read_bytes())

    report = _load(worker, TierLoad("r", [(5, "disk", H[1], -1), (6, "disk", H[2], -1)]))
    assert report.failed_recving == {"r"} and not report.finished_recving
    assert report.tier_load_failures == [("disk", H[2], reason)]
    assert not report.tier_loads  # a failed load is no bandwidth sample


def test_a_shared_load_marks_the_files_used(tmp_path, make_worker):
    worker = make_worker(_config(tmp_path), _kv_cache())
    _store(worker, [TierStore(1, H[1], ["shared"])])
    path = BlockFolder(str(tmp_path / "shared"), COMPAT).path(H[1])
    old = time.time() - 7200
    os.utime(path, (old, old))
    _load(worker, TierLoad("r", [(5, "shared", H[1], -1)]))
    assert path.stat().st_mtime > time.time() - 60


def test_deletes_remove_the_files(tmp_path, make_worker):
    worker = make_worker(_config(tmp_path), _kv_cache())
    _store(worker, [TierStore(1, H[1], ["disk", "shared"])])
    disk = BlockFolder(str(tmp_path / "disk"), COMPAT)
    assert disk.exists(H[1])
    _step(worker, TransferWork(tier_deletes=[("disk", H[1]), ("disk", H[3])]))  # H[3]: no file, fine
    deadline = time.monotonic() + 5
    while disk.exists(H[1]):
        assert time.monotonic() < deadline
        time.sleep(0.002)
    assert BlockFolder(str(tmp_path / "shared"), COMPAT).exists(H[1])


def test_a_delete_then_a_store_of_one_block_happen_in_order(tmp_path, make_worker):
    kv_cache = _kv_cache()
    worker = make_worker(_config(tmp_path), kv_cache)
    _store(worker, [TierStore(1, H[1], ["disk"])])
    first = _step(worker, TransferWork(tier_stores=[TierStore(2, H[1], ["disk"])], tier_deletes=[("disk", H[1])]))
    collect_until(worker.collect, lambda out: out.tier_stored == [("disk", H[1])], first)
    block_bytes = worker.block_bytes
    assert _file_payload(tmp_path / "disk", H[1], block_bytes) == _block_bytes(kv_cache, 2)


def test_a_failing_write_is_reported_as_a_store_failure(tmp_path, make_worker):
    kv_cache = _kv_cache()
    worker = make_worker(_config(tmp_path), kv_cache)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (HEADER_BYTES + 16, hard))  # Python ignores SIGXFSZ: EFBIG
    try:
        report = _store(worker, [TierStore(1, H[1], ["disk"])])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert errno.EFBIG != errno.ENOSPC
    assert report.tier_store_failures == [("disk", H[1], "io")] and not report.tier_stored
    assert not any((tmp_path / "disk").rglob("*.kv")) and not any((tmp_path / "disk").rglob("*.tmp"))


def test_stores_past_the_backlog_bound_are_dropped_and_reported(tmp_path, make_worker, monkeypatch):
    kv_cache = _kv_cache()
    worker = make_worker(_config(tmp_path), kv_cache)
    monkeypatch.setattr(worker_module, "MAX_STORE_BACKLOG_BYTES", 2 * worker.block_bytes)
    report = _store(worker, [TierStore(n, H[n], ["disk", "shared"]) for n in (1, 2, 3)])
    assert sorted(report.tier_stored) == sorted((medium, H[n]) for n in (1, 2) for medium in ("disk", "shared"))
    assert report.tier_store_failures == [("disk", H[3], "backlog"), ("shared", H[3], "backlog")]
    # The backlog drains: later stores go through.
    report = _store(worker, [TierStore(3, H[3], ["disk"])])
    assert report.tier_stored == [("disk", H[3])]


def test_a_host_tier_is_refused_on_a_cpu_engine(tmp_path):
    before = threading.active_count()
    with pytest.raises(ValueError, match="CPU engine"):
        TierWorker(KVTierConfig(host_bytes=1 << 20), _kv_cache(), COMPAT, 0, 1)
    assert threading.active_count() == before  # no I/O thread left behind


def test_forwards_are_timed_when_they_compute_tokens(tmp_path, make_worker):
    # The timing is the connector workers' wrapper's (kvtransfer/workers.py), around whatever worker a rank runs.
    worker = TimedWorker(make_worker(_config(tmp_path), _kv_cache()))
    assert worker.collect() is None
    assert _step(worker, TransferWork()) is None  # no tokens: nothing timed, nothing to report
    worker.submit(TransferWork(step_tokens=48))
    time.sleep(0.01)  # the forward
    report = worker.collect()
    assert report is not None and len(report.step_times) == 1
    tokens, seconds = report.step_times[0]
    assert tokens == 48 and 0.01 <= seconds < 5
    assert worker.collect() is None  # reported once


def test_ranks_write_their_own_files(tmp_path, make_worker):
    caches = [_kv_cache(seed=0), _kv_cache(seed=1)]
    workers = [make_worker(_config(tmp_path), cache, rank, 2) for rank, cache in enumerate(caches)]
    for worker in workers:
        _store(worker, [TierStore(1, H[1], ["disk"])])
    for rank, cache in enumerate(caches):
        assert _file_payload(tmp_path / "disk", H[1], workers[rank].block_bytes, rank, 2) == _block_bytes(cache, 1)
    assert BlockFolder(str(tmp_path / "disk"), COMPAT, 0, 2).exists(H[1])


def test_close_stops_the_io_thread(tmp_path):
    worker = TierWorker(_config(tmp_path), _kv_cache(), COMPAT, 3, 4)
    [thread] = [t for t in threading.enumerate() if t.name == "kv-tiers-3"]
    assert thread.is_alive()
    worker.close()
    assert not thread.is_alive()


def _slow_writes(monkeypatch, gate: threading.Event | None = None, seconds: float = 0.0) -> list[bytes]:
    """Every block write waits (for ``gate`` or ``seconds``) first: stores stay queued when the test closes."""
    written: list[bytes] = []
    write = BlockFolder.write

    def slow_write(folder: BlockFolder, digest: bytes, payload) -> None:
        if gate is not None:
            gate.wait(timeout=30)
        time.sleep(seconds)
        write(folder, digest, payload)
        written.append(digest)

    monkeypatch.setattr(BlockFolder, "write", slow_write)
    return written


def test_close_writes_the_stores_it_was_given_first(tmp_path, monkeypatch):
    written = _slow_writes(monkeypatch, seconds=0.05)
    kv_cache = _kv_cache()
    worker = TierWorker(_config(tmp_path), kv_cache, COMPAT, 0, 1)
    _step(worker, TransferWork(tier_stores=[TierStore(n, H[n], ["disk"]) for n in range(NUM_BLOCKS)]))
    worker.close()  # with most of the writes still queued
    assert written == H[:NUM_BLOCKS]
    for n in range(NUM_BLOCKS):
        assert _file_payload(tmp_path / "disk", H[n], worker.block_bytes) == _block_bytes(kv_cache, n)


def test_close_gives_up_on_writes_that_outlast_its_bound(tmp_path, monkeypatch, caplog):
    gate = threading.Event()
    written = _slow_writes(monkeypatch, gate)
    monkeypatch.setattr(worker_module, "CLOSE_FLUSH_SECONDS", 0.2)
    worker = TierWorker(_config(tmp_path), _kv_cache(), COMPAT, 5, 8)
    [thread] = [t for t in threading.enumerate() if t.name == "kv-tiers-5"]
    _step(worker, TransferWork(tier_stores=[TierStore(n, H[n], ["disk"]) for n in range(4)]))
    started = time.monotonic()
    worker.close()  # the first write hangs (a stuck disk)
    assert time.monotonic() - started < 5
    assert "3 block writes left undone" in caplog.text
    gate.set()  # the disk comes back: the write under way ends, the rest are dropped
    thread.join(timeout=10)
    assert not thread.is_alive() and written == [H[0]]
