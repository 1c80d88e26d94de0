"""Pod choice policies, scoring (blocks weighed by the medium holding them), session affinity (rendezvous) and the
P/D decider's arithmetic, on a KV index fed by hand."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from pdserve.api.kv_events import EngineLoad, KVEventBatch, TierEvents
from pdserve.engine.block_hash import hash_prompt_blocks
from pdserve.router.config import RouterConfig
from pdserve.router.kv_index import KVIndex
from pdserve.router.pods import PodSet
from pdserve.router.policy import Chooser, rendezvous, uncached_tokens
from pdserve.router.prompt import Prompt

IDLE = EngineLoad(0, 0, 0, 0.0, 0)
TOKENS = list(range(1, 161))  # 160 tokens: 9 blocks of 16 can hit (the last token is always computed)
HASHES = hash_prompt_blocks(TOKENS, 16)


def setup(
    routing: str = "prefix-load",
    cached: dict[str, int] | None = None,
    loads: dict[str, EngineLoad] | None = None,
    tokenizer: str | None = "model",
    **settings,
) -> tuple[Chooser, PodSet, KVIndex]:
    """Pods a, b, c; ``cached``: how many leading prompt blocks each has."""
    index = KVIndex()
    for url, blocks in (cached or {}).items():
        index.apply(url, KVEventBatch("e-" + url, 0, 16, HASHES[:blocks], [], (loads or {}).get(url, IDLE)))
    chooser = Chooser(RouterConfig([], ["a"], routing=routing, tokenizer=tokenizer, **settings), index)
    return chooser, PodSet("decode", ["a", "b", "c"]), index


def test_prefix_picks_the_longest_cached_prefix_and_predicts_it():
    chooser, pods, _ = setup("prefix", {"a": 2, "b": 5, "c": 0})
    choice = chooser.choose(pods, Prompt(TOKENS))
    assert (choice.pod.url, choice.matched, choice.block_size, choice.policy) == ("b", 5, 16, "prefix")
    assert uncached_tokens(Prompt(TOKENS), choice) == 160 - 80
    pods.pods[1].in_flight = 50  # pure prefix ignores load
    assert chooser.choose(pods, Prompt(TOKENS)).pod.url == "b"
    assert chooser.choose(pods, Prompt(TOKENS), exclude=[pods.pods[1]]).pod.url == "a"
    pods.mark(pods.pods[1], False, "test")  # health first, score second
    assert chooser.choose(pods, Prompt(TOKENS)).pod.url == "a"


def test_prefix_ties_go_to_the_least_loaded_then_round_robin():
    chooser, pods, _ = setup("prefix", {"a": 3, "b": 3, "c": 1})
    assert [chooser.choose(pods, Prompt(TOKENS)).pod.url for _ in range(4)] == ["a", "b", "a", "b"]
    pods.pods[0].in_flight = 1
    assert {chooser.choose(pods, Prompt(TOKENS)).pod.url for _ in range(3)} == {"b"}
    # Nothing cached anywhere (or an unknown prompt): least-load, round-robin among ties.
    assert sorted(chooser.choose(pods, Prompt([7] * 40)).pod.url for _ in range(2)) == ["b", "c"]


def test_prefix_load_weighs_cached_blocks_against_load():
    busy = EngineLoad(
        num_running=3, num_waiting=2, num_waiting_for_remote_kv=0, kv_cache_usage=0.5, num_blocks_held_for_remote=0
    )
    chooser, pods, _ = setup("prefix-load", {"a": 9, "b": 0, "c": 0}, {"a": busy}, prefix_weight=1.0, load_weight=2.0)
    # a: 9 - 2 * (5 + 0.5) = -2 < 0: the engine's own queue (other routers' requests too) outweighs 9 blocks.
    assert chooser.choose(pods, Prompt(TOKENS)).pod.url in ("b", "c")
    chooser, pods, _ = setup("prefix-load", {"a": 9, "b": 0, "c": 0}, prefix_weight=1.0, load_weight=2.0)
    pods.pods[0].in_flight = 4  # this router's own count: 9 - 8 > 0, still a
    choice = chooser.choose(pods, Prompt(TOKENS))
    assert (choice.pod.url, choice.matched) == ("a", 9)
    pods.pods[0].in_flight = 5  # 9 - 10 < 0
    assert chooser.choose(pods, Prompt(TOKENS)).pod.url != "a"


def test_without_a_tokenizer_or_a_prompt_prefix_policies_choose_least_load():
    chooser, pods, _ = setup("prefix-load", {"b": 9}, tokenizer=None)
    assert not chooser.prefix_aware
    pods.pods[0].in_flight = 1
    choice = chooser.choose(pods, None)
    assert (choice.pod.url, choice.policy, choice.block_size) == ("b", "least-load", 0)
    assert chooser.choose(pods).pod.url == "c"
    with pytest.raises(ValueError, match="routing must be one of"):
        setup("fastest")


def test_round_robin_ignores_load_but_not_health():
    chooser, pods, _ = setup("round-robin", {"a": 9})
    pods.pods[1].in_flight = 7
    assert [chooser.choose(pods, Prompt(TOKENS)).pod.url for _ in range(4)] == ["a", "b", "c", "a"]
    pods.mark(pods.pods[1], False, "test")
    assert [chooser.choose(pods).pod.url for _ in range(3)] == ["c", "a", "c"]
    assert chooser.choose(pods).policy == "round-robin"


def test_session_affinity_is_stable_overrides_the_score_and_respects_health():
    chooser, pods, _ = setup("prefix", {"c": 9})
    sessions = [f"user-{i}" for i in range(60)]
    first = {s: chooser.choose(pods, Prompt(TOKENS), session=s).pod.url for s in sessions}
    assert set(first.values()) == {"a", "b", "c"}  # spread, despite c's cached prefix
    assert first == {s: chooser.choose(pods, Prompt(TOKENS), session=s).pod.url for s in sessions}
    choice = chooser.choose(pods, Prompt(TOKENS), session="user-1")
    assert choice.policy == "affinity" and choice.matched == (9 if choice.pod.url == "c" else 0)
    pods.mark(pods.pods[0], False, "test")  # a is down: only a's sessions move
    moved = {s: chooser.choose(pods, Prompt(TOKENS), session=s).pod.url for s in sessions}
    assert all(moved[s] == url for s, url in first.items() if url != "a")
    assert all(moved[s] in ("b", "c") for s, url in first.items() if url == "a")
    assert rendezvous([], "x") is None


def tier_batch(
    url: str, seq: int, pool: list[bytes], removed: Sequence[bytes] = (), **tiers: list[bytes]
) -> KVEventBatch:
    """A batch of pod ``url``: ``pool`` entered its block pool, ``removed`` left it, each tier's hashes entered it."""
    stored = [TierEvents(medium, hashes, []) for medium, hashes in tiers.items()]
    return KVEventBatch("e-" + url, seq, 16, pool, list(removed), IDLE, tiers=stored)


@pytest.mark.parametrize("routing", ["prefix", "prefix-load"])
def test_an_event_stream_with_tier_media_scores_a_disk_hit_above_a_cold_pod_and_below_an_engine_hit(routing):
    chooser, pods, index = setup(routing)
    index.apply("a", tier_batch("a", 0, HASHES))  # the whole prompt in a's pool
    index.apply("b", tier_batch("b", 0, [], disk=HASHES))  # in b's disk tier
    index.apply("c", tier_batch("c", 0, [], host=[b"elsewhere" * 4]))  # cold for this prompt
    prompt = Prompt(TOKENS)
    choice = chooser.choose(pods, prompt)
    assert (choice.pod.url, choice.matched) == ("a", 9)
    a, b, _ = pods.pods
    b.in_flight = 1  # the disk hit outweighs a load tie-break (and prefix-load's load term) over a cold pod
    choice = chooser.choose(pods, prompt, exclude=[a])
    assert (choice.pod.url, choice.matched, choice.block_size) == ("b", 9, 16)  # any medium counts as matched
    assert uncached_tokens(prompt, choice) == 160 - 9 * 16
    # a's pool evicts the prompt into its host tier: a host hit (0.8 a block) still beats a disk hit (0.5).
    index.apply("a", tier_batch("a", 1, [], removed=HASHES, host=HASHES))
    assert chooser.choose(pods, prompt).pod.url == "a"
    # Weighed, a shorter prefix in the pool beats a longer one on disk: 5 × 1 > 9 × 0.5.
    index.apply("a", tier_batch("a", 2, HASHES[:5]))
    index.apply("a", KVEventBatch("e-a", 3, 16, [], [], IDLE, snapshot=HASHES[:5]))  # no tiers listed: host gone
    assert index.pods["a"].tiers == {}
    choice = chooser.choose(pods, prompt)
    assert (choice.pod.url, choice.matched) == ("a", 5)
    index.apply("a", KVEventBatch("e-a", 4, 16, [], HASHES[:5], IDLE))  # evicted for good
    assert chooser.choose(pods, prompt).pod.url == "b"


def test_tier_weights_set_what_each_medium_is_worth():
    # Disk weighed as the pool: b's 9 disk blocks beat a's 5 pool blocks; shared weighed 0: c's hit counts nothing,
    # though it still counts as matched (the decider's figure).
    chooser, pods, index = setup("prefix", tier_weights="disk=1, shared=0")
    index.apply("a", tier_batch("a", 0, HASHES[:5]))
    index.apply("b", tier_batch("b", 0, [], disk=HASHES))
    index.apply("c", tier_batch("c", 0, [], shared=HASHES))
    assert chooser.choose(pods, Prompt(TOKENS)).pod.url == "b"
    assert chooser.choose(pods, Prompt(TOKENS), exclude=[pods.pods[0], pods.pods[1]]).matched == 9
    assert chooser.choose(pods, Prompt(TOKENS), exclude=[pods.pods[1]]).pod.url == "a"
