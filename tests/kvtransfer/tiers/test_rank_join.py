"""RankReports.join for the KV tiers at TP 2: a block is stored once every rank stored its part; a failure on
any rank is the block's; loads, load failures and (rank 0's) step times pass through."""

from __future__ import annotations

from pdserve.kvtransfer.aggregate import RankReports
from pdserve.kvtransfer.base import KVConnectorOutput

from .helpers import block_hash

H = [block_hash(n) for n in range(4)]


def _stored(*items: tuple[str, bytes]) -> KVConnectorOutput:
    return KVConnectorOutput(tier_stored=list(items))


def _failed(*items: tuple[str, bytes, str]) -> KVConnectorOutput:
    return KVConnectorOutput(tier_store_failures=list(items))


def test_a_store_counts_once_every_rank_stored_its_part():
    reports = RankReports(2)
    assert reports.join([_stored(("disk", H[0]), ("shared", H[0])), None]) is None
    joined = reports.join([None, _stored(("disk", H[0]))])
    assert joined.tier_stored == [("disk", H[0])]
    joined = reports.join([_stored(("disk", H[1])), _stored(("shared", H[0]), ("disk", H[1]))])
    assert sorted(joined.tier_stored) == sorted([("shared", H[0]), ("disk", H[1])])
    assert reports._stored == {}


def test_a_failure_on_one_rank_is_the_blocks():
    reports = RankReports(2)
    assert reports.join([_stored(("disk", H[0])), None]) is None
    joined = reports.join([None, _failed(("disk", H[0], "disk_full"))])
    assert joined.tier_store_failures == [("disk", H[0], "disk_full")] and joined.tier_stored == []
    # In one step, either order.
    joined = reports.join([_stored(("disk", H[1])), _failed(("disk", H[1], "io"))])
    assert joined.tier_store_failures == [("disk", H[1], "io")] and joined.tier_stored == []


def test_a_failure_reported_before_the_other_ranks_store_leaves_no_count_behind():
    reports = RankReports(2)
    joined = reports.join([_failed(("disk", H[0], "backlog")), _stored(("disk", H[0]))])
    assert joined.tier_store_failures == [("disk", H[0], "backlog")] and joined.tier_stored == []
    joined = reports.join([_failed(("disk", H[1], "backlog")), None])
    assert joined.tier_store_failures == [("disk", H[1], "backlog")]
    assert reports.join([None, _stored(("disk", H[1]))]) is None
    # The blocks are ordered stored again: each counts only once both ranks have stored it anew.
    assert reports.join([_stored(("disk", H[0]), ("disk", H[1])), None]) is None
    joined = reports.join([None, _stored(("disk", H[0]), ("disk", H[1]))])
    assert sorted(joined.tier_stored) == sorted([("disk", H[0]), ("disk", H[1])])
    assert reports._stored == {}


def test_a_failure_on_every_rank_is_reported_once():
    reports = RankReports(2)
    joined = reports.join([_failed(("disk", H[0], "io")), _failed(("disk", H[0], "io"))])
    assert joined.tier_store_failures == [("disk", H[0], "io")]


def test_loads_and_step_times_pass_through():
    reports = RankReports(2)
    rank0 = KVConnectorOutput(
        tier_loads=[("disk", 100, 0.1)], tier_load_failures=[("disk", H[0], "corrupt")], step_times=[(64, 0.5)]
    )
    rank1 = KVConnectorOutput(tier_loads=[("disk", 100, 0.2)], step_times=[(64, 0.6)])
    joined = reports.join([rank0, rank1])
    assert joined.tier_loads == [("disk", 100, 0.1), ("disk", 100, 0.2)]
    assert joined.tier_load_failures == [("disk", H[0], "corrupt")]
    assert joined.step_times == [(64, 0.5)]  # every rank times the same forwards: rank 0's
    assert reports.join([None, KVConnectorOutput(step_times=[(64, 0.6)])]) is None


def test_a_tier_load_lands_once_every_rank_loaded_and_fails_if_any_failed():
    reports = RankReports(2)
    assert reports.join([KVConnectorOutput(finished_recving={"r"}), None]) is None
    assert reports.join([None, KVConnectorOutput(finished_recving={"r"})]).finished_recving == {"r"}
    joined = reports.join([KVConnectorOutput(finished_recving={"s"}), KVConnectorOutput(failed_recving={"s"})])
    assert joined.failed_recving == {"s"} and not joined.finished_recving
