"""The scheduler's watchdog over remote loads: a load the worker side never reports (a lost work
item, a wedged transfer thread) cannot park its request for ever. Past the connector's report timeout
the load is failed (recompute or error, by policy) and its blocks are quarantined, since a write into
them might still land; they return to the pool only when the load is finally reported. A quarantine
is never ended by a timer (a read that lands late would write into another request's KV: HTTP 200 with
wrong tokens); one that outlives its alarm is counted and logged, and its blocks stay out of use."""

from __future__ import annotations

import time

from pdserve.engine.request import RequestStatus
from tests.engine.helpers import (
    FakeRemoteConnector,
    assert_nothing_leaks,
    check_invariants,
    expected_output,
    make_engine,
    make_request,
    prompt_of,
)

NEVER = 10**9  # a load "delay" in steps: the fake worker never reports it


def _watched(recompute: bool = True, report_timeout: float = 0.05, quarantine: float = 0.3) -> FakeRemoteConnector:
    connector = FakeRemoteConnector(recompute_failed_loads=recompute)
    connector.load_report_timeout = report_timeout
    connector.quarantine_alarm_seconds = quarantine
    return connector


def _run(engine, seconds: float = 10.0, until=None) -> dict[str, str]:
    """Step (with short sleeps: the watchdog runs on time) until the engine has no work (or ``until(reasons)``)."""
    reasons: dict[str, str] = {}
    end = time.monotonic() + seconds
    while engine.has_work() and not (until is not None and until(reasons)):
        assert time.monotonic() < end, "the engine still has work"
        for output in engine.step():
            if output.finish_reason is not None:
                reasons[output.request_id] = output.finish_reason
        check_invariants(engine.scheduler)
        time.sleep(0.002)
    return reasons


def test_an_unreported_load_is_recomputed_and_its_blocks_stay_quarantined_counted_overdue():
    # Before (dbd1dc4): the quarantine ended 3 x timeout after the watchdog, whatever the transfer did; a NIXL read
    # that landed later (its agent kept from running) wrote into another request's blocks.
    engine = make_engine(_watched(quarantine=0.1), num_blocks=16, block_size=4, max_model_len=64)
    request = make_request("r", prompt_of(10, seed=3), {"do_remote_prefill": True, "delay": NEVER}, max_tokens=3)
    engine.add_request(request)
    engine.step()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    quarantined = set(engine.scheduler.kv_cache_manager.get_block_ids("r"))
    time.sleep(0.06)
    engine.step()  # the watchdog fires: the request recomputes, its old blocks stay out of use
    stats = engine.make_stats().remote_kv
    assert stats.num_blocks_quarantined == 3 and stats.kv_loads_abandoned == 1 and stats.kv_transfer_failures == 1
    assert _run(engine, until=lambda reasons: "r" in reasons) == {"r": expected_output(request)[1]}
    assert request.output_token_ids == expected_output(request)[0]
    time.sleep(0.15)
    # Others come and go long past the alarm: the quarantined blocks are never theirs.
    for number in range(6):
        other = make_request(f"o{number}", prompt_of(12, seed=10 + number), max_tokens=4)
        engine.add_request(other)
        engine.step()
        assert not quarantined & set(engine.scheduler.kv_cache_manager.get_block_ids(other.request_id))
        _run(engine, until=lambda reasons, rid=other.request_id: rid in reasons)
    stats = engine.make_stats().remote_kv
    assert stats.num_blocks_quarantined == 3 and stats.kv_quarantines_overdue == 1
    check_invariants(engine.scheduler)


def test_a_late_report_ends_the_quarantine_and_never_lands_in_the_recomputed_request():
    # The load reports ~60 steps later, long after the watchdog: it only frees the old blocks.
    engine = make_engine(_watched(quarantine=60.0), num_blocks=16, block_size=4, max_model_len=64)
    request = make_request(
        "r", prompt_of(10, seed=4), {"do_remote_prefill": True, "delay": 60}, max_tokens=40, ignore_eos=True
    )
    engine.add_request(request)
    engine.step()
    time.sleep(0.06)
    engine.step()
    assert engine.make_stats().remote_kv.num_blocks_quarantined == 3
    _run(engine)  # would take the whole 60 s quarantine if the late report did not end it
    assert request.output_token_ids == expected_output(request)[0]
    assert_nothing_leaks(engine.scheduler)


def test_under_the_fail_policy_an_unreported_load_ends_the_request_with_an_error():
    engine = make_engine(_watched(recompute=False), num_blocks=16, block_size=4, max_model_len=64)
    request = make_request("r", prompt_of(10, seed=5), {"do_remote_prefill": True, "delay": NEVER}, max_tokens=3)
    engine.add_request(request)
    engine.step()
    time.sleep(0.06)
    assert _run(engine, until=lambda reasons: "r" in reasons) == {"r": "error"}
    assert engine.make_stats().remote_kv.num_blocks_quarantined == 3  # never reported: kept out of use
    check_invariants(engine.scheduler)


def test_a_request_aborted_while_its_load_is_lost_keeps_its_blocks_quarantined_until_the_load_is_reported():
    # Before the watchdog, an abort moved it to "aborted while loading", waiting for a report that never came; then
    # the watchdog freed its blocks after a bound. Now they are quarantined (counted) until the report, which here
    # comes late (after the alarm): then they are freed, and nothing leaks.
    engine = make_engine(_watched(quarantine=0.05), num_blocks=16, block_size=4, max_model_len=64)
    request = make_request("r", prompt_of(10, seed=6), {"do_remote_prefill": True, "delay": 200}, max_tokens=3)
    engine.add_request(request)
    engine.step()
    engine.abort_requests(["r"])
    assert engine.scheduler.kv_cache_manager.num_owned_blocks("r") == 3
    _run(engine)
    assert engine.make_stats().remote_kv.kv_quarantines_overdue == 1
    assert_nothing_leaks(engine.scheduler)


def test_reported_loads_are_not_watched_any_more():
    engine = make_engine(_watched(report_timeout=0.2), num_blocks=16, block_size=4, max_model_len=64)
    request = make_request("r", prompt_of(10, seed=7), {"do_remote_prefill": True, "delay": 1}, max_tokens=30)
    engine.add_request(request)
    _run(engine)
    stats = engine.make_stats().remote_kv
    assert stats.kv_loads_abandoned == 0 and stats.kv_transfer_failures == 0
    assert request.output_token_ids == expected_output(request)[0]


def test_a_load_failed_while_still_writing_is_recomputed_and_its_late_write_lands_only_in_quarantine():
    # A NIXL read that timed out and could not be cancelled: reported failed at once (the request does not wait
    # for the watchdog), its blocks quarantined until the worker says the read ended; the read then writes wrong
    # KV into those old blocks, never into the recomputed request's.
    engine = make_engine(_watched(report_timeout=60.0, quarantine=60.0), num_blocks=16, block_size=4, max_model_len=64)
    request = make_request(
        "r",
        prompt_of(10, seed=6),
        {"do_remote_prefill": True, "delay": 1, "late_write": 8},
        max_tokens=20,
        ignore_eos=True,
    )
    engine.add_request(request)
    for _ in range(3):
        engine.step()
    stats = engine.make_stats().remote_kv
    assert stats.num_blocks_quarantined == 3 and stats.kv_loads_abandoned == 0
    assert request.status != RequestStatus.WAITING_FOR_REMOTE_KVS  # recomputing, not waiting for the watchdog
    _run(engine)  # would take the 60 s quarantine if the drained report did not end it
    assert request.output_token_ids == expected_output(request)[0]
    assert_nothing_leaks(engine.scheduler)


def test_a_quarantine_past_its_alarm_ends_at_the_late_report_and_changes_nothing_else():
    # The alarm passed before the load's last report: counted overdue, never freed early; the report then frees
    # the old blocks without touching the running request.
    engine = make_engine(_watched(report_timeout=60.0, quarantine=0.01), num_blocks=16, block_size=4, max_model_len=64)
    request = make_request(
        "r",
        prompt_of(10, seed=7),
        {"do_remote_prefill": True, "delay": 1, "late_write": 6},
        max_tokens=30,
        ignore_eos=True,
    )
    engine.add_request(request)
    for _ in range(3):
        engine.step()
    time.sleep(0.02)
    assert _run(engine) == {"r": "length"}
    assert request.output_token_ids == expected_output(request)[0]
    assert engine.make_stats().remote_kv.kv_quarantines_overdue == 1
    assert_nothing_leaks(engine.scheduler)
