"""State slots of hybrid models (linear-attention layers): one per running request, taken with its
first blocks and given back with them. The fake runner keeps a running state per slot and raises if
a chunk does not continue its own request's state, so a slot shared, reused while owned, or not
restarted after preemption fails here; outputs must equal the reference under every schedule."""

from __future__ import annotations

import pytest

from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import RequestStatus
from tests.engine.helpers import (
    assert_nothing_leaks,
    check_invariants,
    expected_output,
    make_engine,
    make_request,
    prompt_of,
    run_to_completion,
)


def _requests(count: int, max_tokens: int = 16):
    return [
        make_request(f"r{i}", prompt_of(5 + 7 * i, seed=i), max_tokens=max_tokens, ignore_eos=True)
        for i in range(count)
    ]


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize(
    ("num_blocks", "num_state_slots", "max_num_batched_tokens"),
    [(400, 8, 64), (400, 2, 64), (400, 3, 7), (14, 8, 32)],  # roomy; few slots; small chunks; preemption
)
def test_outputs_equal_the_reference_whatever_the_slots_blocks_and_chunks(
    num_blocks, num_state_slots, max_num_batched_tokens, async_scheduling
):
    engine = make_engine(
        async_scheduling=async_scheduling,
        num_blocks=num_blocks,
        block_size=4,
        max_model_len=56,
        max_num_seqs=8,
        max_num_batched_tokens=max_num_batched_tokens,
        num_state_slots=num_state_slots,
    )
    requests = _requests(7)
    for request in requests:
        engine.add_request(request)
    most_running = 0
    for _ in range(5000):
        if not engine.has_work():
            break
        engine.step()
        check_invariants(engine.scheduler, max_placeholders=2 if async_scheduling else 0)
        most_running = max(most_running, len(engine.scheduler.running))
    assert not engine.has_work()
    assert most_running <= num_state_slots
    for request in requests:
        assert request.output_token_ids == expected_output(request)[0]
    if num_blocks < 100:
        assert engine.scheduler.num_preemptions > 0
    assert_nothing_leaks(engine.scheduler)


def test_a_request_waits_for_a_slot_and_gets_the_one_a_finished_request_gave_back():
    engine = make_engine(num_blocks=100, block_size=4, max_model_len=40, max_num_batched_tokens=64, num_state_slots=1)
    first = make_request("first", prompt_of(6, seed=1), max_tokens=3, ignore_eos=True)
    second = make_request("second", prompt_of(6, seed=2), max_tokens=3, ignore_eos=True)
    engine.add_request(first)
    engine.add_request(second)
    engine.step()
    slots = engine.scheduler.kv_cache_manager.state_slots
    assert slots is not None and slots.req_to_slot == {"first": 0}
    assert second.status == RequestStatus.WAITING and not engine.scheduler.kv_cache_manager.owns_blocks("second")
    run_to_completion(engine)
    assert second.output_token_ids == expected_output(second)[0]
    assert_nothing_leaks(engine.scheduler)


def test_an_abort_mid_prompt_gives_the_slot_back():
    engine = make_engine(num_blocks=100, block_size=4, max_model_len=64, max_num_batched_tokens=8, num_state_slots=2)
    request = make_request("long", prompt_of(40, seed=3), max_tokens=4)
    engine.add_request(request)
    engine.step()
    assert request.num_computed_tokens == 8  # one chunk of its prompt
    engine.abort_requests(["long"])
    run_to_completion(engine)
    assert_nothing_leaks(engine.scheduler)


def test_without_a_free_slot_allocation_takes_nothing():
    manager = KVCacheManager(num_blocks=10, block_size=4, num_state_slots=1)
    assert not manager.enable_caching  # prefix caching is off for hybrid models
    first, second = (make_request(name, prompt_of(6, seed=i)) for i, name in enumerate(("a", "b")))
    assert manager.allocate_slots(first, 6) is not None
    assert manager.allocate_slots(second, 6) is None
    assert manager.block_pool.num_free_blocks == 8 and not manager.owns_blocks("b")
    manager.free(first)
    assert manager.allocate_slots(second, 6) is not None
    assert manager.state_slots is not None and manager.state_slots.req_to_slot == {"b": 0}


def test_prefix_caching_is_off_for_hybrid_models():
    engine = make_engine(num_blocks=100, block_size=4, max_model_len=64, num_state_slots=4)
    prompt = prompt_of(30, seed=5)
    for name in ("first", "again"):
        request = make_request(name, prompt, max_tokens=2)
        engine.add_request(request)
        run_to_completion(engine)
        assert request.num_cached_tokens == 0
        assert request.output_token_ids == expected_output(request)[0]
