"""A fingerprint of a checkpoint's weights: two engines whose KV blocks are exchanged must run the
same weights, and an architecture and shape check cannot tell two fine-tunes (or a rolling
upgrade's old and new revisions) apart.

It is a BLAKE3 digest of every byte of every weights file (safetensors header and tensors alike) and
of the folder's ``config.json``: a checkpoint that differs anywhere, by one byte in the middle of one
tensor, has another fingerprint. Each file is read once, start to end, in large chunks; that read also
brings the file into the page cache, from which the loader's memory map then reads it (so the disk is
read once when the checkpoint fits in memory).

A file's digest is kept in a cache folder (``PDSERVE_CACHE_DIR``, default ``~/.cache/pdserve``: model
folders are often read-only mounts), keyed by the file's path and its size, modification and change
times and inode: a restart of an engine whose files did not change reads none of them again. The change
time cannot be set back (``cp -p``, ``touch -r`` and ``rsync -t`` restore the modification time, not
it), so a file rewritten in place is always hashed afresh. A cache that cannot be written is only slower.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from pathlib import Path

import blake3

from pdserve.models.loader import checkpoint_files

logger = logging.getLogger(__name__)

CACHE_ENV = "PDSERVE_CACHE_DIR"
READ_CHUNK_BYTES = 16 << 20


def default_cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "pdserve") / "weights-fingerprints"


def weights_fingerprint(folder: str | Path, cache_dir: str | Path | None = None) -> str:
    """The fingerprint of the checkpoint in ``folder`` (hex); ``cache_dir``: where file digests are kept
    (default :func:`default_cache_dir`)."""
    folder = Path(folder)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    digest = blake3.blake3()
    for path in [*checkpoint_files(folder), folder / "config.json"]:
        if path.exists():
            digest.update(path.name.encode() + b"\0" + file_digest(path, cache) + b"\0")
    return digest.hexdigest()[:32]


def hash_file(path: Path) -> bytes:
    """BLAKE3 of every byte of ``path``, read once in large chunks."""
    hasher = blake3.blake3()
    with open(path, "rb", buffering=0) as handle:
        while chunk := handle.read(READ_CHUNK_BYTES):
            hasher.update(chunk)
    return hasher.digest()


def _identity(stat: os.stat_result) -> list[int]:
    return [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino, stat.st_dev]


def file_digest(path: Path, cache: Path) -> bytes:
    """BLAKE3 of every byte of ``path``, from ``cache`` when the file is unchanged since it was hashed."""
    path = path.resolve()
    entry = cache / hashlib.blake2b(str(path).encode(), digest_size=16).hexdigest()
    identity = _identity(path.stat())
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):  # not cached, or another format: hash it
        known = json.loads(entry.read_text())
        if known["path"] == str(path) and known["identity"] == identity:
            return bytes.fromhex(known["digest"])
    digest = hash_file(path)
    if _identity(path.stat()) != identity:  # changed while it was read: hash it again next time
        return digest
    try:
        cache.mkdir(parents=True, exist_ok=True)
        temporary = entry.with_name(f".{entry.name}.{os.getpid()}")
        temporary.write_text(json.dumps({"path": str(path), "identity": identity, "digest": digest.hex()}))
        os.replace(temporary, entry)
    except OSError as error:
        logger.warning("cannot cache the digest of %s in %s (%s): it is read again at next start", path, cache, error)
    return digest
