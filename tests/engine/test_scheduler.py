"""Scheduler behaviour: token budget, chunked prefill beside decodes, max_num_seqs, stop
conditions, aborts in every state, held and loaded blocks, and input validation."""

import pytest

from pdserve.engine.request import RequestStatus
from pdserve.engine.scheduler_config import SchedulerConfig
from pdserve.testing.fake_runner import reference_generate
from tests.engine.helpers import (
    EOS,
    VOCAB,
    FakeRemoteConnector,
    assert_nothing_leaks,
    check_invariants,
    expected_output,
    make_engine,
    make_request,
    prompt_of,
    run_to_completion,
)


def _step(engine):
    """One step, returning (scheduled ids, their token counts, outputs)."""
    scheduler_output = engine.scheduler.schedule()
    runner_output = engine.model_executor.execute_model(scheduler_output)
    outputs = engine.scheduler.update_from_output(scheduler_output, runner_output)
    check_invariants(engine.scheduler)
    return [r.request_id for r in scheduler_output.requests], scheduler_output.num_scheduled_tokens, outputs


def test_chunked_prefill_interleaves_with_decodes_within_the_budget():
    engine = make_engine(num_blocks=32, block_size=4, max_model_len=64, max_num_batched_tokens=8)
    engine.add_request(make_request("decode", prompt_of(3, seed=1), max_tokens=10, ignore_eos=True))
    assert _step(engine)[:2] == (["decode"], [3])
    engine.add_request(make_request("long", prompt_of(20, seed=2), max_tokens=2, ignore_eos=True))
    # The running decode goes first, the long prompt fills the rest of the budget in chunks.
    assert _step(engine)[:2] == (["decode", "long"], [1, 7])
    ids, counts, outputs = _step(engine)
    assert (ids, counts) == (["decode", "long"], [1, 7])
    assert [o.request_id for o in outputs] == ["decode"]  # a partial chunk samples nothing
    ids, counts, outputs = _step(engine)
    assert (ids, counts) == (["decode", "long"], [1, 6])
    assert [o.request_id for o in outputs] == ["decode", "long"]
    run_to_completion(engine)
    assert_nothing_leaks(engine.scheduler)


def test_max_num_seqs_bounds_the_running_set():
    engine = make_engine(num_blocks=64, block_size=4, max_model_len=64, max_num_seqs=2)
    for i in range(4):
        engine.add_request(make_request(f"r{i}", prompt_of(5, seed=i), max_tokens=3, ignore_eos=True))
    ids, _, _ = _step(engine)
    assert ids == ["r0", "r1"] and len(engine.scheduler.waiting) == 2
    reasons = run_to_completion(engine)
    assert reasons == dict.fromkeys(["r0", "r1", "r2", "r3"], "length")


def _prompt_whose_output_has_eos_at(index: int) -> list[int]:
    for seed in range(10_000):
        prompt = prompt_of(6, seed=seed)
        output = reference_generate(prompt, index + 1, VOCAB)
        if output[index] == EOS and EOS not in output[:index]:
            return prompt
    raise AssertionError("no such prompt")


@pytest.mark.parametrize(
    ("sampling", "expected_len", "reason", "stop_reason"),
    [
        ({"max_tokens": 10}, 3, "stop", None),  # EOS at the third token
        ({"max_tokens": 10, "ignore_eos": True}, 10, "length", None),
        ({"max_tokens": 10, "min_tokens": 5}, None, None, None),  # EOS too early is ignored
        ({"max_tokens": 3}, 3, "stop", None),  # EOS on the last allowed token still says stop
        ({"max_tokens": 2}, 2, "length", None),
        ({"max_tokens": None}, None, None, None),  # up to the context length
    ],
)
def test_stop_conditions(sampling, expected_len, reason, stop_reason):
    prompt = _prompt_whose_output_has_eos_at(2)
    engine = make_engine(num_blocks=16, block_size=4, max_model_len=40)
    request = make_request("r", prompt, **sampling)
    engine.add_request(request)
    reasons = run_to_completion(engine)
    tokens, expected_reason = expected_output(request)
    assert request.output_token_ids == tokens
    assert reasons["r"] == expected_reason
    if expected_len is not None:
        assert (len(tokens), expected_reason) == (expected_len, reason)
    if sampling.get("max_tokens") is None:
        assert request.num_tokens <= 40 and request.max_output_tokens == 40 - len(prompt)


def test_stop_token_ids_stop_with_stop_reason():
    prompt = prompt_of(6, seed=11)
    third = reference_generate(prompt, 3, VOCAB)[2]
    engine = make_engine(num_blocks=16, block_size=4, max_model_len=40)
    request = make_request("r", prompt, max_tokens=10, ignore_eos=True, stop_token_ids=[third])
    engine.add_request(request)
    outputs = []
    while engine.has_work():
        outputs += engine.step()
    final = outputs[-1]
    assert final.finish_reason == "stop" and final.stop_reason == third
    assert request.output_token_ids[-1] == third and len(request.output_token_ids) <= 3


def test_abort_in_every_local_state():
    engine = make_engine(num_blocks=6, block_size=4, max_model_len=24, max_num_seqs=2, max_num_batched_tokens=64)
    running = make_request("running", prompt_of(8, seed=1), max_tokens=15, ignore_eos=True)
    doomed = make_request("doomed", prompt_of(8, seed=2), max_tokens=15, ignore_eos=True)
    waiting = make_request("waiting", prompt_of(4, seed=3), max_tokens=3)
    for request in (running, doomed, waiting):
        engine.add_request(request)
    while doomed.status != RequestStatus.PREEMPTED:
        _step(engine)
    assert waiting.status == RequestStatus.WAITING and running.status == RequestStatus.RUNNING
    engine.abort_requests(["doomed", "waiting", "running", "unknown-id"])
    for request in (running, doomed, waiting):
        assert request.status == RequestStatus.FINISHED_ABORTED
    check_invariants(engine.scheduler)
    assert not engine.has_work()
    scheduler_output = engine.scheduler.schedule()
    assert scheduler_output.finished_req_ids == {"running", "doomed", "waiting"}
    assert_nothing_leaks(engine.scheduler)
    engine.abort_requests(["running"])  # aborting twice is harmless


def test_remote_load_parks_the_request_until_the_blocks_land():
    connector = FakeRemoteConnector()
    engine = make_engine(connector, num_blocks=16, block_size=4, max_model_len=64)
    request = make_request(
        "r", prompt_of(10, seed=1), {"do_remote_prefill": True, "delay": 2}, max_tokens=3, ignore_eos=True
    )
    engine.add_request(request)
    for _ in range(3):
        assert _step(engine)[0] == []
        assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert engine.scheduler.make_stats().num_waiting_for_remote_kvs == 1
    ids, counts, _ = _step(engine)
    # Only the last prompt token is computed locally; the other 9 came from the remote side.
    assert (ids, counts) == (["r"], [1])
    run_to_completion(engine)
    assert request.output_token_ids == expected_output(request)[0]
    assert_nothing_leaks(engine.scheduler)


def test_only_blocks_missing_from_the_local_cache_are_loaded():
    connector = FakeRemoteConnector()
    engine = make_engine(connector, num_blocks=32, block_size=4, max_model_len=64)
    prompt = prompt_of(14, seed=5)
    engine.add_request(make_request("local", prompt[:9], max_tokens=1))
    run_to_completion(engine)
    remote = make_request("remote", prompt, {"do_remote_prefill": True}, max_tokens=2, ignore_eos=True)
    engine.add_request(remote)
    _step(engine)
    assert remote.num_cached_tokens == 8
    transfer = connector.worker.in_flight[0] if connector.worker.in_flight else None
    assert transfer is None  # delay 0: the load landed in this step
    run_to_completion(engine)
    assert remote.output_token_ids == expected_output(remote)[0]


def test_abort_during_a_remote_load_keeps_the_blocks_until_the_load_drains():
    connector = FakeRemoteConnector()
    engine = make_engine(connector, num_blocks=8, block_size=4, max_model_len=32)
    loading = make_request("loading", prompt_of(12, seed=1), {"do_remote_prefill": True, "delay": 3}, max_tokens=2)
    engine.add_request(loading)
    _step(engine)
    engine.abort_requests(["loading"])
    scheduler = engine.scheduler
    assert scheduler.kv_cache_manager.num_owned_blocks("loading") == 3
    # A newcomer cannot take the blocks the worker is still writing into.
    newcomer = make_request("newcomer", prompt_of(21, seed=2), max_tokens=1)  # needs 6 of 8 blocks
    engine.add_request(newcomer)
    steps = 0
    while scheduler.kv_cache_manager.num_owned_blocks("loading"):
        _step(engine)
        steps += 1
        assert newcomer.status == RequestStatus.WAITING or steps >= 3
    run_to_completion(engine)
    assert newcomer.output_token_ids == expected_output(newcomer)[0]
    assert_nothing_leaks(scheduler)


def test_finished_prefill_holds_its_blocks_until_the_send_finishes():
    connector = FakeRemoteConnector()
    engine = make_engine(connector, num_blocks=8, block_size=4, max_model_len=32)
    request = make_request("p", prompt_of(9, seed=1), {"do_remote_decode": True, "delay": 2}, max_tokens=1)
    engine.add_request(request)
    _, _, outputs = _step(engine)
    assert outputs[0].finish_reason == "length"
    assert outputs[0].kv_transfer_params == {"remote_block_ids": [0, 1, 2]}
    scheduler = engine.scheduler
    assert scheduler.make_stats().remote_kv.num_blocks_held_for_remote == 3
    _step(engine)
    assert scheduler.make_stats().remote_kv.num_blocks_held_for_remote == 3
    run_to_completion(engine)
    assert scheduler.make_stats().remote_kv.num_blocks_held_for_remote == 0
    assert_nothing_leaks(scheduler)


def test_aborting_a_finished_held_request_frees_its_blocks_at_once():
    # The API aborts it only when its caller left before seeing the transfer params: nobody can pull.
    engine = make_engine(FakeRemoteConnector(), num_blocks=8, block_size=4, max_model_len=32)
    engine.add_request(make_request("p", prompt_of(9, seed=1), {"do_remote_decode": True, "delay": 50}, max_tokens=1))
    _step(engine)
    assert engine.scheduler.make_stats().remote_kv.num_blocks_held_for_remote == 3
    generations = engine.scheduler.kv_cache_manager.block_generations.copy()
    engine.abort_requests(["p"])
    assert engine.scheduler.make_stats().remote_kv.num_blocks_held_for_remote == 0
    assert (engine.scheduler.kv_cache_manager.block_generations[:3] == generations[:3] + 1).all()
    assert_nothing_leaks(engine.scheduler)


def test_holds_beyond_the_held_share_are_refused_and_their_blocks_freed():
    # 16 blocks, at most a quarter held for remote readers: one leg of 3 blocks fits, a second does not.
    connector = FakeRemoteConnector()
    connector.max_held_fraction = 0.25
    engine = make_engine(connector, num_blocks=16, block_size=4, max_model_len=32)
    engine.add_request(make_request("a", prompt_of(9, seed=1), {"do_remote_decode": True, "delay": 50}, max_tokens=1))
    _, _, outputs = _step(engine)
    assert outputs[0].kv_transfer_params == {"remote_block_ids": [0, 1, 2]}
    engine.add_request(make_request("b", prompt_of(9, seed=2), {"do_remote_decode": True, "delay": 50}, max_tokens=1))
    _, _, outputs = _step(engine)
    assert outputs[0].finish_reason == "length" and outputs[0].kv_transfer_params is None
    stats = engine.scheduler.make_stats().remote_kv
    assert stats.num_blocks_held_for_remote == 3 and stats.kv_holds_refused == 1
    assert engine.scheduler.kv_cache_manager.num_owned_blocks("b") == 0  # freed at once, not held
    run_to_completion(engine)
    assert_nothing_leaks(engine.scheduler)


def _peer_engine(fraction: float, num_blocks: int = 16):
    connector = FakeRemoteConnector()
    connector.peer_hold_fraction = fraction
    return connector, make_engine(connector, num_blocks=num_blocks, block_size=4, max_model_len=64)


def _finish_turn(engine, request_id: str, seed: int, delay: int = 1000) -> None:
    """A decode leg that ends and whose blocks are then held for peer reads (for ``delay`` steps)."""
    script = {"peer_hold": True, "delay": delay}
    engine.add_request(make_request(request_id, prompt_of(9, seed=seed), script, max_tokens=2, ignore_eos=True))
    while request_id not in engine.scheduler.remote_kv.held_for_peers:
        _step(engine)


def test_a_finished_turn_is_held_for_peers_until_its_time_is_up():
    _, engine = _peer_engine(0.5)
    _finish_turn(engine, "turn", seed=1, delay=3)
    stats = engine.scheduler.make_stats().remote_kv
    assert stats.num_blocks_held_for_peers == 3  # 9 prompt tokens + 2 answer tokens in blocks of 4
    # A hold is no work: an idle engine does not step for it (its end is taken in at the next step).
    assert not engine.has_work()
    for _ in range(4):
        _step(engine)
    assert engine.scheduler.make_stats().remote_kv.num_blocks_held_for_peers == 0
    assert_nothing_leaks(engine.scheduler)


def test_held_turns_give_their_blocks_to_running_requests_before_anyone_is_preempted():
    connector, engine = _peer_engine(0.5)
    _finish_turn(engine, "old", seed=1)
    _finish_turn(engine, "new", seed=2)
    assert engine.scheduler.make_stats().remote_kv.num_blocks_held_for_peers == 6
    # A request that needs 14 of the 16 blocks: the oldest hold goes first, then the next; nobody is preempted.
    big = make_request("big", prompt_of(50, seed=3), max_tokens=6, ignore_eos=True)
    engine.add_request(big)
    run_to_completion(engine)
    assert big.output_token_ids == expected_output(big)[0]
    assert connector.peer_holds_dropped == ["old", "new"]
    stats = engine.scheduler.make_stats()
    assert stats.num_preemptions == 0 and stats.remote_kv.kv_peer_holds_dropped == {"room": 2}
    assert_nothing_leaks(engine.scheduler)


def test_a_hold_past_the_held_share_drops_the_oldest_and_one_too_large_is_not_held():
    connector, engine = _peer_engine(0.25)  # 4 of 16 blocks
    _finish_turn(engine, "a", seed=1)
    _finish_turn(engine, "b", seed=2)  # 3 + 3 > 4: "a" goes
    assert connector.peer_holds_dropped == ["a"]
    assert list(engine.scheduler.remote_kv.held_for_peers) == ["b"]
    script = {"peer_hold": True, "delay": 1000}
    engine.add_request(make_request("huge", prompt_of(30, seed=4), script, max_tokens=2, ignore_eos=True))
    for _ in range(4):  # 30 prompt tokens and 2 answers: done
        _step(engine)
    assert "huge" not in engine.scheduler.requests  # 8 blocks: over the share alone, freed at once
    assert connector.peer_holds_dropped == ["a", "huge"]
    assert engine.scheduler.make_stats().remote_kv.kv_peer_holds_dropped == {"cap": 1, "too_large": 1}


def test_a_failed_remote_load_is_recomputed_from_scratch():
    engine = make_engine(FakeRemoteConnector(), num_blocks=16, block_size=4, max_model_len=64)
    request = make_request(
        "r", prompt_of(10, seed=3), {"do_remote_prefill": True, "delay": 1, "fail": True}, max_tokens=3, ignore_eos=True
    )
    engine.add_request(request)
    run_to_completion(engine)
    # The failed load wrote wrong KV; none of it is used (the blocks were never cached).
    assert request.output_token_ids == expected_output(request)[0]
    assert engine.scheduler.make_stats().num_preemptions == 0
    assert_nothing_leaks(engine.scheduler)


def test_a_failed_remote_load_under_the_fail_policy_ends_with_an_error():
    engine = make_engine(
        FakeRemoteConnector(recompute_failed_loads=False), num_blocks=16, block_size=4, max_model_len=64
    )
    request = make_request(
        "r", prompt_of(10, seed=3), {"do_remote_prefill": True, "delay": 1, "fail": True}, max_tokens=3, ignore_eos=True
    )
    engine.add_request(request)
    assert run_to_completion(engine) == {"r": "error"}
    assert request.output_token_ids == []
    assert_nothing_leaks(engine.scheduler)


def test_requests_that_can_never_run_are_rejected():
    engine = make_engine(num_blocks=4, block_size=4, max_model_len=16)
    with pytest.raises(ValueError, match="context length is 16"):
        engine.add_request(make_request("long", prompt_of(16, seed=1)))
    engine.add_request(make_request("ok", prompt_of(15, seed=1), max_tokens=100))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(make_request("ok", prompt_of(3, seed=1)))
    with pytest.raises(ValueError, match="empty"):
        make_request("empty", [])
    reasons = run_to_completion(engine)
    assert engine.scheduler.kv_cache_manager.num_blocks == 4 and reasons["ok"] in ("length", "stop")


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"num_blocks": 4, "block_size": 4, "max_model_len": 17}, "less than max_model_len"),
        ({"num_blocks": 0}, "num_blocks"),
        ({"num_blocks": 4, "max_num_seqs": 0}, "max_num_seqs"),
        (
            {"num_blocks": 4, "block_size": 4, "max_model_len": 16, "max_num_batched_tokens": 0},
            "max_num_batched_tokens",
        ),
    ],
)
def test_bad_scheduler_configs_are_rejected(config, message):
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**config)


def test_stats_report_queues_usage_and_prefix_hits():
    engine = make_engine(num_blocks=16, block_size=4, max_model_len=64, max_num_seqs=1)
    prompt = prompt_of(9, seed=1)
    engine.add_request(make_request("a", prompt, max_tokens=5, ignore_eos=True))
    engine.add_request(make_request("b", prompt, max_tokens=5, ignore_eos=True))
    _step(engine)
    stats = engine.make_stats()
    assert (stats.num_running, stats.num_waiting) == (1, 1)
    assert stats.kv_cache_usage == 3 / 16
    run_to_completion(engine)
    stats = engine.make_stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (18, 8)
