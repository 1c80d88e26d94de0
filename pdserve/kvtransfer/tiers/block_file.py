"""Block files: the on-disk format of a KV block in the disk and shared tiers, and the folder they live in.

A block is stored per tensor-parallel rank (each rank holds its share of the KV heads) as one file,
content-addressed: ``<root>/<compat hash>/<hh>/<block hash hex>.r<rank>of<ranks>.kv``, where the compatibility
hash names everything that decides a token's KV (weights fingerprint, dtype, block size, layout:
``kvtransfer.params.model_compat_hash``) and the block hash is the prefix cache's chained hash, so equal names
mean equal KV. One model's blocks are one folder (``delete_model``).

A file is a fixed header then the block's bytes::

    magic "PDKVBLK\\0" | format version u16 | rank u16 | ranks u16 | reserved u16 | payload bytes u64
    | compat hash (ASCII hex, zero-padded to 64) | block hash (32) | BLAKE3 of the payload (32) | payload

Every field is checked on load against what the reader expects, then the checksum: a truncated, corrupt,
foreign (another model's, another format's) or half-written file is refused with its reason and never
served. Writes go to a temporary name in the same folder and are renamed into place, so a reader sees a
whole file or none; no fsync (a crashed process loses nothing written, a lost page after a power cut fails
the checksum and is recomputed). The checksum catches corruption, not forgery: whoever can write the folder
can plant a valid file (docs/kv-cache.md).
"""

from __future__ import annotations

import contextlib
import errno
import os
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import blake3

MAGIC = b"PDKVBLK\0"
FORMAT_VERSION = 1
_FIXED = struct.Struct("<8sHHHHQ64s32s32s")
HEADER_BYTES = _FIXED.size
SUFFIX = ".kv"


class BlockFileError(Exception):
    """A block file that must not be used; ``reason`` is the metric's label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason  # missing, truncated, foreign, corrupt, io


@dataclass(frozen=True)
class FileEntry:
    """A block file found in a scan."""

    block_hash: bytes
    rank: int
    size: int
    mtime: float


class BlockFolder:
    """One tier's folder, as rank ``rank`` of ``ranks`` of engines of compatibility hash ``compat_hash`` sees it."""

    def __init__(self, root: str, compat_hash: str, rank: int = 0, ranks: int = 1) -> None:
        if not 16 <= len(compat_hash) <= 64 or not all(c in "0123456789abcdef" for c in compat_hash):
            raise ValueError(f"a compatibility hash is 16 to 64 lowercase hex digits, got {compat_hash!r}")
        self.root = Path(root)
        self.compat_hash = compat_hash
        self.folder = self.root / compat_hash
        self.rank = rank
        self.ranks = ranks
        self._tail = f".r{rank}of{ranks}{SUFFIX}"

    def path(self, block_hash: bytes, rank: int | None = None) -> Path:
        name = block_hash.hex()
        tail = self._tail if rank is None else f".r{rank}of{self.ranks}{SUFFIX}"
        return self.folder / name[:2] / (name + tail)

    def exists(self, block_hash: bytes) -> bool:
        """Whether every rank's file of the block is there (a cheap check: the load verifies them)."""
        return all(self.path(block_hash, rank).is_file() for rank in range(self.ranks))

    def write(self, block_hash: bytes, payload: memoryview | bytes) -> int:
        """Store this rank's bytes of a block atomically; the file's size. Raises OSError (ENOSPC: disk full)."""
        target = self.path(block_hash)
        header = _FIXED.pack(
            MAGIC,
            FORMAT_VERSION,
            self.rank,
            self.ranks,
            0,
            len(payload),
            self.compat_hash.encode(),  # zero-padded to 64 bytes by the format
            block_hash,
            blake3.blake3(payload).digest(),
        )
        target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        temporary = target.with_name(f"{target.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
        try:
            # KV is user data: readable by this user only (the engines sharing a folder run as one user).
            with open(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as file:
                file.write(header)
                file.write(payload)
            os.replace(temporary, target)
        except BaseException:
            with contextlib.suppress(OSError):
                temporary.unlink()
            raise
        return HEADER_BYTES + len(payload)

    def read_into(self, block_hash: bytes, destination: memoryview) -> None:
        """Read this rank's bytes of a block into ``destination`` (exactly its size), checked; raises
        ``BlockFileError`` (with the reason) for anything but a whole, matching, intact file. Header and payload
        come in one read (one round trip to a cold disk); on a refusal ``destination`` holds junk."""
        path = self.path(block_hash)
        header = bytearray(HEADER_BYTES)
        try:
            descriptor = os.open(path, os.O_RDONLY)
            try:
                got = os.preadv(descriptor, [header, destination], 0)
                beyond = os.pread(descriptor, 1, HEADER_BYTES + len(destination)) if got > HEADER_BYTES else b""
            finally:
                os.close(descriptor)
        except FileNotFoundError as error:
            raise BlockFileError("missing", str(path)) from error
        except OSError as error:
            raise BlockFileError("io", f"{path}: {error}") from error
        if got < HEADER_BYTES:
            raise BlockFileError("truncated", f"{path}: {got} header bytes")
        magic, version, rank, ranks, _, size, compat, stored_hash, checksum = _FIXED.unpack(header)
        if magic != MAGIC or version != FORMAT_VERSION:
            raise BlockFileError("foreign", f"{path}: not a version-{FORMAT_VERSION} block file")
        if compat.rstrip(b"\0").decode(errors="replace") != self.compat_hash or stored_hash != block_hash:
            raise BlockFileError("foreign", f"{path}: another model's or another block's file")
        if (rank, ranks) != (self.rank, self.ranks) or size != len(destination):
            raise BlockFileError("foreign", f"{path}: rank {rank}/{ranks} of {size} bytes")
        if got != HEADER_BYTES + size or beyond:
            raise BlockFileError("truncated", f"{path}: {got - HEADER_BYTES} of {size} bytes")
        if blake3.blake3(destination).digest() != checksum:
            raise BlockFileError("corrupt", f"{path}: checksum mismatch")

    def prefetch(self, block_hash: bytes) -> None:
        """Ask the kernel to start reading this rank's file of a block (a load reads its files one by one:
        their disk reads then overlap)."""
        with contextlib.suppress(OSError):
            descriptor = os.open(self.path(block_hash), os.O_RDONLY | os.O_NONBLOCK)  # a hint: never waits
            try:
                os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(descriptor)

    def touch(self, block_hash: bytes) -> None:
        """Mark the block used now (its files' mtime: what other engines sharing the folder age it by)."""
        for rank in range(self.ranks):
            with contextlib.suppress(OSError):
                os.utime(self.path(block_hash, rank))

    def delete(self, block_hash: bytes) -> None:
        """Remove this rank's file of the block (gone already is fine)."""
        with contextlib.suppress(FileNotFoundError):
            self.path(block_hash).unlink()

    def scan(self, remove_stale: bool = True) -> Iterator[FileEntry]:
        """Every block file of this compatibility hash and rank count (with ``remove_stale``, temporaries a
        writer that died left behind are removed)."""
        if not self.folder.is_dir():
            return
        marker = f"of{self.ranks}{SUFFIX}"
        for sub in os.scandir(self.folder):
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub.path):
                name = entry.name
                if name.endswith(".tmp"):
                    if remove_stale:
                        _remove_stale_temporary(entry)
                    continue
                if not name.endswith(marker):
                    continue
                digest, _, rank_part = name[: -len(marker)].partition(".r")
                try:
                    block_hash, rank = bytes.fromhex(digest), int(rank_part)
                    stat = entry.stat()
                except (ValueError, OSError):
                    continue
                yield FileEntry(block_hash, rank, stat.st_size, stat.st_mtime)


def _remove_stale_temporary(entry: os.DirEntry[str]) -> None:
    """A temporary left by a writer that died mid-write (an hour old: no live writer takes that long)."""
    with contextlib.suppress(OSError):
        if entry.stat().st_mtime < time.time() - 3600:
            os.unlink(entry.path)


def delete_model(root: str, compat_hash: str | None = None) -> int:
    """Remove every block file of one compatibility hash (None: of every model) under ``root``; files removed."""
    removed = 0
    base = Path(root)
    if not base.is_dir():
        return 0
    folders = [base / compat_hash] if compat_hash is not None else [p for p in base.iterdir() if p.is_dir()]
    for folder in folders:
        if not folder.is_dir():
            continue
        for path in sorted(folder.rglob("*"), reverse=True):  # files before their folders
            try:
                if path.is_dir():
                    path.rmdir()
                else:
                    path.unlink()
                    removed += path.suffix in (SUFFIX, ".tmp")
            except OSError as error:
                if error.errno not in (errno.ENOENT, errno.ENOTEMPTY):
                    raise
        with contextlib.suppress(OSError):
            folder.rmdir()
    return removed
