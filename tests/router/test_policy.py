"""Pod choice policies, scoring, session affinity (rendezvous) and the P/D decider's arithmetic, on a KV index
fed by hand."""

from __future__ import annotations

import pytest

from pdserve.api.kv_events import EngineLoad, KVEventBatch
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
