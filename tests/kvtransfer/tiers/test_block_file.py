"""Block files on real folders: the round trip, every way a file is refused (with its reason), leftover
temporaries, atomic writes, scans, per-rank presence, model deletion and touch."""

from __future__ import annotations

import errno
import os
import resource
import shutil
import struct
import time
from pathlib import Path

import numpy as np
import pytest

from pdserve.kvtransfer.tiers.block_file import (
    HEADER_BYTES,
    BlockFileError,
    BlockFolder,
    FileEntry,
    delete_model,
)

from .helpers import COMPAT, OTHER_COMPAT, block_hash

PAYLOAD_BYTES = 4096
H = block_hash(1)


def _payload(seed: int = 0, size: int = PAYLOAD_BYTES) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def _read(folder: BlockFolder, digest: bytes = H, size: int = PAYLOAD_BYTES) -> np.ndarray:
    destination = np.zeros(size, dtype=np.uint8)
    folder.read_into(digest, memoryview(destination))
    return destination


def _refused(folder: BlockFolder, digest: bytes = H, size: int = PAYLOAD_BYTES) -> str:
    with pytest.raises(BlockFileError) as caught:
        _read(folder, digest, size)
    return caught.value.reason


def _patch(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as file:
        file.seek(offset)
        file.write(data)


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as file:
        file.seek(offset)
        byte = file.read(1)
        file.seek(offset)
        file.write(bytes([byte[0] ^ 0xFF]))


def _leftovers(folder: BlockFolder) -> list[str]:
    return sorted(p.name for p in folder.folder.rglob("*") if p.is_file()) if folder.folder.exists() else []


def test_a_written_block_reads_back_equal(tmp_path):
    folder = BlockFolder(str(tmp_path), COMPAT)
    payload = _payload()
    size = folder.write(H, memoryview(payload))
    assert size == HEADER_BYTES + PAYLOAD_BYTES
    path = folder.path(H)
    assert path == tmp_path / COMPAT / H.hex()[:2] / f"{H.hex()}.r0of1.kv"
    assert path.stat().st_size == size
    assert np.array_equal(_read(folder), payload)
    # Rewriting a block replaces it whole.
    other = _payload(seed=1)
    folder.write(H, other.tobytes())
    assert np.array_equal(_read(folder), other)
    assert _leftovers(folder) == [path.name]


def test_a_compat_hash_must_be_lowercase_hex_of_16_to_64_digits(tmp_path):
    for bad in ("0123", "0123456789ABCDEF", "g" * 16, "0" * 65):
        with pytest.raises(ValueError):
            BlockFolder(str(tmp_path), bad)
    BlockFolder(str(tmp_path), "0" * 16)
    BlockFolder(str(tmp_path), "0" * 64)


def test_a_corrupt_payload_or_checksum_byte_is_refused_as_corrupt(tmp_path):
    folder = BlockFolder(str(tmp_path), COMPAT)
    folder.write(H, _payload())
    path = folder.path(H)
    for offset in (HEADER_BYTES, HEADER_BYTES + PAYLOAD_BYTES // 2, HEADER_BYTES + PAYLOAD_BYTES - 1):
        _flip(path, offset)
        assert _refused(folder) == "corrupt"
        _flip(path, offset)
        _read(folder)  # restored: fine again
    _flip(path, HEADER_BYTES - 1)  # the stored BLAKE3 digest's last byte
    assert _refused(folder) == "corrupt"


@pytest.mark.parametrize(
    "keep",
    [0, 7, 8, 20, HEADER_BYTES - 1, HEADER_BYTES, HEADER_BYTES + 1, HEADER_BYTES + PAYLOAD_BYTES - 1],
    ids=lambda n: f"keep{n}",
)
def test_a_truncated_file_is_refused_as_truncated(tmp_path, keep):
    folder = BlockFolder(str(tmp_path), COMPAT)
    folder.write(H, _payload())
    os.truncate(folder.path(H), keep)
    assert _refused(folder) == "truncated"


def test_a_file_with_trailing_bytes_is_refused(tmp_path):
    folder = BlockFolder(str(tmp_path), COMPAT)
    folder.write(H, _payload())
    with open(folder.path(H), "ab") as file:
        file.write(b"\0")
    # Labelled "truncated" by the code (the length does not match); what matters is that it is not served.
    assert _refused(folder) == "truncated"


def test_another_models_file_at_the_path_is_foreign(tmp_path):
    ours = BlockFolder(str(tmp_path / "a"), COMPAT)
    theirs = BlockFolder(str(tmp_path / "b"), OTHER_COMPAT)
    theirs.write(H, _payload())
    ours.path(H).parent.mkdir(parents=True)
    shutil.copy(theirs.path(H), ours.path(H))
    assert _refused(ours) == "foreign"


def test_another_blocks_file_at_the_path_is_foreign(tmp_path):
    folder = BlockFolder(str(tmp_path), COMPAT)
    folder.write(H, _payload())
    other = block_hash(2)
    folder.path(other).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(folder.path(H), folder.path(other))
    assert _refused(folder, other) == "foreign"


@pytest.mark.parametrize(
    ("offset", "data"),
    [
        (0, b"PDKVBLK\x01"),  # bad magic
        (0, b"\0" * 8),
        (8, struct.pack("<H", 2)),  # another format version
        (8, struct.pack("<H", 0)),
    ],
    ids=["magic", "zero-magic", "version-2", "version-0"],
)
def test_another_format_is_foreign(tmp_path, offset, data):
    folder = BlockFolder(str(tmp_path), COMPAT)
    folder.write(H, _payload())
    _patch(folder.path(H), offset, data)
    assert _refused(folder) == "foreign"


def test_another_rank_count_rank_or_size_is_foreign(tmp_path):
    single = BlockFolder(str(tmp_path), COMPAT, 0, 1)
    single.write(H, _payload())
    # A TP-1 file at a TP-2 engine's path.
    pair = BlockFolder(str(tmp_path), COMPAT, 0, 2)
    shutil.copy(single.path(H), pair.path(H))
    assert _refused(pair) == "foreign"
    # Rank 0's file at rank 1's path.
    rank0, rank1 = BlockFolder(str(tmp_path), COMPAT, 0, 2), BlockFolder(str(tmp_path), COMPAT, 1, 2)
    rank0.write(H, _payload())
    shutil.copy(rank0.path(H), rank1.path(H))
    assert _refused(rank1) == "foreign"
    # Another block size (the reader expects another payload size).
    assert _refused(single, size=PAYLOAD_BYTES * 2) == "foreign"
    assert _refused(single, size=PAYLOAD_BYTES - 1) == "foreign"
    # The header's size field changed (the file no longer says what the reader expects).
    _patch(single.path(H), 16, struct.pack("<Q", PAYLOAD_BYTES + 1))
    assert _refused(single) == "foreign"


def test_a_missing_file_is_missing(tmp_path):
    folder = BlockFolder(str(tmp_path), COMPAT)
    assert _refused(folder) == "missing"
    folder.write(block_hash(2), _payload())  # the folder exists, this block's file does not
    assert _refused(folder) == "missing"


def test_a_half_written_temporary_is_never_read_and_is_removed_once_an_hour_old(tmp_path):
    folder = BlockFolder(str(tmp_path), COMPAT)
    target = folder.path(H)
    target.parent.mkdir(parents=True)
    # What a writer that died mid-write leaves: a temporary named like write()'s, with part of a file.
    whole = tmp_path / "whole"
    BlockFolder(str(whole), COMPAT).write(H, _payload())
    partial = BlockFolder(str(whole), COMPAT).path(H).read_bytes()[: HEADER_BYTES + 100]
    temporary = target.with_name(f"{target.name}.4242.0badf00d.tmp")
    temporary.write_bytes(partial)

    assert _refused(folder) == "missing"
    assert not folder.exists(H)
    assert list(folder.scan()) == []
    assert temporary.exists()  # fresh: a live writer may still be renaming it into place

    old = time.time() - 3601
    os.utime(temporary, (old, old))
    assert list(folder.scan()) == []
    assert not temporary.exists()


@pytest.fixture
def file_size_limit():
    """Lowers this process's file size limit (RLIMIT_FSIZE; Python ignores SIGXFSZ, so a write past it fails
    with EFBIG); restored after the test."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)

    def limit(num_bytes: int) -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (num_bytes, hard))

    yield limit
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_a_write_failing_midway_leaves_no_target_and_no_temporary(tmp_path, file_size_limit):
    folder = BlockFolder(str(tmp_path), COMPAT)
    big = _payload(size=1 << 20)
    file_size_limit(64 << 10)  # the write fails after 64 KiB of the file are on disk
    with pytest.raises(OSError) as caught:
        folder.write(H, big)
    assert caught.value.errno == errno.EFBIG
    assert not folder.path(H).exists()
    assert _leftovers(folder) == []


def test_a_failed_rewrite_keeps_the_old_file_whole(tmp_path, file_size_limit):
    folder = BlockFolder(str(tmp_path), COMPAT)
    small = _payload(size=1024)
    folder.write(H, small)
    file_size_limit(64 << 10)
    with pytest.raises(OSError):
        folder.write(H, _payload(size=1 << 20))
    assert np.array_equal(_read(folder, size=1024), small)
    assert _leftovers(folder) == [folder.path(H).name]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder: permissions cannot fail a write")
def test_a_write_into_a_read_only_folder_fails_and_leaves_nothing(tmp_path):
    folder = BlockFolder(str(tmp_path), COMPAT)
    parent = folder.path(H).parent
    parent.mkdir(parents=True)
    os.chmod(parent, 0o500)
    try:
        with pytest.raises(OSError):
            folder.write(H, _payload())
        assert _leftovers(folder) == []
    finally:
        os.chmod(parent, 0o700)


def test_scan_lists_each_ranks_files_of_its_model_and_rank_count(tmp_path):
    root = str(tmp_path)
    rank0, rank1 = BlockFolder(root, COMPAT, 0, 2), BlockFolder(root, COMPAT, 1, 2)
    h1, h2, h3 = block_hash(1), block_hash(2), block_hash(3)
    rank0.write(h1, _payload(1))
    rank1.write(h1, _payload(2))
    rank0.write(h2, _payload(3, size=100))  # rank 1's part never written
    BlockFolder(root, COMPAT, 0, 1).write(h3, _payload())  # a TP-1 engine's file
    BlockFolder(root, OTHER_COMPAT, 0, 2).write(h3, _payload())  # another model's
    (rank0.folder / "zz").mkdir()
    (rank0.folder / "zz" / "notes.txt").write_text("not a block")
    (rank0.folder / "zz" / "nothex.r0of2.kv").write_text("not a block")
    (rank0.folder / "stray-file").write_text("not a folder")

    entries = sorted(rank0.scan(), key=lambda e: (e.block_hash, e.rank))
    assert [(e.block_hash, e.rank, e.size) for e in entries] == sorted(
        [(h1, 0, HEADER_BYTES + PAYLOAD_BYTES), (h1, 1, HEADER_BYTES + PAYLOAD_BYTES), (h2, 0, HEADER_BYTES + 100)]
    )
    assert all(isinstance(e, FileEntry) and abs(e.mtime - time.time()) < 60 for e in entries)
    assert sorted(rank1.scan(), key=lambda e: (e.block_hash, e.rank)) == entries  # every rank's files, either rank
    assert [e.block_hash for e in BlockFolder(root, COMPAT, 0, 1).scan()] == [h3]
    assert list(BlockFolder(str(tmp_path / "nowhere"), COMPAT).scan()) == []


def test_exists_needs_every_ranks_file(tmp_path):
    rank0, rank1 = BlockFolder(str(tmp_path), COMPAT, 0, 2), BlockFolder(str(tmp_path), COMPAT, 1, 2)
    assert not rank0.exists(H)
    rank0.write(H, _payload())
    assert not rank0.exists(H) and not rank1.exists(H)
    rank1.write(H, _payload())
    assert rank0.exists(H) and rank1.exists(H)
    rank1.delete(H)  # a rank removes only its own file
    assert rank0.path(H).exists() and not rank1.path(H).exists()
    assert not rank0.exists(H)
    rank1.delete(H)  # gone already: fine


def test_delete_model_removes_one_models_files_or_all(tmp_path):
    root = str(tmp_path)
    ours, theirs = BlockFolder(root, COMPAT), BlockFolder(root, OTHER_COMPAT)
    for n in range(5):
        ours.write(block_hash(n), _payload(n, size=64))
    for n in range(3):
        theirs.write(block_hash(n), _payload(n, size=64))
    stale = ours.path(block_hash(0)).with_name("leftover.1.abcd.tmp")
    stale.write_bytes(b"partial")

    assert delete_model(root, COMPAT) == 6  # five blocks and the temporary
    assert not ours.folder.exists()
    assert len(list(theirs.scan())) == 3
    assert delete_model(root, COMPAT) == 0
    assert delete_model(root) == 3
    assert not theirs.folder.exists()
    assert tmp_path.exists()  # the root itself stays
    assert delete_model(str(tmp_path / "nowhere")) == 0


def test_touch_marks_every_ranks_file_used_now(tmp_path):
    rank0, rank1 = BlockFolder(str(tmp_path), COMPAT, 0, 2), BlockFolder(str(tmp_path), COMPAT, 1, 2)
    rank0.write(H, _payload())
    rank1.write(H, _payload())
    old = time.time() - 7200
    for folder in (rank0, rank1):
        os.utime(folder.path(H), (old, old))
    rank0.touch(H)
    for folder in (rank0, rank1):
        assert folder.path(H).stat().st_mtime > time.time() - 60
    rank0.touch(block_hash(9))  # no such block: nothing happens
