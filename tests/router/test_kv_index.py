"""The router's KV index: batches applied (stored, removed, snapshot), for the engine's pool and its KV tiers,
gaps and restarts, prefix matching across media, and prompt hashing that is lazy and equal to the engine's
own."""

from __future__ import annotations

import random

import pytest

from pdserve.api.kv_events import EngineLoad, KVEventBatch, TierEvents
from pdserve.engine.block_hash import hash_prompt_blocks
from pdserve.router.config import DEFAULT_TIER_WEIGHTS, parse_tier_weights
from pdserve.router.kv_index import KVIndex, Match
from pdserve.router.prompt import Prompt
from tests.engine.helpers import make_engine, make_request

LOAD = EngineLoad(1, 2, 0, 0.5, 0)
H = [bytes([i]) * 32 for i in range(10)]
WEIGHTS = parse_tier_weights(DEFAULT_TIER_WEIGHTS)  # engine 1, host 0.8, disk 0.5, shared 0.4


def batch(seq: int, stored=(), removed=(), snapshot=None, engine="e1", block_size=16, tiers=()) -> KVEventBatch:
    return KVEventBatch(
        engine,
        seq,
        block_size,
        list(stored),
        list(removed),
        LOAD,
        None if snapshot is None else list(snapshot),
        list(tiers),
    )


def tier(medium: str, stored=(), removed=(), snapshot=None) -> TierEvents:
    return TierEvents(medium, list(stored), list(removed), None if snapshot is None else list(snapshot))


def test_stored_removed_and_snapshot():
    index = KVIndex()
    index.apply("p", batch(0, stored=H[:4]))
    index.apply("p", batch(1, stored=[H[4]], removed=[H[1]]))
    pod = index.pods["p"]
    assert pod.hashes == {H[0], H[2], H[3], H[4]} and not pod.stale and pod.block_size == 16 and pod.load == LOAD
    index.apply("p", batch(2, stored=[H[5]], removed=[H[0]], snapshot=[H[7], H[8]]))  # the snapshot wins
    assert pod.hashes == {H[7], H[8]}
    # Within one engine step evictions come first: a hash evicted and cached again in a batch stays cached.
    index.apply("p", batch(3, stored=[H[7]], removed=[H[7]]))
    assert H[7] in pod.hashes


def test_a_gap_marks_the_pod_stale_until_a_snapshot():
    index = KVIndex()
    index.apply("p", batch(0, stored=H[:2]))
    index.apply("p", batch(2, stored=[H[2]]))  # batch 1 was lost
    pod = index.pods["p"]
    assert pod.stale and pod.hashes == set(H[:3]) and index.num_gaps == 1  # still used meanwhile
    index.apply("p", batch(3, stored=[H[3]]))
    assert pod.stale
    index.apply("p", batch(4, snapshot=H[5:7]))
    assert not pod.stale and pod.hashes == set(H[5:7])
    # Joining a publisher mid-stream: stale until its snapshot, unless the batch carries one.
    index.apply("q", batch(41, stored=[H[1]]))
    assert index.pods["q"].stale
    index.apply("r", batch(41, snapshot=[H[1]]))
    assert not index.pods["r"].stale


def test_a_restarted_engine_starts_afresh():
    index = KVIndex()
    index.apply("p", batch(0, stored=H[:3]))
    index.apply("p", batch(0, stored=[H[9]], engine="e2"))
    assert index.pods["p"].hashes == {H[9]} and not index.pods["p"].stale and index.pods["p"].engine_id == "e2"
    index.forget("p")
    assert index.match("p", H, WEIGHTS) == Match(0, 0.0)


def test_match_counts_leading_blocks_up_to_the_first_miss():
    index = KVIndex()
    index.apply("p", batch(0, stored=[H[0], H[1], H[3]]))
    assert index.match("p", H[:5], WEIGHTS) == Match(2, 2.0)
    assert index.match("p", H[:2], WEIGHTS) == Match(2, 2.0)
    assert index.match("p", H[2:], WEIGHTS) == Match(0, 0.0)
    assert index.match("p", [], WEIGHTS) == Match(0, 0.0)
    assert index.match("unknown", H, WEIGHTS) == Match(0, 0.0)


def test_each_tier_medium_takes_its_stored_removed_and_snapshot():
    index = KVIndex()
    index.apply("p", batch(0, stored=H[:2], tiers=[tier("host", stored=H[2:4]), tier("disk", stored=H[:6])]))
    pod = index.pods["p"]
    assert pod.hashes == set(H[:2]) and pod.tiers == {"host": set(H[2:4]), "disk": set(H[:6])}
    # An eviction from a tier is a removal from that medium only; removed before stored, as for the pool.
    index.apply("p", batch(1, tiers=[tier("disk", removed=[H[0], H[5]]), tier("host", stored=[H[3]], removed=[H[3]])]))
    assert pod.hashes == set(H[:2]) and pod.tiers == {"host": set(H[2:4]), "disk": set(H[1:5])}
    # The pool evicting a block into the host tier: two media, one batch.
    index.apply("p", batch(2, removed=[H[1]], tiers=[tier("host", stored=[H[1]])]))
    assert pod.hashes == {H[0]} and pod.tiers["host"] == set(H[1:4])
    # A snapshot batch replaces each medium's set, and names every tier the engine keeps: host is gone.
    index.apply("p", batch(3, snapshot=[H[0]], tiers=[tier("disk", stored=[H[9]], snapshot=H[6:8])]))
    assert pod.hashes == {H[0]} and pod.tiers == {"disk": set(H[6:8])}
    # A tier first reported between snapshots is taken as it comes; a medium this router does not know is left out.
    index.apply("p", batch(4, tiers=[tier("shared", stored=[H[9]]), tier("tape", stored=[H[8]])]))
    assert pod.tiers == {"disk": set(H[6:8]), "shared": {H[9]}}
    summary = index.summary(with_hashes=True)["p"]
    assert summary["num_blocks"] == 1 and summary["media"] == {"engine": 1, "disk": 2, "shared": 1}
    assert summary["tier_block_hashes"] == {"disk": [H[6].hex(), H[7].hex()], "shared": [H[9].hex()]}
    # A gap leaves the tiers in use, stale with the pool, until the next snapshot; a restart forgets them.
    index.apply("p", batch(9, tiers=[tier("disk", removed=[H[6]])]))
    assert pod.stale and pod.tiers["disk"] == {H[7]}
    index.apply("p", batch(0, engine="e2"))
    assert index.pods["p"].tiers == {} and index.summary()["p"]["media"] == {"engine": 0}


def test_a_match_walks_any_medium_and_weighs_each_block_by_its_fastest():
    index = KVIndex()
    # Blocks 0-1 in the pool (block 1 also on disk), 2 in host memory, 3 on disk, 4 shared, 5 nowhere, 6 on disk.
    index.apply(
        "p",
        batch(
            0,
            stored=H[:2],
            tiers=[tier("host", stored=[H[2]]), tier("disk", stored=[H[1], H[3], H[6]]), tier("shared", stored=[H[4]])],
        ),
    )
    assert index.match("p", H, WEIGHTS) == Match(5, pytest.approx(1 + 1 + 0.8 + 0.5 + 0.4))
    assert index.match("p", H[3:5], WEIGHTS) == Match(2, pytest.approx(0.9))
    assert index.match("p", H[5:], WEIGHTS) == Match(0, 0.0)  # the walk stops at the first block none holds
    flat = dict.fromkeys(WEIGHTS, 1.0)
    assert index.match("p", H, flat) == Match(5, 5.0)


def test_prompt_hashes_are_the_engines_and_made_only_as_far_as_looked_at():
    tokens = list(range(100))
    prompt = Prompt(tokens, cache_salt="tenant")
    hashes = prompt.hashes(16)
    assert prompt.hashes(16) is hashes
    # The engine never serves the last prompt token from its cache: (100 - 1) // 16 = 6 blocks can hit.
    assert len(hashes) == 6 and hashes.num_computed == 0
    full = hash_prompt_blocks(tokens, 16, "tenant")
    index = KVIndex()
    index.apply("p", batch(0, stored=full[:2]))
    assert index.match("p", hashes, WEIGHTS).blocks == 2 and hashes.num_computed == 3  # two hits and the miss
    assert list(hashes) == full[:6] and hashes[1:3] == full[1:3]
    assert Prompt(tokens).hashes(16)[0] != full[0]  # the salt taints every block
    assert len(Prompt(list(range(32))).hashes(16)) == 1 and len(Prompt([1]).hashes(16)) == 0


@pytest.mark.parametrize("seed", range(12))
def test_the_index_follows_a_real_block_pool_through_evictions(seed):
    """Batches built from a real scheduler's block pool, step by step as the engine publishes them, keep the index
    equal to the pool's cached set, evictions included, without any snapshot. (Some seeds evict and cache the same
    hash within one step: applying stored before removed fails them.)"""
    engine = make_engine(num_blocks=24, block_size=4, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64)
    engine.record_cache_events()
    rng = random.Random(seed)
    prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(4)]
    index = KVIndex()
    evictions_seen = False
    for number in range(60):
        if number % 2 == 0 or not engine.has_work():
            prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 9))]
            engine.add_request(make_request(f"r{number}", prompt, max_tokens=rng.randrange(1, 6)))
        engine.step()
        stored, removed = engine.take_cache_events()
        index.apply("p", KVEventBatch("e", number, 4, stored, removed, LOAD))
        evictions_seen = evictions_seen or bool(removed)
        assert index.pods["p"].hashes == set(engine.cached_block_hashes()), f"step {number}"
    assert evictions_seen
