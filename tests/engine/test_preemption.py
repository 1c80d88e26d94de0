"""Preemption by recompute: with too few blocks requests are preempted, and still finish with
exactly the outputs they get with plenty of blocks."""

from pdserve.engine.request import RequestStatus
from tests.engine.helpers import (
    assert_nothing_leaks,
    expected_output,
    make_engine,
    make_request,
    prompt_of,
    run_to_completion,
)


def _run(num_blocks: int, enable_prefix_caching: bool):
    engine = make_engine(
        num_blocks=num_blocks,
        block_size=4,
        max_model_len=48,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        enable_prefix_caching=enable_prefix_caching,
    )
    requests = [
        make_request(f"r{i}", prompt_of(6 + 3 * i, seed=i), max_tokens=20, ignore_eos=i % 2 == 0) for i in range(8)
    ]
    for request in requests:
        engine.add_request(request)
    reasons = run_to_completion(engine)
    assert_nothing_leaks(engine.scheduler)
    return engine, requests, reasons


def test_outputs_with_preemption_equal_outputs_with_plenty_of_blocks():
    for caching in (True, False):
        _, roomy, roomy_reasons = _run(num_blocks=200, enable_prefix_caching=caching)
        tight_engine, tight, tight_reasons = _run(num_blocks=12, enable_prefix_caching=caching)
        assert tight_engine.scheduler.num_preemptions > 0
        assert any(request.num_preemptions > 0 for request in tight)
        assert tight_reasons == roomy_reasons
        for a, b in zip(roomy, tight, strict=True):
            assert a.output_token_ids == b.output_token_ids == expected_output(a)[0]


def test_preempted_request_releases_its_blocks_and_returns_to_the_queue_head():
    engine = make_engine(num_blocks=6, block_size=4, max_model_len=24, max_num_batched_tokens=64)
    first = make_request("first", prompt_of(8, seed=1), max_tokens=12, ignore_eos=True)
    second = make_request("second", prompt_of(8, seed=2), max_tokens=12, ignore_eos=True)
    third = make_request("third", prompt_of(4, seed=3), max_tokens=1)
    for request in (first, second, third):
        engine.add_request(request)
    while second.status != RequestStatus.PREEMPTED:
        engine.step()
    scheduler = engine.scheduler
    assert second.num_computed_tokens == 0
    assert scheduler.kv_cache_manager.num_owned_blocks("second") == 0
    assert scheduler.waiting[0] is second  # ahead of anything that arrived after it
    assert first.status == RequestStatus.RUNNING
    run_to_completion(engine)
    for request in (first, second, third):
        assert request.output_token_ids == expected_output(request)[0]
