"""Block hashes are the contract between router and engines: fixed, chained, process-independent."""

import os
import subprocess
import sys

import pytest

from pdserve.engine.block_hash import (
    ROOT_BLOCK_HASH,
    extend_block_hashes,
    hash_block_tokens,
    hash_prompt_blocks,
)


def test_hash_is_pinned():
    # Changing this value breaks routers and engines of different versions; bump the root's
    # version string on purpose if the serialisation ever changes.
    assert hash_block_tokens(None, [1, 2, 3]).hex() == (
        "dd58c060403be69c8f17a17d2fddeba3765e3bcbd254e28f567642a647ea6595"
    )
    assert len(ROOT_BLOCK_HASH) == 32


def test_hash_is_the_same_in_another_process_with_another_hash_seed():
    code = "from pdserve.engine.block_hash import hash_prompt_blocks as h; print(h(range(40), 16, 's')[-1].hex())"
    env = dict(os.environ, PYTHONHASHSEED="12345")
    other = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True)
    assert other.stdout.strip() == hash_prompt_blocks(range(40), 16, "s")[-1].hex()


def test_hash_chains_on_the_parent():
    first = hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(first, [3, 4]) != hash_block_tokens(None, [3, 4])
    assert hash_block_tokens(first, [3, 4]) == hash_block_tokens(hash_block_tokens(None, [1, 2]), [3, 4])
    # Token boundaries are part of the encoding: [1, 2] then [3] differs from [1] then [2, 3].
    assert hash_block_tokens(None, [12, 3]) != hash_block_tokens(None, [1, 23])


def test_prompt_blocks_cover_full_blocks_only_and_extend_incrementally():
    tokens = list(range(37))
    hashes = hash_prompt_blocks(tokens, 8)
    assert len(hashes) == 4
    partial = extend_block_hashes([], tokens[:20], 8)
    assert partial == hashes[:2]
    assert extend_block_hashes(partial, tokens, 8) == hashes


def test_cache_salt_changes_every_block():
    plain = hash_prompt_blocks(range(32), 8)
    salted = hash_prompt_blocks(range(32), 8, cache_salt="tenant-a")
    other = hash_prompt_blocks(range(32), 8, cache_salt="tenant-b")
    assert all(a != b for a, b in zip(plain, salted, strict=True))
    assert all(a != b for a, b in zip(salted, other, strict=True))


@pytest.mark.parametrize("bad_key", [True, 1.5, None, ["x"]])
def test_extra_keys_of_unsupported_types_are_rejected(bad_key):
    with pytest.raises(TypeError, match="extra keys"):
        hash_block_tokens(None, [1], [bad_key])


def test_block_size_must_be_positive():
    with pytest.raises(ValueError, match="block_size"):
        hash_prompt_blocks([1, 2], 0)
