"""The tier connector's scheduler side over real folders: store orders, lookups (its index and other engines'
files in a shared folder), load orders, what the worker side's reports do, restarts, age and rescans."""

from __future__ import annotations

import os
import time

import pytest

from pdserve.kvtransfer.base import KVConnectorOutput
from pdserve.kvtransfer.connectors import ConnectorContext
from pdserve.kvtransfer.tiers import connector as connector_module
from pdserve.kvtransfer.tiers.block_file import BlockFolder
from pdserve.kvtransfer.tiers.config import KVTierConfig
from pdserve.kvtransfer.tiers.connector import TierConnector
from pdserve.kvtransfer.work import TierLoad, TierStore, TransferWork

from .helpers import COMPAT, Req, block_hash

BLOCK_SIZE = 4
BLOCK_BYTES = 64  # over every rank
H = [block_hash(n) for n in range(8)]


def _config(tmp_path, disk: bool = True, shared: bool = False, **overrides) -> KVTierConfig:
    return KVTierConfig(
        disk_path=str(tmp_path / "disk") if disk else None,
        shared_path=str(tmp_path / "shared") if shared else None,
        **overrides,
    )


def _connector(config: KVTierConfig, num_ranks: int = 1) -> TierConnector:
    return TierConnector(config, COMPAT, BLOCK_SIZE, BLOCK_BYTES, num_ranks)


def _request(request_id: str, hashes: list[bytes]) -> Req:
    return Req(request_id, list(range(len(hashes) * BLOCK_SIZE + 1)), hashes)


def _take(connector: TierConnector) -> TransferWork:
    assert connector.has_pending_work()
    work = connector.build_connector_meta()
    assert isinstance(work, TransferWork) and work
    assert not connector.outbox  # (stores it ordered keep it stepping until they are confirmed)
    return work


def _stored(connector: TierConnector, *items: tuple[str, bytes]) -> None:
    connector.worker_reported(KVConnectorOutput(tier_stored=list(items)))


def _hold(connector: TierConnector, medium: str, *hashes: bytes) -> None:
    """Store ``hashes`` in ``medium`` as a step and its worker report would."""
    connector.blocks_cached([(100 + n, h) for n, h in enumerate(hashes)])
    connector.build_connector_meta()
    _stored(connector, *((medium, h) for h in hashes))
    assert all(h in connector.tiers[medium] for h in hashes)


def _other_engine_writes(root, *hashes: bytes, ranks: int = 1, mtime: float | None = None) -> None:
    for rank in range(ranks):
        folder = BlockFolder(str(root), COMPAT, rank, ranks)
        for h in hashes:
            folder.write(h, bytes(BLOCK_BYTES // ranks))
            if mtime is not None:
                os.utime(folder.path(h), (mtime, mtime))


# ----- stores -------------------------------------------------------------------------------------


def test_cached_blocks_are_ordered_stored_to_disk_and_shared(tmp_path):
    connector = _connector(_config(tmp_path, shared=True))
    assert connector.wants_cached_blocks and not connector.wants_evicted_blocks
    connector.blocks_cached([(7, H[0]), (8, H[1])])
    work = _take(connector)
    assert work.tier_stores == [TierStore(7, H[0], ["disk", "shared"]), TierStore(8, H[1], ["disk", "shared"])]
    assert not (work.tier_loads or work.tier_deletes or work.tier_saves)
    connector.blocks_cached([(9, H[0])])  # being stored already: no second order
    assert connector.build_connector_meta() is None
    _stored(connector, ("disk", H[0]), ("shared", H[0]))
    connector.blocks_cached([(9, H[0])])  # held already
    assert connector.build_connector_meta() is None


def test_a_read_only_shared_tier_is_never_written(tmp_path):
    connector = _connector(_config(tmp_path, shared=True, shared_read_only=True))
    connector.blocks_cached([(7, H[0])])
    assert _take(connector).tier_stores == [TierStore(7, H[0], ["disk"])]

    only_shared = _connector(_config(tmp_path, disk=False, shared=True, shared_read_only=True))
    only_shared.blocks_cached([(7, H[0])])
    assert only_shared.build_connector_meta() is None


def test_a_full_tier_evicts_its_least_recently_used_block_and_orders_its_file_removed(tmp_path):
    connector = _connector(_config(tmp_path, disk_bytes=2 * BLOCK_BYTES))
    _hold(connector, "disk", H[0])
    _hold(connector, "disk", H[1])
    connector.blocks_cached([(9, H[2])])
    work = _take(connector)
    assert work.tier_stores == [TierStore(9, H[2], ["disk"])]
    assert work.tier_deletes == [("disk", H[0])]
    [events] = connector.take_tier_events(snapshot=True)
    assert events.medium == "disk" and events.removed == [H[0]] and events.snapshot == [H[1]]


def test_step_tokens_make_an_order_even_without_work(tmp_path):
    connector = _connector(_config(tmp_path))
    assert connector.build_connector_meta() is None
    connector.note_step(48)
    work = connector.build_connector_meta()
    assert work is not None and not work and work.step_tokens == 48
    assert connector.build_connector_meta() is None


# ----- lookups and loads --------------------------------------------------------------------------


def test_a_lookup_finds_consecutive_blocks_after_the_computed_ones_and_stops_at_the_first_miss(tmp_path):
    connector = _connector(_config(tmp_path))
    _hold(connector, "disk", H[0], H[1], H[3])  # H[2] is not held
    request = _request("r", [H[0], H[1], H[2], H[3]])
    assert connector.get_num_new_matched_tokens(request, 0) == (2 * BLOCK_SIZE, True)
    assert connector.get_num_new_matched_tokens(request, BLOCK_SIZE) == (BLOCK_SIZE, True)
    assert connector.get_num_new_matched_tokens(request, 2 * BLOCK_SIZE) == (0, False)
    assert connector.get_num_new_matched_tokens(request, 3 * BLOCK_SIZE) == (BLOCK_SIZE, True)
    assert connector.get_num_new_matched_tokens(_request("s", [H[5], H[0]]), 0) == (0, False)
    assert connector.get_num_new_matched_tokens(_request("t", []), 0) == (0, False)


def test_an_allocated_lookup_orders_a_load_into_the_requests_blocks(tmp_path):
    connector = _connector(_config(tmp_path, shared=True))
    _hold(connector, "disk", H[1])
    _other_engine_writes(tmp_path / "shared", H[2])  # in the shared folder only, by another engine
    request = _request("r", [H[0], H[1], H[2], H[3]])
    assert connector.get_num_new_matched_tokens(request, BLOCK_SIZE) == (2 * BLOCK_SIZE, True)
    connector.update_state_after_alloc(request, [20, 21, 22, 23, 24], 2 * BLOCK_SIZE)
    work = _take(connector)
    assert work.tier_loads == [TierLoad("r", [(21, "disk", H[1], -1), (22, "shared", H[2], -1)])]
    assert connector.tiers["disk"].pinned == {H[1]: 1} and connector.tiers["shared"].pinned == {H[2]: 1}
    # The plan was used: a second allocation orders nothing.
    connector.update_state_after_alloc(request, [20, 21, 22, 23, 24], 2 * BLOCK_SIZE)
    assert connector.build_connector_meta() is None


def test_an_allocation_without_external_tokens_orders_no_load(tmp_path):
    connector = _connector(_config(tmp_path))
    _hold(connector, "disk", H[0])
    request = _request("r", [H[0]])
    assert connector.get_num_new_matched_tokens(request, 0) == (BLOCK_SIZE, True)
    connector.update_state_after_alloc(request, [5], 0)
    assert connector.build_connector_meta() is None
    assert connector.tiers["disk"].pinned == {}
    connector.update_state_after_alloc(request, [5], BLOCK_SIZE)  # the plan is gone
    assert connector.build_connector_meta() is None


def test_a_finished_request_drops_its_plan(tmp_path):
    connector = _connector(_config(tmp_path))
    _hold(connector, "disk", H[0])
    request = _request("r", [H[0]])
    connector.get_num_new_matched_tokens(request, 0)
    assert connector.request_finished(request, [5], "abort") == (False, None)
    connector.update_state_after_alloc(request, [5], BLOCK_SIZE)
    assert connector.build_connector_meta() is None


def test_another_engines_file_in_the_shared_folder_is_found_and_known_from_then_on(tmp_path):
    connector = _connector(_config(tmp_path, disk=False, shared=True))
    _other_engine_writes(tmp_path / "shared", H[0], H[1])
    assert H[0] not in connector.tiers["shared"]  # written after the connector's scan
    request = _request("r", [H[0], H[1], H[2]])
    assert connector.get_num_new_matched_tokens(request, 0) == (2 * BLOCK_SIZE, True)
    assert H[0] in connector.tiers["shared"] and H[1] in connector.tiers["shared"]
    [events] = connector.take_tier_events(snapshot=False)
    assert events.medium == "shared" and events.stored == [H[0], H[1]]


def test_a_block_in_both_disk_and_shared_loads_from_disk(tmp_path):
    connector = _connector(_config(tmp_path, shared=True))
    _hold(connector, "disk", H[0])
    _other_engine_writes(tmp_path / "shared", H[0])
    request = _request("r", [H[0]])
    connector.get_num_new_matched_tokens(request, 0)
    connector.update_state_after_alloc(request, [3], BLOCK_SIZE)
    assert _take(connector).tier_loads == [TierLoad("r", [(3, "disk", H[0], -1)])]


def test_a_shared_block_lacking_a_ranks_file_is_not_found(tmp_path):
    connector = _connector(_config(tmp_path, disk=False, shared=True), num_ranks=2)
    BlockFolder(str(tmp_path / "shared"), COMPAT, 0, 2).write(H[0], bytes(BLOCK_BYTES // 2))
    assert connector.get_num_new_matched_tokens(_request("r", [H[0]]), 0) == (0, False)
    BlockFolder(str(tmp_path / "shared"), COMPAT, 1, 2).write(H[0], bytes(BLOCK_BYTES // 2))
    assert connector.get_num_new_matched_tokens(_request("r", [H[0]]), 0) == (BLOCK_SIZE, True)


def test_a_refused_file_in_a_read_only_shared_folder_is_not_found_again(tmp_path):
    connector = _connector(_config(tmp_path, disk=False, shared=True, shared_read_only=True))
    _other_engine_writes(tmp_path / "shared", H[0])
    request = _request("r", [H[0]])
    assert connector.get_num_new_matched_tokens(request, 0) == (BLOCK_SIZE, True)
    connector.update_state_after_alloc(request, [3], BLOCK_SIZE)
    connector.build_connector_meta()
    connector.worker_reported(KVConnectorOutput(failed_recving={"r"}, tier_load_failures=[("shared", H[0], "corrupt")]))
    assert connector.get_num_new_matched_tokens(_request("s", [H[0]]), 0) == (0, False)


def test_a_load_estimated_slower_than_recomputing_is_declined_and_counted(tmp_path):
    connector = _connector(_config(tmp_path))
    _hold(connector, "disk", H[0])
    # The worker side's reports: forwards of 64 tokens in 64 ms, a block's bytes read in 1 s.
    connector.worker_reported(KVConnectorOutput(tier_loads=[("disk", BLOCK_BYTES, 1.0)], step_times=[(64, 0.064)]))
    assert connector.get_num_new_matched_tokens(_request("r", [H[0]]), 0) == (0, False)
    connector.update_state_after_alloc(_request("r", [H[0]]), [3], 0)
    assert connector.build_connector_meta() is None
    assert connector.tier_stats()["disk"].loads_declined == 1


# ----- what the worker side reports ---------------------------------------------------------------


def test_a_landed_load_unpins_its_blocks_and_counts_hit_tokens_and_bandwidth(tmp_path):
    connector = _connector(_config(tmp_path))
    _hold(connector, "disk", H[0], H[1])
    request = _request("r", [H[0], H[1]])
    connector.get_num_new_matched_tokens(request, 0)
    connector.update_state_after_alloc(request, [3, 4], 2 * BLOCK_SIZE)
    connector.build_connector_meta()
    disk = connector.tiers["disk"]
    assert disk.pinned == {H[0]: 1, H[1]: 1}
    connector.worker_reported(
        KVConnectorOutput(finished_recving={"r", "someone-else"}, tier_loads=[("disk", 2 * BLOCK_BYTES, 0.002)])
    )
    assert disk.pinned == {}
    stats = connector.tier_stats()["disk"]
    assert stats.hit_tokens == 2 * BLOCK_SIZE
    assert stats.loaded_bytes == 2 * BLOCK_BYTES and stats.load_seconds == [0.002]
    assert connector.tier_stats()["disk"].load_seconds == []
    assert connector.cost.seconds_per_byte["disk"] == pytest.approx(0.002 / (2 * BLOCK_BYTES))
    connector.worker_reported(KVConnectorOutput(finished_recving={"r"}))  # reported twice: counted once
    assert connector.tier_stats()["disk"].hit_tokens == 2 * BLOCK_SIZE


def test_a_failed_block_load_forgets_the_block_and_orders_its_file_removed(tmp_path):
    connector = _connector(_config(tmp_path))
    _hold(connector, "disk", H[0], H[1])
    request = _request("r", [H[0], H[1]])
    connector.get_num_new_matched_tokens(request, 0)
    connector.update_state_after_alloc(request, [3, 4], 2 * BLOCK_SIZE)
    connector.build_connector_meta()
    assert connector.recompute_failed_load(request)
    connector.worker_reported(KVConnectorOutput(failed_recving={"r"}, tier_load_failures=[("disk", H[1], "corrupt")]))
    disk = connector.tiers["disk"]
    assert H[1] not in disk and H[0] in disk and disk.pinned == {}
    assert _take(connector).tier_deletes == [("disk", H[1])]
    stats = connector.tier_stats()["disk"]
    assert stats.skipped == {"corrupt": 1} and stats.hit_tokens == 0
    assert connector.get_num_new_matched_tokens(request, 0) == (BLOCK_SIZE, True)  # H[0] still loads


def test_a_failed_block_load_from_a_read_only_shared_tier_removes_no_file(tmp_path):
    connector = _connector(_config(tmp_path, disk=False, shared=True, shared_read_only=True))
    _other_engine_writes(tmp_path / "shared", H[0])
    request = _request("r", [H[0]])
    assert connector.get_num_new_matched_tokens(request, 0) == (BLOCK_SIZE, True)
    connector.update_state_after_alloc(request, [3], BLOCK_SIZE)
    connector.build_connector_meta()
    connector.worker_reported(
        KVConnectorOutput(failed_recving={"r"}, tier_load_failures=[("shared", H[0], "truncated")])
    )
    assert H[0] not in connector.tiers["shared"]
    assert connector.build_connector_meta() is None
    assert connector.tier_stats()["shared"].skipped == {"truncated": 1}


def test_stored_and_failed_stores_reach_the_index(tmp_path):
    connector = _connector(_config(tmp_path, shared=True))
    connector.blocks_cached([(1, H[0]), (2, H[1])])
    connector.build_connector_meta()
    connector.worker_reported(
        KVConnectorOutput(
            tier_stored=[("disk", H[0]), ("shared", H[0]), ("disk", H[1])],
            tier_store_failures=[("shared", H[1], "disk_full")],
        )
    )
    assert H[0] in connector.tiers["disk"] and H[0] in connector.tiers["shared"] and H[1] in connector.tiers["disk"]
    assert H[1] not in connector.tiers["shared"] and not connector.tiers["shared"].pending
    assert connector.tier_stats()["shared"].store_failures == {"disk_full": 1}
    connector.blocks_cached([(2, H[1])])  # the failed store may be tried again
    assert _take(connector).tier_stores == [TierStore(2, H[1], ["shared"])]


# ----- restarts, age, rescans ---------------------------------------------------------------------


def test_a_restart_adopts_the_folders_files_and_removes_those_past_their_age(tmp_path):
    max_age = 3600.0
    now = time.time()
    _other_engine_writes(tmp_path / "disk", H[0], mtime=now - 2 * max_age)
    _other_engine_writes(tmp_path / "disk", H[1], mtime=now - 60)
    _other_engine_writes(tmp_path / "disk", H[2], mtime=now - 30)
    connector = _connector(_config(tmp_path, max_age_s=max_age))
    disk = connector.tiers["disk"]
    assert list(disk.last_used) == [H[1], H[2]]  # oldest first: the least recently used
    assert _take(connector).tier_deletes == [("disk", H[0])]
    assert connector.get_num_new_matched_tokens(_request("r", [H[1], H[2]]), 0) == (2 * BLOCK_SIZE, True)
    [events] = connector.take_tier_events(snapshot=False)
    assert events.stored == [H[1], H[2]]


def test_a_restart_on_a_read_only_shared_folder_neither_adopts_nor_removes_old_files(tmp_path):
    now = time.time()
    _other_engine_writes(tmp_path / "shared", H[0], mtime=now - 7200)
    _other_engine_writes(tmp_path / "shared", H[1])
    connector = _connector(_config(tmp_path, disk=False, shared=True, shared_read_only=True, max_age_s=3600))
    assert list(connector.tiers["shared"].last_used) == [H[1]]
    assert connector.build_connector_meta() is None


def test_a_restart_adopts_only_blocks_with_every_ranks_file(tmp_path):
    _other_engine_writes(tmp_path / "disk", H[0], ranks=2)
    BlockFolder(str(tmp_path / "disk"), COMPAT, 0, 2).write(H[1], bytes(BLOCK_BYTES // 2))
    _other_engine_writes(tmp_path / "disk", H[2], ranks=1)  # a TP-1 engine's
    connector = _connector(_config(tmp_path), num_ranks=2)
    assert list(connector.tiers["disk"].last_used) == [H[0]]


def test_a_restart_removes_old_files_of_a_block_some_rank_never_wrote(tmp_path):
    now = time.time()
    partial = BlockFolder(str(tmp_path / "disk"), COMPAT, 0, 2)
    partial.write(H[0], bytes(BLOCK_BYTES // 2))  # rank 1's store failed, or the engine died before it
    os.utime(partial.path(H[0]), (now - 7200, now - 7200))
    partial.write(H[1], bytes(BLOCK_BYTES // 2))  # fresh: rank 1 may still be writing it
    connector = _connector(_config(tmp_path, max_age_s=3600), num_ranks=2)
    assert len(connector.tiers["disk"]) == 0
    assert _take(connector).tier_deletes == [("disk", H[0])]


def test_a_restart_into_a_smaller_bound_keeps_the_most_recently_used_files(tmp_path):
    now = time.time()
    for n in range(4):
        _other_engine_writes(tmp_path / "disk", H[n], mtime=now - 100 + n)  # H[3] the newest
    connector = _connector(_config(tmp_path, disk_bytes=2 * BLOCK_BYTES))
    assert set(connector.tiers["disk"].last_used) == {H[2], H[3]}


def test_blocks_past_their_age_are_swept_even_on_an_idle_engine(tmp_path, monkeypatch):
    monkeypatch.setattr(connector_module, "SWEEP_INTERVAL_S", 0.5)
    connector = _connector(_config(tmp_path, shared=True, max_age_s=0.3))
    connector.blocks_cached([(1, H[0]), (2, H[1])])
    connector.build_connector_meta()
    _stored(connector, ("disk", H[0]), ("shared", H[0]), ("disk", H[1]))
    connector.worker_reported(KVConnectorOutput(tier_store_failures=[("shared", H[1], "io")]))  # none pending
    request = _request("r", [H[1]])
    connector.get_num_new_matched_tokens(request, 0)
    connector.update_state_after_alloc(request, [5], BLOCK_SIZE)  # H[1] pinned by a load
    assert _take(connector).tier_loads
    assert not connector.has_pending_work()
    time.sleep(0.55)
    # Nothing queued, but a sweep is due: the engine must step (an idle engine's core steps when there is work).
    assert connector.has_pending_work()
    work = _take(connector)
    assert sorted(work.tier_deletes) == [("disk", H[0]), ("shared", H[0])]
    assert H[0] not in connector.tiers["disk"] and H[0] not in connector.tiers["shared"]
    assert H[1] in connector.tiers["disk"]  # pinned: waits
    connector.worker_reported(KVConnectorOutput(finished_recving={"r"}))
    time.sleep(0.55)
    assert _take(connector).tier_deletes == [("disk", H[1])]
    assert len(connector.tiers["disk"]) == 0
    [disk_events, shared_events] = connector.take_tier_events(snapshot=False)
    assert disk_events.removed == [H[0], H[1]] and shared_events.removed == [H[0]]


def test_the_shared_folder_is_rescanned_for_other_engines_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(connector_module, "SHARED_RESCAN_S", 0.0)
    connector = _connector(_config(tmp_path, shared=True, max_age_s=3600))
    _other_engine_writes(tmp_path / "shared", H[0])
    _other_engine_writes(tmp_path / "shared", H[1], mtime=time.time() - 7200)
    assert connector.has_pending_work()  # a rescan is due
    work = connector.build_connector_meta()
    assert work is not None and work.tier_deletes == [("shared", H[1])]
    assert H[0] in connector.tiers["shared"] and H[0] not in connector.tiers["disk"]
    assert H[1] not in connector.tiers["shared"]


def test_from_context_needs_a_tier(tmp_path):
    context = ConnectorContext(COMPAT, BLOCK_SIZE, BLOCK_BYTES, 1)
    with pytest.raises(ValueError, match="needs a tier"):
        TierConnector.from_context(context)
    context.tiers = _config(tmp_path)
    connector = TierConnector.from_context(context)
    assert set(connector.tiers) == {"disk"} and connector.compat_hash == COMPAT
    assert connector.recompute_failed_loads and connector.load_report_timeout == context.tiers.load_timeout_s
