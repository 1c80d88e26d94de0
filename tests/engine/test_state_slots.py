"""State slots of hybrid models (linear-attention layers): one per running request, taken with its
first blocks and given back with them. The fake runner keeps a running state per slot and raises if
a chunk does not continue its own request's state, so a slot shared, reused while owned, or not
restarted after preemption fails here; outputs must equal the reference under every schedule."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import RequestStatus
from tests.engine.helpers import (
    FakeRemoteConnector,
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
        rows_per_state_slot=2,
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
    engine = make_engine(
        num_blocks=100,
        block_size=4,
        max_model_len=40,
        max_num_batched_tokens=64,
        num_state_slots=1,
        rows_per_state_slot=1,
    )
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
    engine = make_engine(
        num_blocks=100,
        block_size=4,
        max_model_len=64,
        max_num_batched_tokens=8,
        num_state_slots=2,
        rows_per_state_slot=1,
    )
    request = make_request("long", prompt_of(40, seed=3), max_tokens=4)
    engine.add_request(request)
    engine.step()
    assert request.num_computed_tokens == 8  # one chunk of its prompt
    engine.abort_requests(["long"])
    run_to_completion(engine)
    assert_nothing_leaks(engine.scheduler)


def test_without_a_free_slot_allocation_takes_nothing():
    generations = np.zeros(12, dtype=np.int64)  # ten blocks, then one slot of two rows
    manager = KVCacheManager(10, 4, block_generations=generations, num_state_slots=1, rows_per_state_slot=2)
    assert not manager.enable_caching  # prefix caching is off for hybrid models
    first, second = (make_request(name, prompt_of(6, seed=i)) for i, name in enumerate(("a", "b")))
    assert manager.allocate_slots(first, 6) is not None
    assert manager.transfer_block_ids("a") == [*manager.get_block_ids("a"), 10, 11]  # blocks, then the slot's rows
    assert manager.allocate_slots(second, 6) is None
    assert manager.block_pool.num_free_blocks == 8 and not manager.owns_blocks("b")
    manager.free(first)
    # The slot lost its owner: a remote reader of its rows now sees other generations.
    assert generations[10:].tolist() == [1, 1]
    assert manager.allocate_slots(second, 6) is not None
    assert manager.state_slots is not None and manager.state_slots.req_to_slot == {"b": 0}


def test_prefix_caching_is_off_for_hybrid_models():
    engine = make_engine(num_blocks=100, block_size=4, max_model_len=64, num_state_slots=4, rows_per_state_slot=1)
    prompt = prompt_of(30, seed=5)
    for name in ("first", "again"):
        request = make_request(name, prompt, max_tokens=2)
        engine.add_request(request)
        run_to_completion(engine)
        assert request.num_cached_tokens == 0
        assert request.output_token_ids == expected_output(request)[0]


def test_a_prefill_leg_hands_over_its_state_as_of_the_token_before_its_last():
    # The decode engine computes the last prompt token again (for its logits): the state it gets must
    # not have seen that token. So the leg's last token runs alone, in a step that restores the slot.
    engine = make_engine(
        FakeRemoteConnector(),
        num_blocks=100,
        block_size=4,
        max_model_len=64,
        max_num_batched_tokens=64,
        num_state_slots=2,
        rows_per_state_slot=2,
    )
    leg = make_request("leg", prompt_of(19, seed=4), {"do_remote_decode": True, "delay": 3}, max_tokens=1)
    engine.add_request(leg)
    scheduled = []
    outputs = []
    while engine.has_work():
        outputs += engine.step()
        scheduled.append(leg.num_computed_tokens)
        check_invariants(engine.scheduler)
        if leg.is_finished and engine.scheduler.remote_kv.held_for_remote:
            runner = engine.model_executor
            slot = engine.scheduler.kv_cache_manager.state_slots.slot_of("leg")
            assert runner.state[slot, 1] == 18  # held: the state after 18 of the 19 tokens
    assert scheduled[:2] == [18, 19]  # the prompt, then its last token alone
    (final,) = [output for output in outputs if output.finish_reason is not None]
    assert final.new_token_ids == expected_output(leg)[0]
    # What the decode engine is told to pull: the prompt's five blocks, then the slot's two rows.
    assert final.kv_transfer_params["remote_block_ids"][-2:] in ([100, 101], [102, 103])
    assert len(final.kv_transfer_params["remote_block_ids"]) == 5 + 2
    assert_nothing_leaks(engine.scheduler)


def test_holds_past_the_held_share_of_slots_are_refused():
    # Slots held for decode engines cannot serve this engine's own requests: past the held share, a leg
    # answers without params (its decode computes the prompt), as for blocks.
    connector = FakeRemoteConnector()
    connector.max_held_fraction = 0.5
    engine = make_engine(
        connector, num_blocks=100, block_size=4, max_model_len=64, num_state_slots=2, rows_per_state_slot=1
    )
    legs = [
        make_request(f"leg{i}", prompt_of(6, seed=i), {"do_remote_decode": True, "delay": 50}, max_tokens=1)
        for i in range(2)
    ]
    for leg in legs:
        engine.add_request(leg)
    params = {}
    for _ in range(10):
        for output in engine.step():
            if output.finish_reason is not None:
                params[output.request_id] = output.kv_transfer_params
    assert sorted(params) == ["leg0", "leg1"]
    assert sum(value is not None for value in params.values()) == 1 and engine.scheduler.remote_kv.kv_holds_refused == 1
    run_to_completion(engine)
    assert_nothing_leaks(engine.scheduler)


def test_a_hybrid_prefill_leg_of_more_than_one_token_is_refused_and_a_one_token_prompt_hands_over_zeros():
    engine = make_engine(
        FakeRemoteConnector(), num_blocks=100, block_size=4, max_model_len=64, num_state_slots=2, rows_per_state_slot=1
    )
    with pytest.raises(ValueError, match="of a hybrid model samples one token"):
        engine.add_request(make_request("long-leg", prompt_of(9, seed=1), {"do_remote_decode": True}, max_tokens=2))
    assert not engine.scheduler.requests
    leg = make_request("tiny", prompt_of(1, seed=2), {"do_remote_decode": True, "delay": 3}, max_tokens=1)
    engine.add_request(leg)
    engine.step()
    slot = engine.scheduler.kv_cache_manager.state_slots.slot_of("tiny")
    assert leg.is_finished and engine.model_executor.state[slot].tolist() == [0, 0]  # the state before its token
    run_to_completion(engine)
    assert_nothing_leaks(engine.scheduler)
