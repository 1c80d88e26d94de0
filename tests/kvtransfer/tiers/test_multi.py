"""The multi-connector with real parts (the P/D connector's scheduler side and the tier connector over real
folders), the multi-worker (a real tier worker beside a second worker side), and the merges both rest on
(``KVConnectorOutput.merge``, ``TransferWork.merge``)."""

from __future__ import annotations

import threading
from dataclasses import fields
from typing import Any

import numpy as np
import pytest
import torch

from pdserve.kvtransfer.base import KVConnectorOutput
from pdserve.kvtransfer.config import KVFaults, KVTransferConfig
from pdserve.kvtransfer.connector import PDConnectorScheduler
from pdserve.kvtransfer.multi import MultiConnector, MultiWorker
from pdserve.kvtransfer.params import parse_remote_prefill
from pdserve.kvtransfer.tiers.block_file import BlockFolder
from pdserve.kvtransfer.tiers.config import KVTierConfig
from pdserve.kvtransfer.tiers.connector import TierConnector
from pdserve.kvtransfer.tiers.worker import TierWorker
from pdserve.kvtransfer.work import LoadSpec, TierLoad, TierStore, TransferWork
from pdserve.kvtransfer.workers import TimedWorker
from tests.kvtransfer.test_connector import _remote_params

from .helpers import COMPAT, Req, block_hash, collect_until

BLOCK_SIZE = 4
BLOCK_BYTES = 64
PORT = 5601
H = [block_hash(n) for n in range(4)]
PROMPT = list(range(2 * BLOCK_SIZE + 1))  # two full blocks and one token
HASHES = [H[0], H[1]]


def _pd(**overrides: Any) -> PDConnectorScheduler:
    config = KVTransferConfig(transport="tcp", faults=KVFaults(), **overrides)
    return PDConnectorScheduler(config, COMPAT, BLOCK_SIZE, [PORT], np.zeros(64, dtype=np.int64))


def _tiers(root) -> TierConnector:
    return TierConnector(KVTierConfig(disk_path=str(root)), COMPAT, BLOCK_SIZE, BLOCK_BYTES)


def _hold(tiers: TierConnector, *hashes: bytes) -> None:
    tiers.blocks_cached([(100 + n, h) for n, h in enumerate(hashes)])
    tiers.build_connector_meta()
    tiers.worker_reported(KVConnectorOutput(tier_stored=[("disk", h) for h in hashes]))


def _decode_leg(request_id: str = "dec") -> Req:
    """A decode leg whose prompt a prefill engine holds (blocks 100, 101, 102)."""
    params = _remote_params(PROMPT, BLOCK_SIZE, kv_compat_hash=COMPAT)
    return Req(request_id, PROMPT, HASHES, remote_prefill=parse_remote_prefill(params))


def test_a_multi_connector_composes_at_least_two_parts(tmp_path):
    with pytest.raises(ValueError):
        MultiConnector([_tiers(tmp_path)])


def test_the_parts_settings_combine(tmp_path):
    pd, tiers = _pd(load_failure="fail"), _tiers(tmp_path)
    multi = MultiConnector([pd, tiers])
    assert multi.wants_cached_blocks and not multi.wants_evicted_blocks
    assert multi.compat_hash == COMPAT
    assert multi.recompute_failed_loads is False  # the first part's
    assert multi.load_report_timeout == max(pd.load_report_timeout, tiers.load_report_timeout)
    assert multi.quarantine_alarm_seconds == max(pd.quarantine_alarm_seconds, tiers.quarantine_alarm_seconds)


def test_a_decode_legs_remote_prefill_owns_the_load_even_where_the_tiers_hold_blocks(tmp_path):
    pd, tiers = _pd(), _tiers(tmp_path)
    multi = MultiConnector([pd, tiers])
    _hold(tiers, *HASHES)
    request = _decode_leg()
    multi.request_added(request)
    assert multi.expects_remote_kv(request)
    assert multi.get_num_new_matched_tokens(request, 0) == (len(PROMPT), True)
    multi.update_state_after_alloc(request, [10, 11, 12], len(PROMPT))
    work = multi.build_connector_meta()
    assert [(r, remote) for r, remote in work.tracks] == [("dec", request.remote_prefill)]
    assert work.loads == [LoadSpec("dec", request.remote_prefill, [10, 11, 12], [100, 101, 102], [7, 8, 9])]
    assert work.tier_loads == [] and tiers.tiers["disk"].pinned == {}


def test_the_tiers_own_a_load_the_pd_part_cannot_make(tmp_path):
    pd, tiers = _pd(load_failure="fail"), _tiers(tmp_path)
    multi = MultiConnector([pd, tiers])
    _hold(tiers, *HASHES)
    request = Req("r", PROMPT, HASHES)
    assert multi.get_num_new_matched_tokens(request, 0) == (2 * BLOCK_SIZE, True)
    multi.update_state_after_alloc(request, [10, 11, 12], 2 * BLOCK_SIZE)
    work = multi.build_connector_meta()
    assert work.tier_loads == [TierLoad("r", [(10, "disk", H[0], -1), (11, "disk", H[1], -1)])]
    assert not (work.loads or work.releases or work.tracks)
    # A failed load is recomputed or not as its owner says: the tiers recompute, the P/D part (first) fails.
    assert multi.recompute_failed_load(request) is True
    decode_leg = _decode_leg()
    multi.request_added(decode_leg)
    multi.get_num_new_matched_tokens(decode_leg, 0)
    assert multi.recompute_failed_load(decode_leg) is False
    assert multi.recompute_failed_load(Req("unknown", PROMPT, [])) is False  # no owner: the first part's


def test_only_the_owner_hears_the_allocations_tokens(tmp_path):
    first, second = _tiers(tmp_path / "a"), _tiers(tmp_path / "b")
    multi = MultiConnector([first, second])
    request = Req("r", PROMPT, HASHES)
    _hold(second, H[0])
    assert multi.get_num_new_matched_tokens(request, 0) == (BLOCK_SIZE, True)  # the second part's (it plans)
    # Not allocated (no room); by the next look the first part holds both blocks and owns the load.
    _hold(first, *HASHES)
    assert multi.get_num_new_matched_tokens(request, 0) == (2 * BLOCK_SIZE, True)
    multi.update_state_after_alloc(request, [10, 11, 12], 2 * BLOCK_SIZE)
    work = multi.build_connector_meta()
    assert work.tier_loads == [TierLoad("r", [(10, "disk", H[0], -1), (11, "disk", H[1], -1)])]  # the first's only
    assert second.tiers["disk"].pinned == {} and first.tiers["disk"].pinned == {H[0]: 1, H[1]: 1}


def test_each_steps_orders_merge_into_one(tmp_path):
    pd, tiers = _pd(), _tiers(tmp_path)
    multi = MultiConnector([pd, tiers])
    assert not multi.has_pending_work() and multi.build_connector_meta() is None
    multi.note_step(32)
    work = multi.build_connector_meta()  # the tiers' order, made for the step's tokens alone
    assert work is not None and work.step_tokens == 32
    request = _decode_leg()
    multi.request_added(request)
    multi.blocks_cached([(5, H[0])])
    multi.note_step(16)
    assert multi.has_pending_work()
    work = multi.build_connector_meta()
    assert work.tracks == [("dec", request.remote_prefill)]
    assert work.tier_stores == [TierStore(5, H[0], ["disk"])]
    assert work.step_tokens == 16
    assert multi.has_pending_work() and multi.build_connector_meta() is None  # the store is not confirmed yet
    multi.worker_reported(KVConnectorOutput(tier_stored=[("disk", H[0])]))
    assert not multi.has_pending_work()


@pytest.mark.parametrize("order", ["pd-first", "tiers-first"])
def test_a_finished_request_returns_the_holding_parts_params(tmp_path, order):
    pd, tiers = _pd(), _tiers(tmp_path)
    multi = MultiConnector([pd, tiers] if order == "pd-first" else [tiers, pd])
    leg = Req("leg", PROMPT, HASHES, remote_decode=True)
    hold, params = multi.request_finished(leg, [4, 5, 6, 7], "length")
    assert hold is True
    assert params["remote_block_ids"] == [4, 5, 6] and params["remote_request_id"] == "leg"
    assert multi.build_connector_meta().holds == [("leg", [4, 5, 6], params["remote_hold_token"])]
    assert multi.request_finished(Req("plain", PROMPT, HASHES), [4, 5, 6], "stop") == (False, None)


def test_reports_stats_and_events_reach_every_part(tmp_path):
    pd, tiers = _pd(), _tiers(tmp_path)
    multi = MultiConnector([pd, tiers])
    multi.blocks_cached([(5, H[0])])
    multi.build_connector_meta()
    multi.worker_reported(KVConnectorOutput(tier_stored=[("disk", H[0])], finished_sending={"leg"}))
    assert H[0] in tiers.tiers["disk"]
    # The P/D part reports its peer reads as a medium of its own.
    assert set(multi.tier_stats()) == {"disk", "peer"} and multi.tier_stats()["disk"].num_blocks == 1
    [events] = multi.take_tier_events(snapshot=True)
    assert events.medium == "disk" and events.stored == [H[0]] and events.snapshot == [H[0]]


# ----- the worker side ----------------------------------------------------------------------------


class _Reporter:
    """A second worker side (as the P/D transfer agent is): records its orders, reports what it is given."""

    def __init__(self, outputs: list[KVConnectorOutput | None]) -> None:
        self.outputs = outputs
        self.orders: list[TransferWork] = []
        self.closed = False

    def submit(self, work: TransferWork) -> None:
        self.orders.append(work)

    def collect(self) -> KVConnectorOutput | None:
        return self.outputs.pop(0) if self.outputs else None

    def close(self) -> None:
        self.closed = True


def test_a_multi_worker_hands_every_part_the_order_and_merges_their_reports(tmp_path):
    kv_cache = torch.randn(4, 2, 2, 2, BLOCK_SIZE, 8)
    tier_worker = TierWorker(KVTierConfig(disk_path=str(tmp_path)), kv_cache, COMPAT, 0, 1)
    reporter = _Reporter(
        [
            None,
            KVConnectorOutput(finished_sending={"leg"}, transfers=[(1024, 0.5)], num_failed_transfers=1),
            KVConnectorOutput(finished_recving={"dec"}, num_failed_transfers=2),
        ]
    )
    multi = TimedWorker(MultiWorker([tier_worker, reporter]))  # as make_connector_workers builds it
    try:
        assert multi.collect() is None  # neither reports anything
        work = TransferWork(tier_stores=[TierStore(1, H[0], ["disk"])], step_tokens=40)
        multi.submit(work)
        assert reporter.orders == [work]
        report = collect_until(multi.collect, lambda out: bool(out.tier_stored) and not reporter.outputs)
        assert report.tier_stored == [("disk", H[0])]
        assert report.finished_sending == {"leg"} and report.finished_recving == {"dec"}
        assert report.transfers == [(1024, 0.5)] and report.num_failed_transfers == 3
        assert [tokens for tokens, _ in report.step_times] == [40]
        assert BlockFolder(str(tmp_path), COMPAT).exists(H[0])
    finally:
        multi.close()
    assert reporter.closed
    assert not any(t.name == "kv-tiers-0" and t.is_alive() for t in threading.enumerate())


# ----- the merges ---------------------------------------------------------------------------------


def _sample_output(tag: str) -> KVConnectorOutput:
    """A report with every field set (so a field the merge or says_anything forgets shows)."""
    output = KVConnectorOutput()
    for item in fields(output):
        value = getattr(output, item.name)
        if isinstance(value, int):
            setattr(output, item.name, len(item.name))
        elif isinstance(value, set):
            value.add(f"{tag}-{item.name}")
        elif isinstance(value, dict):
            value[f"{tag}-{item.name}"] = 1
            value["shared-reason"] = 2
        else:
            value.append((tag, item.name))
    return output


def test_reports_merge_field_by_field():
    mine, theirs = _sample_output("a"), _sample_output("b")
    mine.merge(theirs)
    for item in fields(mine):
        value = getattr(mine, item.name)
        if isinstance(value, int):
            assert value == 2 * len(item.name), item.name  # ints add
        elif isinstance(value, set):
            assert value == {f"a-{item.name}", f"b-{item.name}"}, item.name  # sets join
        elif isinstance(value, dict):
            assert value == {f"a-{item.name}": 1, f"b-{item.name}": 1, "shared-reason": 4}, item.name  # dicts add
        else:
            assert value == [("a", item.name), ("b", item.name)], item.name  # lists extend
    assert theirs.finished_sending == {"b-finished_sending"}  # the merged-in report is not changed


def test_every_report_field_says_something():
    for item in fields(KVConnectorOutput):
        output, sample = KVConnectorOutput(), _sample_output("x")
        setattr(output, item.name, getattr(sample, item.name))
        assert output.says_anything(), item.name
    assert not KVConnectorOutput().says_anything()


def test_work_orders_merge_field_by_field():
    mine = TransferWork(tier_stores=[TierStore(1, H[0], ["disk"])], cancels=["a"], step_tokens=8)
    theirs = TransferWork(tier_stores=[TierStore(2, H[1], ["disk"])], tier_deletes=[("disk", H[2])], step_tokens=32)
    mine.merge(theirs)
    assert mine.tier_stores == [TierStore(1, H[0], ["disk"]), TierStore(2, H[1], ["disk"])]
    assert mine.cancels == ["a"] and mine.tier_deletes == [("disk", H[2])] and mine.step_tokens == 32
    # Every list field is work (the step's token count alone is not).
    for item in fields(TransferWork):
        work = TransferWork()
        if item.name == "step_tokens":
            work.step_tokens = 5
            assert not work
        else:
            getattr(work, item.name).append(object())
            assert work, item.name
