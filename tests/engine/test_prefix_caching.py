"""Prefix caching: shared full blocks are reused (counted, shared, outputs unchanged) and evicted LRU."""

from tests.engine.helpers import (
    assert_nothing_leaks,
    expected_output,
    make_engine,
    make_request,
    prompt_of,
    run_to_completion,
)

BS = 4


def _engine(num_blocks=64, **kw):
    return make_engine(num_blocks=num_blocks, block_size=BS, max_model_len=min(128, num_blocks * BS), **kw)


def test_second_request_reuses_the_first_ones_full_blocks():
    engine = _engine()
    shared = prompt_of(3 * BS, seed=1)
    first = make_request("first", shared + prompt_of(2, seed=2), max_tokens=5, ignore_eos=True)
    second = make_request("second", shared + prompt_of(3, seed=3), max_tokens=5, ignore_eos=True)
    engine.add_request(first)
    engine.step()  # first's prompt is computed and its 3 full blocks are cached
    engine.add_request(second)
    engine.step()
    kv = engine.scheduler.kv_cache_manager
    first_ids, second_ids = kv.get_block_ids("first"), kv.get_block_ids("second")
    assert first_ids[:3] == second_ids[:3] and first_ids[3] != second_ids[3]
    assert all(kv.block_pool.blocks[i].ref_cnt == 2 for i in first_ids[:3])
    assert second.num_cached_tokens == 3 * BS
    assert kv.prefix_cache_hits == 3 * BS
    assert kv.prefix_cache_queries == first.num_prompt_tokens + second.num_prompt_tokens

    outputs = {}
    while engine.has_work():
        for out in engine.step():
            if out.finish_reason:
                outputs[out.request_id] = out
    assert outputs["second"].num_cached_tokens == 3 * BS
    assert outputs["first"].num_cached_tokens == 0
    for request in (first, second):
        assert request.output_token_ids == expected_output(request)[0]
    assert_nothing_leaks(engine.scheduler)


def test_hit_after_the_owner_finished_and_full_prompt_hit_recomputes_last_token():
    engine = _engine()
    prompt = prompt_of(4 * BS, seed=4)  # an exact multiple of the block size
    engine.add_request(make_request("a", prompt, max_tokens=3, ignore_eos=True))
    run_to_completion(engine)
    again = make_request("b", prompt, max_tokens=3, ignore_eos=True)
    engine.add_request(again)
    scheduler_output = engine.scheduler.schedule()
    # Three blocks hit; the fourth is recomputed because its last token must produce logits.
    assert again.num_cached_tokens == 3 * BS
    assert scheduler_output.num_scheduled_tokens == [BS]
    engine.scheduler.update_from_output(scheduler_output, engine.model_executor.execute_model(scheduler_output))
    run_to_completion(engine)
    assert again.output_token_ids == expected_output(again)[0]


def test_decoded_tokens_are_cached_too():
    engine = _engine()
    prompt = prompt_of(BS + 1, seed=5)
    first = make_request("a", prompt, max_tokens=2 * BS, ignore_eos=True)
    engine.add_request(first)
    run_to_completion(engine)
    continuation = prompt + first.output_token_ids
    follow_up = make_request("b", continuation + [1], max_tokens=2, ignore_eos=True)
    engine.add_request(follow_up)
    run_to_completion(engine)
    assert follow_up.num_cached_tokens == (len(continuation) // BS) * BS
    assert follow_up.output_token_ids == expected_output(follow_up)[0]


def test_eviction_is_least_recently_used():
    engine = _engine(num_blocks=8)
    old, recent = prompt_of(2 * BS, seed=6), prompt_of(2 * BS, seed=7)
    for request_id, prompt in (("old", old), ("recent", recent)):
        engine.add_request(make_request(request_id, prompt + [1], max_tokens=1))
        run_to_completion(engine)
    # Each used 3 blocks (2 full and cached, 1 partial); 2 blocks were never used. A 5-block
    # request takes the 2 unused ones, then old's 3, which were freed first.
    engine.add_request(make_request("filler", prompt_of(4 * BS + 1, seed=8), max_tokens=1))
    run_to_completion(engine)
    hits = {}
    for request_id, prompt in (("recent2", recent), ("old2", old)):
        request = make_request(request_id, prompt + [2], max_tokens=1)
        engine.add_request(request)
        run_to_completion(engine)
        hits[request_id] = request.num_cached_tokens
    assert hits == {"recent2": 2 * BS, "old2": 0}
    assert engine.scheduler.kv_cache_manager.block_pool.num_evictions >= 2


def test_no_hits_when_disabled_salted_or_prompt_logprobs_requested():
    prompt = prompt_of(3 * BS, seed=9)
    disabled = _engine(enable_prefix_caching=False)
    for request_id in ("a", "b"):
        disabled.add_request(make_request(request_id, prompt, max_tokens=1))
        run_to_completion(disabled)
    assert disabled.scheduler.kv_cache_manager.prefix_cache_hits == 0

    engine = _engine()
    engine.add_request(make_request("plain", prompt, max_tokens=1))
    run_to_completion(engine)
    salted = make_request("salted", prompt, max_tokens=1, cache_salt="tenant")
    logprobs = make_request("logprobs", prompt, max_tokens=1, prompt_logprobs=1)
    same = make_request("same", prompt, max_tokens=1)
    for request in (salted, logprobs, same):
        engine.add_request(request)
        run_to_completion(engine)
    assert (salted.num_cached_tokens, logprobs.num_cached_tokens, same.num_cached_tokens) == (0, 0, 2 * BS)
