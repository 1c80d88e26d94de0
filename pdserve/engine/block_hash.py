"""Block hashes: the one definition of how a block of token ids is named in the prefix cache.

Dependency-free on purpose (hashlib and struct only): the router imports this module to
recompute, from a prompt's token ids, exactly the hashes that every engine's block pool uses,
so routers and engines on different pods agree without talking.

A block's hash chains its parent's hash, its own token ids and optional extra keys (for
example a cache salt that separates tenants), so equal hashes mean equal whole prefixes, not
just equal blocks. The serialisation is fixed (little-endian, length-prefixed) and the chain
starts from a constant root, never from Python's ``hash()`` or a per-process seed.

Why collisions are not a correctness risk: the hash is SHA-256. Two different prefixes
sharing a hash would make one request read another's KV, but finding such a pair is
computationally infeasible (even deliberately), and by accident the chance among 2**40 cached
blocks is about 2**-177. A non-cryptographic 64-bit hash would not give that guarantee.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence

BlockHash = bytes

# Root of every chain: the "parent" of a request's first block. Changing it (or the
# serialisation below) changes every hash, so bump the version string when doing so.
ROOT_BLOCK_HASH: BlockHash = hashlib.sha256(b"pdserve-block-hash-v1").digest()

ExtraKey = int | str | bytes


def _encode_extra_keys(extra_keys: Sequence[ExtraKey]) -> bytes:
    parts = [struct.pack("<I", len(extra_keys))]
    for key in extra_keys:
        if isinstance(key, bool) or not isinstance(key, int | str | bytes):
            raise TypeError(f"block hash extra keys must be int, str or bytes, not {type(key).__name__}")
        if isinstance(key, int):
            parts.append(b"i" + struct.pack("<q", key))
        else:
            raw = key.encode() if isinstance(key, str) else key
            parts.append((b"s" if isinstance(key, str) else b"b") + struct.pack("<I", len(raw)) + raw)
    return b"".join(parts)


def hash_block_tokens(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: Sequence[ExtraKey] | None = None,
) -> BlockHash:
    """Hash of one full block, chained on its parent's hash (None for a request's first block)."""
    digest = hashlib.sha256(ROOT_BLOCK_HASH if parent_hash is None else parent_hash)
    digest.update(struct.pack(f"<I{len(token_ids)}I", len(token_ids), *token_ids))
    digest.update(_encode_extra_keys(extra_keys or ()))
    return digest.digest()


def first_block_extra_keys(cache_salt: str | None) -> tuple[ExtraKey, ...] | None:
    """Extra keys of a request's first block: the cache salt, which then taints every later block."""
    return None if cache_salt is None else ("salt", cache_salt)


def extend_block_hashes(
    block_hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
) -> list[BlockHash]:
    """Append to ``block_hashes`` the hashes of the full blocks of ``token_ids`` it lacks.

    Incremental, so a request hashes each block once however often it is asked.
    """
    num_full_blocks = len(token_ids) // block_size
    parent = block_hashes[-1] if block_hashes else None
    for index in range(len(block_hashes), num_full_blocks):
        start = index * block_size
        extra = first_block_extra_keys(cache_salt) if index == 0 else None
        parent = hash_block_tokens(parent, token_ids[start : start + block_size], extra)
        block_hashes.append(parent)
    return block_hashes


def hash_prompt_blocks(token_ids: Iterable[int], block_size: int, cache_salt: str | None = None) -> list[BlockHash]:
    """Hashes of every full block of a prompt, in order (what a router matches against pods)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    return extend_block_hashes([], list(token_ids), block_size, cache_salt)
