"""The weights fingerprint in the KV compatibility hash: every byte of every weights file and the config, cached
by file identity so a restart reads nothing again, and never fooled by a file rewritten with its old mtime."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from pdserve.models import fingerprint
from pdserve.models.demo import ensure_demo_model
from pdserve.models.fingerprint import weights_fingerprint


@pytest.fixture
def checkpoint(tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(ensure_demo_model(), copy)
    return copy


def _flip_mid_tensor(path) -> None:
    """One bit of one byte in the middle of the largest tensor, the file's times put back as they were."""
    stat = os.stat(path)
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    header = json.loads(path.read_bytes()[8 : 8 + header_len])
    begin, end = max(
        (entry["data_offsets"] for name, entry in header.items() if name != "__metadata__"),
        key=lambda offsets: offsets[1] - offsets[0],
    )
    offset = 8 + header_len + (begin + end) // 2
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0x10]))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # as cp -p, touch -r or rsync -t would


def test_one_byte_changed_mid_tensor_with_its_mtime_restored_changes_the_fingerprint(checkpoint, tmp_path):
    # Before (dbd1dc4): only the first and last 4 KiB of each tensor were hashed; this change kept the hash.
    cache = tmp_path / "cache"
    before = weights_fingerprint(checkpoint, cache)
    assert weights_fingerprint(checkpoint, cache) == before  # from the cache
    _flip_mid_tensor(checkpoint / "model.safetensors")
    assert weights_fingerprint(checkpoint, cache) != before
    assert weights_fingerprint(checkpoint, tmp_path / "fresh-cache") == weights_fingerprint(checkpoint, cache)


def test_the_config_is_part_of_it(checkpoint, tmp_path):
    before = weights_fingerprint(checkpoint, tmp_path / "cache")
    config = json.loads((checkpoint / "config.json").read_text())
    config["rope_theta"] = float(config.get("rope_theta", 10000.0)) * 2
    (checkpoint / "config.json").write_text(json.dumps(config))
    assert weights_fingerprint(checkpoint, tmp_path / "cache") != before


def test_a_restart_with_unchanged_files_reads_none_of_them(checkpoint, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    first = weights_fingerprint(checkpoint, cache)
    hashed = []
    real = fingerprint.hash_file
    monkeypatch.setattr(fingerprint, "hash_file", lambda path: hashed.append(path) or real(path))
    assert weights_fingerprint(checkpoint, cache) == first
    assert hashed == []
    os.utime(checkpoint / "model.safetensors")  # touched: hashed again (and still the same)
    assert weights_fingerprint(checkpoint, cache) == first
    assert [path.name for path in hashed] == ["model.safetensors"]


def test_a_cache_that_cannot_be_written_only_costs_a_read(checkpoint, tmp_path):
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the cache folder would be")
    assert weights_fingerprint(checkpoint, blocked) == weights_fingerprint(checkpoint, tmp_path / "cache")
