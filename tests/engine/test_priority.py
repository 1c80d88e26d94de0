"""The priority scheduling policy (vLLM's semantics: lower values first, then arrival): queue order, preemption of
the largest values, a waiting request displacing running ones of a larger value, and outputs unchanged by any of
it; in one priority, requests marked ahead (the router's fairness mark) before the others; a step starts the
prompts of one rank only. Under fcfs the priority and the mark are ignored."""

import pytest

from pdserve.engine.scheduler_config import SchedulerConfig
from tests.engine.helpers import (
    assert_nothing_leaks,
    check_invariants,
    expected_output,
    make_engine,
    make_request,
    prompt_of,
    run_to_completion,
)


def _request(request_id, priority, length=8, max_tokens=6, seed=None, ahead=False):
    request = make_request(request_id, prompt_of(length, seed=seed or len(request_id)), max_tokens=max_tokens)
    request.sampling_params.ignore_eos = True
    request.priority = priority
    request.ahead = ahead
    return request


def _step(engine):
    scheduler_output = engine.scheduler.schedule()
    runner_output = engine.model_executor.execute_model(scheduler_output)
    outputs = engine.scheduler.update_from_output(scheduler_output, runner_output)
    check_invariants(engine.scheduler)
    return [r.request_id for r in scheduler_output.requests], scheduler_output.preempted_req_ids, outputs


def _finish_order(engine):
    order = []
    while engine.has_work():
        order += [output.request_id for output in _step(engine)[2] if output.finish_reason is not None]
    return order


def test_the_queue_goes_by_priority_then_arrival():
    engine = make_engine(num_blocks=64, block_size=4, max_model_len=64, max_num_seqs=1, scheduling_policy="priority")
    for request_id, priority in (("late-low", 5), ("high", -1), ("mid-a", 0), ("mid-b", 0)):
        engine.add_request(_request(request_id, priority, max_tokens=2))
    assert _finish_order(engine) == ["high", "mid-a", "mid-b", "late-low"]
    assert_nothing_leaks(engine.scheduler)


def test_fcfs_ignores_priorities():
    engine = make_engine(num_blocks=64, block_size=4, max_model_len=64, max_num_seqs=1)
    for request_id, priority in (("first", 5), ("second", -1), ("third", 0)):
        engine.add_request(_request(request_id, priority, max_tokens=2))
    assert _finish_order(engine) == ["first", "second", "third"]


def test_a_high_priority_request_displaces_the_lowest_running_one_for_a_seat():
    engine = make_engine(num_blocks=64, block_size=4, max_model_len=64, max_num_seqs=2, scheduling_policy="priority")
    low = [_request("low-0", 3, max_tokens=12), _request("low-1", 4, max_tokens=12)]
    for request in low:
        engine.add_request(request)
    _step(engine)
    _step(engine)
    urgent = _request("urgent", 0, max_tokens=3)
    engine.add_request(urgent)
    scheduled, preempted, _ = _step(engine)
    assert preempted == {"low-1"}  # the largest value, not the latest admitted by chance
    assert "urgent" in scheduled and "low-1" not in scheduled
    order = _finish_order(engine)
    assert order[0] == "urgent"
    for request in (*low, urgent):  # preemption changed nothing in what anyone got
        assert request.output_token_ids == expected_output(request)[0]
    assert low[1].num_preemptions == 1 and low[0].num_preemptions == 0
    assert_nothing_leaks(engine.scheduler)


def test_a_high_priority_request_displaces_running_ones_for_blocks():
    # 10 blocks of 4: after 4 steps the two running requests take 8; the newcomer needs 4.
    engine = make_engine(num_blocks=10, block_size=4, max_model_len=40, max_num_seqs=8, scheduling_policy="priority")
    low = [_request(f"low-{i}", 5 + i, length=12, max_tokens=12, seed=10 + i) for i in range(2)]
    for request in low:
        engine.add_request(request)
    for _ in range(4):
        _step(engine)
    urgent = _request("urgent", -3, length=16, max_tokens=4, seed=30)
    engine.add_request(urgent)
    scheduled, preempted, _ = _step(engine)
    assert "urgent" in scheduled and preempted and preempted <= {"low-0", "low-1"}
    assert "low-1" in preempted  # the largest value goes first
    assert _finish_order(engine)[0] == "urgent"
    for request in (*low, urgent):
        assert request.output_token_ids == expected_output(request)[0]
    assert_nothing_leaks(engine.scheduler)


def test_equal_priorities_never_displace_each_other():
    engine = make_engine(num_blocks=64, block_size=4, max_model_len=64, max_num_seqs=1, scheduling_policy="priority")
    engine.add_request(_request("first", 0, max_tokens=5))
    _step(engine)
    engine.add_request(_request("second", 0, max_tokens=2))
    for _ in range(3):
        scheduled, preempted, _ = _step(engine)
        assert scheduled == ["first"] and not preempted
    assert _finish_order(engine) == ["first", "second"]


def test_a_request_marked_ahead_goes_before_its_priority_and_displaces_one_unmarked():
    engine = make_engine(num_blocks=64, block_size=4, max_model_len=64, max_num_seqs=2, scheduling_policy="priority")
    flood = [_request(f"flood-{i}", 0, max_tokens=12, seed=40 + i) for i in range(3)]
    for request in flood:
        engine.add_request(request)
    _step(engine)
    _step(engine)
    light = _request("light", 0, max_tokens=3, seed=50, ahead=True)
    engine.add_request(light)
    assert [r.request_id for r in engine.scheduler.waiting] == ["light", "flood-2"]  # ahead of an earlier arrival
    scheduled, preempted, _ = _step(engine)
    assert preempted == {"flood-1"} and "light" in scheduled  # the latest unmarked one of its priority
    # A more urgent priority still comes first: the mark orders within a priority only.
    urgent = _request("urgent", -1, max_tokens=2, seed=51)
    engine.add_request(urgent)
    scheduled, preempted, _ = _step(engine)
    assert "urgent" in scheduled and preempted == {"flood-0"}
    order = _finish_order(engine)
    assert order.index("urgent") < order.index("light") < order.index("flood-1")
    for request in (*flood, light, urgent):
        assert request.output_token_ids == expected_output(request)[0]
    assert_nothing_leaks(engine.scheduler)


def test_requests_marked_ahead_never_displace_each_other_nor_a_more_urgent_one():
    engine = make_engine(num_blocks=64, block_size=4, max_model_len=64, max_num_seqs=1, scheduling_policy="priority")
    engine.add_request(_request("first", 0, max_tokens=5, ahead=True))
    _step(engine)
    engine.add_request(_request("second", 0, max_tokens=2, ahead=True))
    scheduled, preempted, _ = _step(engine)
    assert scheduled == ["first"] and not preempted
    assert _finish_order(engine) == ["first", "second"]
    engine.add_request(_request("urgent", -1, max_tokens=5))
    _step(engine)
    engine.add_request(_request("marked", 0, max_tokens=2, ahead=True))
    scheduled, preempted, _ = _step(engine)
    assert scheduled == ["urgent"] and not preempted


def test_fcfs_ignores_the_ahead_mark():
    engine = make_engine(num_blocks=64, block_size=4, max_model_len=64, max_num_seqs=1)
    engine.add_request(_request("first", 0, max_tokens=5))
    _step(engine)
    engine.add_request(_request("second", 0, max_tokens=2))
    engine.add_request(_request("marked", 0, max_tokens=2, ahead=True))
    scheduled, preempted, _ = _step(engine)
    assert scheduled == ["first"] and not preempted
    assert _finish_order(engine) == ["first", "second", "marked"]


def test_running_requests_short_of_blocks_preempt_the_largest_value_first():
    engine = make_engine(num_blocks=9, block_size=4, max_model_len=24, max_num_seqs=8, scheduling_policy="priority")
    # All fit at first; they grow until one must go.
    requests = [
        _request(request_id, priority, length=8, max_tokens=12, seed=seed)
        for request_id, priority, seed in (("mid", 1, 1), ("worst", 9, 2), ("best", -9, 3))
    ]
    for request in requests:
        engine.add_request(request)
    # One priority's prompts a step: a less urgent prompt would lengthen the step of a more urgent one's first token.
    assert [_step(engine)[0] for _ in range(3)] == [["best"], ["best", "mid"], ["best", "mid", "worst"]]
    first_preempted = None
    while engine.has_work() and first_preempted is None:
        _, preempted, _ = _step(engine)
        if preempted:
            first_preempted = preempted
    assert first_preempted == {"worst"}
    run_to_completion(engine)
    for request in requests:
        assert request.output_token_ids == expected_output(request)[0]
    assert_nothing_leaks(engine.scheduler)


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="scheduling_policy"):
        SchedulerConfig(num_blocks=64, scheduling_policy="lifo")
