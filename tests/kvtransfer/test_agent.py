"""Two real transfer agents in this process over the TCP transport on 127.0.0.1: a prefill-role
agent holding blocks of a small KV cache and a decode-role agent pulling them.

A pull copies exactly the held blocks into the local block ids and ends the hold; a hold nobody
renews expires, after which a pull fails (never data); renewals keep it alive; a cancel before
the pull starts drops it and frees on prefill; stale generations and an incompatible peer fail
the pull without touching the cache. Every wait is a bounded poll, every agent is closed.
"""

from __future__ import annotations

import time

import numpy as np

from pdserve.kvtransfer.config import KVFaults
from pdserve.kvtransfer.layout import head_mapping_problem
from pdserve.kvtransfer.work import LoadSpec, TransferWork
from tests.kvtransfer.agents import BLOCK_BYTES, NUM_BLOCKS, assert_untouched, engines, load, token_of

# ----- the pull ---------------------------------------------------------------------------------


def test_a_pull_copies_exactly_the_held_blocks_and_ends_the_hold():
    import torch

    with engines({"filled": True}, {"filled": False}) as (prefill, decode):
        prefill.generations[:] = np.arange(NUM_BLOCKS) + 40
        prefill.agent.submit(TransferWork(holds=[("p", [1, 2, 5], token_of("p"))]))
        remote = prefill.remote("p", [1, 2, 5])
        assert remote.generations == [41, 42, 45]

        decode.agent.submit(TransferWork(tracks=[("d", remote)], loads=[load("d", remote, [6, 0, 3])]))

        decode.wait_for(lambda seen: seen.finished_recving or seen.failed_recving, "the pull")
        assert decode.seen.finished_recving == {"d"} and not decode.seen.failed_recving
        [(num_bytes, seconds)] = decode.seen.transfers
        assert num_bytes == 3 * BLOCK_BYTES and seconds >= 0
        assert decode.seen.num_failed_transfers == 0
        for local, held in ((6, 1), (0, 2), (3, 5)):
            assert torch.equal(decode.block(local), prefill.block(held)), (local, held)
        assert_untouched(decode, 6, 0, 3)
        assert_untouched(prefill)  # a read copies out, it never moves or changes the source

        # The read asked prefill to free: the hold ends, and nothing else on prefill does.
        prefill.wait_for(lambda seen: seen.finished_sending, "the release")
        assert prefill.seen.finished_sending == {"p"} and prefill.seen.num_expired_leases == 0

        # Released blocks are never read again: a second pull of them fails.
        decode.agent.submit(TransferWork(loads=[load("d2", remote, [4, 7, 1])]))
        decode.wait_for(lambda seen: "d2" in seen.finished_recving | seen.failed_recving, "the second pull")
        assert "d2" in decode.seen.failed_recving
        assert_untouched(decode, 6, 0, 3)


def test_pulls_of_two_requests_from_one_engine_land_each_in_its_own_blocks():
    import torch

    with engines({"filled": True}, {"filled": False}) as (prefill, decode):
        prefill.agent.submit(TransferWork(holds=[("p", [1, 2], token_of("p")), ("q", [7], token_of("q"))]))
        p, q = prefill.remote("p", [1, 2]), prefill.remote("q", [7])
        decode.agent.submit(TransferWork(loads=[load("dp", p, [3, 4]), load("dq", q, [5])]))

        decode.wait_for(lambda seen: len(seen.finished_recving | seen.failed_recving) == 2, "both pulls")
        assert decode.seen.finished_recving == {"dp", "dq"}
        assert sorted(n for n, _ in decode.seen.transfers) == [BLOCK_BYTES, 2 * BLOCK_BYTES]
        for local, held in ((3, 1), (4, 2), (5, 7)):
            assert torch.equal(decode.block(local), prefill.block(held))
        assert_untouched(decode, 3, 4, 5)
        prefill.wait_for(lambda seen: len(seen.finished_sending) == 2, "both releases")
        assert prefill.seen.finished_sending == {"p", "q"}


def test_a_read_that_comes_before_its_hold_is_served_once_the_hold_arrives():
    import torch

    with engines({"filled": True}, {"filled": False}) as (prefill, decode):
        remote = prefill.remote("p", [2, 3])
        decode.agent.submit(TransferWork(loads=[load("d", remote, [0, 1])]))
        assert not decode.quiet_for(0.2).finished_recving  # the read waits on prefill for the hold

        prefill.agent.submit(TransferWork(holds=[("p", [2, 3], token_of("p"))]))

        decode.wait_for(lambda seen: seen.finished_recving or seen.failed_recving, "the pull")
        assert decode.seen.finished_recving == {"d"}
        assert torch.equal(decode.block(0), prefill.block(2)) and torch.equal(decode.block(1), prefill.block(3))
        prefill.wait_for(lambda seen: seen.finished_sending, "the release")
        assert prefill.seen.finished_sending == {"p"}


# ----- leases -----------------------------------------------------------------------------------


def test_a_lease_nobody_renews_expires_and_a_later_pull_fails_without_data():
    with engines({"filled": True, "lease_seconds": 0.5}, {"filled": False}) as (prefill, decode):
        start = time.monotonic()
        prefill.agent.submit(TransferWork(holds=[("p", [1, 2], token_of("p"))]))

        prefill.wait_for(lambda seen: seen.finished_sending, "the lease to expire")
        assert time.monotonic() - start >= 0.45  # not before its lease
        assert prefill.seen.finished_sending == {"p"} and prefill.seen.num_expired_leases == 1

        remote = prefill.remote("p", [1, 2], lease_seconds=0.5)
        decode.agent.submit(TransferWork(loads=[load("d", remote, [3, 4])]))
        decode.wait_for(lambda seen: seen.finished_recving or seen.failed_recving, "the pull")
        assert decode.seen.failed_recving == {"d"} and not decode.seen.finished_recving
        assert decode.seen.num_failed_transfers == 1 and not decode.seen.transfers
        assert_untouched(decode)
        assert prefill.quiet_for(0.05).finished_sending == {"p"}  # reported once, not again


def test_renewals_keep_a_hold_alive_past_its_lease():
    import torch

    lease = 0.8
    with engines({"filled": True, "lease_seconds": lease}, {"filled": False}) as (prefill, decode):
        prefill.agent.submit(TransferWork(holds=[("p", [4], token_of("p"))]))
        remote = prefill.remote("p", [4], lease_seconds=lease)
        decode.agent.submit(TransferWork(tracks=[("d", remote)]))  # queued: renewed every lease / 3

        seen = prefill.quiet_for(2.2 * lease)

        assert not seen.finished_sending and seen.num_expired_leases == 0
        decode.agent.submit(TransferWork(loads=[load("d", remote, [0])]))
        decode.wait_for(lambda seen: seen.finished_recving or seen.failed_recving, "the pull")
        assert decode.seen.finished_recving == {"d"}
        assert torch.equal(decode.block(0), prefill.block(4))
        prefill.wait_for(lambda seen: seen.finished_sending, "the release")
        assert prefill.seen.num_expired_leases == 0


# ----- releases and cancels ---------------------------------------------------------------------


def test_a_release_for_an_unknown_or_already_released_request_is_harmless():
    with engines({"filled": True}, {"filled": False}) as (prefill, decode):
        prefill.agent.submit(TransferWork(holds=[("p", [1], token_of("p")), ("q", [2], token_of("q"))]))
        p, q = prefill.remote("p", [1]), prefill.remote("q", [2])
        # One side channel, in order: the release of "ghost" reaches prefill before the read of "p".
        decode.agent.submit(TransferWork(releases=[("x", prefill.remote("ghost", [1]))]))
        decode.agent.submit(TransferWork(loads=[load("dp", p, [5])]))
        decode.wait_for(lambda seen: seen.finished_recving or seen.failed_recving, "the pull of p")
        assert decode.seen.finished_recving == {"dp"}
        prefill.wait_for(lambda seen: seen.finished_sending, "the release of p")

        # Release p again (already released), then pull q: once q lands the second release was handled.
        decode.agent.submit(TransferWork(releases=[("y", p)]))
        decode.agent.submit(TransferWork(loads=[load("dq", q, [6])]))
        decode.wait_for(lambda seen: len(seen.finished_recving | seen.failed_recving) == 2, "the pull of q")
        assert decode.seen.finished_recving == {"dp", "dq"}
        prefill.wait_for(lambda seen: "q" in seen.finished_sending, "the release of q")
        assert prefill.seen.finished_sending == {"p", "q"}  # nothing for the ghost; p once (checked in poll)


def test_a_release_that_comes_before_its_hold_ends_the_hold_on_arrival():
    with engines({"filled": True}, {"filled": False}) as (prefill, decode):
        prefill.agent.submit(TransferWork(holds=[("q", [2], token_of("q"))]))
        decode.agent.submit(TransferWork(releases=[("x", prefill.remote("p", [1]))]))
        decode.agent.submit(TransferWork(loads=[load("dq", prefill.remote("q", [2]), [6])]))
        decode.wait_for(lambda seen: seen.finished_recving, "the pull of q (after the release of p)")
        prefill.wait_for(lambda seen: seen.finished_sending, "the release of q")

        prefill.agent.submit(TransferWork(holds=[("p", [1], token_of("p"))]))  # decode gave up on p before it was held

        prefill.wait_for(lambda seen: "p" in seen.finished_sending, "p's hold to end", timeout=1.0)
        assert prefill.seen.num_expired_leases == 0


def test_a_cancel_before_the_pull_starts_drops_the_pull_and_frees_on_prefill():
    delay = 1.0
    with engines({"filled": True}, {"filled": False, "faults": KVFaults(delay_load=delay)}) as (prefill, decode):
        prefill.agent.submit(TransferWork(holds=[("p", [1, 2], token_of("p"))]))
        remote = prefill.remote("p", [1, 2])
        start = time.monotonic()
        decode.agent.submit(TransferWork(tracks=[("d", remote)], loads=[load("d", remote, [3, 4])]))
        decode.agent.submit(TransferWork(cancels=["d"]))  # the request ended while its pull waited

        decode.wait_for(lambda seen: seen.failed_recving, "the cancel")
        assert decode.seen.failed_recving == {"d"}
        assert decode.seen.num_failed_transfers == 0  # a cancel is not a failed transfer
        prefill.wait_for(lambda seen: seen.finished_sending, "the release")
        assert prefill.seen.finished_sending == {"p"} and prefill.seen.num_expired_leases == 0

        # Past the moment the pull would have started: it never does, nothing is written.
        seen = decode.quiet_for(max(0.0, start + delay + 0.3 - time.monotonic()))
        assert not seen.finished_recving and not seen.transfers
        assert_untouched(decode)


def test_an_unhold_drops_a_hold_without_reporting_it_and_later_reads_fail():
    with engines({"filled": True}, {"filled": False}) as (prefill, decode):
        # The scheduler freed the blocks itself (hold_cancelled): the hold goes silently.
        prefill.agent.submit(TransferWork(holds=[("p", [1], token_of("p"))], unholds=["p"]))
        decode.agent.submit(TransferWork(loads=[load("d", prefill.remote("p", [1]), [2])]))
        decode.wait_for(lambda seen: seen.finished_recving or seen.failed_recving, "the pull")
        assert decode.seen.failed_recving == {"d"}
        assert_untouched(decode)
        assert not prefill.quiet_for(0.05).finished_sending


# ----- what makes a pull fail -------------------------------------------------------------------


def test_blocks_whose_generations_changed_after_the_hold_fail_the_pull():
    with engines({"filled": True}, {"filled": False}) as (prefill, decode):
        prefill.agent.submit(TransferWork(holds=[("p", [1, 2], token_of("p"))]))
        remote = prefill.remote("p", [1, 2])
        prefill.generations[2] += 1  # block 2 was freed and reused after the params were handed out

        decode.agent.submit(TransferWork(loads=[load("d", remote, [3, 4])]))

        decode.wait_for(lambda seen: seen.finished_recving or seen.failed_recving, "the pull")
        assert decode.seen.failed_recving == {"d"} and not decode.seen.finished_recving
        assert decode.seen.num_failed_transfers == 1
        assert_untouched(decode)


def test_a_peer_with_another_compat_hash_fails_the_pull_at_the_handshake():
    with engines({"filled": True, "compat": "compat-b"}, {"filled": False}) as (prefill, decode):
        prefill.agent.submit(TransferWork(holds=[("p", [1, 2], token_of("p"))]))
        remote = prefill.remote("p", [1, 2])
        decode.agent.submit(TransferWork(loads=[load("d", remote, [3, 4])]))

        decode.wait_for(lambda seen: seen.finished_recving or seen.failed_recving, "the pull")
        assert decode.seen.failed_recving == {"d"} and decode.seen.num_failed_transfers == 1
        assert_untouched(decode)
        # Nobody will read those blocks now: prefill was told to free them.
        prefill.wait_for(lambda seen: seen.finished_sending, "the release")
        assert prefill.seen.finished_sending == {"p"}


def test_a_prefill_of_another_kv_cache_dtype_is_refused_at_the_handshake_by_name(caplog):
    """P/D between KV cache dtypes is refused, not converted (their compatibility hashes differ): the log
    names both dtypes, so the fix (one --kv-cache-dtype for both pools) is plain."""
    import torch

    narrow = torch.zeros((NUM_BLOCKS, 2, 4, 16), dtype=torch.bfloat16)  # a block of the same bytes
    with engines({"filled": False, "compat": "compat-b", "kv_cache": narrow}, {"filled": False}) as (prefill, decode):
        prefill.agent.submit(TransferWork(holds=[("p", [1, 2], token_of("p"))]))
        decode.agent.submit(TransferWork(loads=[load("d", prefill.remote("p", [1, 2]), [3, 4])]))
        decode.wait_for(lambda seen: seen.failed_recving, "the refused pull")
    assert "incompatible KV cache: the remote engine stores bfloat16, this one float32" in caplog.text


# ----- the thread -------------------------------------------------------------------------------


def test_close_is_idempotent_stops_the_thread_and_frees_the_port():
    with engines({"filled": True}, {"filled": False}) as (prefill, decode):
        prefill.agent.submit(TransferWork(holds=[("p", [1], token_of("p"))]))
        decode.agent.submit(TransferWork(loads=[load("d", prefill.remote("p", [1]), [2])]))
        decode.wait_for(lambda seen: seen.finished_recving, "the pull")  # decode now has a peer socket
        port = prefill.agent.port

        for engine in (prefill, decode):
            engine.agent.close()
            assert not engine.agent._thread.is_alive()
            engine.agent.close()  # again: nothing happens, nothing raises
            assert not engine.agent._thread.is_alive()

        # The side channel's port is free again: a new agent can listen there.
        with engines({"filled": False, "side_channel_port": port}) as (again,):
            assert again.agent.port == port


# ----- defects found by these tests, fixed -------------------------------------------------------


def test_a_refused_read_still_frees_the_hold():
    with engines({"filled": True}, {"filled": False}) as (prefill, decode):
        prefill.agent.submit(TransferWork(holds=[("p", [1, 2], token_of("p"))]))
        remote = prefill.remote("p", [1, 2])
        decode.agent.submit(TransferWork(loads=[LoadSpec("d", remote, [3, 4], [1, 2], [0, 9])]))  # wrong generation
        decode.wait_for(lambda seen: seen.failed_recving, "the refused pull")

        prefill.wait_for(lambda seen: seen.finished_sending, "the hold to end", timeout=1.5)


def test_replies_from_two_prefill_engines_with_the_same_request_id_land_in_their_own_pulls():
    import torch

    with engines({"filled": True}, {"filled": True}, {"filled": False}) as (a, b, decode):
        b.kv_cache.neg_()  # B's bytes differ from A's
        # Hand-shake with both first, so the next two pulls start at once, in order.
        a.agent.submit(TransferWork(holds=[("warm-a", [0], token_of("warm-a"))]))
        b.agent.submit(TransferWork(holds=[("warm-b", [0], token_of("warm-b"))]))
        warm = [load("wa", a.remote("warm-a", [0]), [7]), load("wb", b.remote("warm-b", [0]), [6])]
        decode.agent.submit(TransferWork(loads=warm))
        decode.wait_for(lambda seen: seen.finished_recving == {"wa", "wb"}, "the warm-up pulls")

        # Only B holds "same" now; A's read waits for a hold that never comes, then fails.
        b.agent.submit(TransferWork(holds=[("same", [3], token_of("same"))]))
        loads = [load("from-a", a.remote("same", [3]), [1]), load("from-b", b.remote("same", [3]), [2])]
        decode.agent.submit(TransferWork(loads=loads))

        decode.wait_for(lambda seen: len(seen.finished_recving | seen.failed_recving) == 4, "both pulls")
        assert "from-b" in decode.seen.finished_recving and "from-a" in decode.seen.failed_recving
        assert torch.equal(decode.block(2), b.block(3))
        assert torch.equal(decode.block(1), decode.initial[1])


# ----- the tensor-parallel layout in the handshake -------------------------------------------------------


def test_head_mapping_needs_every_local_head_somewhere_on_the_remote():
    problem = head_mapping_problem
    assert problem([(0, 8)], [(0, 8)]) is None
    assert problem([(0, 8)], [(0, 4), (4, 8)]) is None  # decode TP 1 from prefill TP 2
    assert problem([(0, 4), (4, 8)], [(0, 8)]) is None  # decode TP 2 from prefill TP 1
    assert problem([(0, 2), (0, 2), (2, 4), (2, 4)], [(0, 4)]) is None  # replicated KV heads (GQA, TP 4)
    assert problem([], [(0, 4)]) is None and problem([(0, 4)], []) is None  # not said: one rank, every head
    assert "heads [4, 5, 6, 7]" in problem([(0, 8)], [(0, 4)])


def test_a_prefill_holding_too_few_heads_is_refused_at_the_handshake():
    with engines({"filled": True, "heads": [(0, 4)]}, {"filled": False, "heads": [(0, 4), (4, 8)]}) as (
        prefill,
        decode,
    ):
        prefill.agent.submit(TransferWork(holds=[("p", [1], token_of("p"))]))
        decode.agent.submit(TransferWork(loads=[load("d", prefill.remote("p", [1]), [2])]))
        decode.wait_for(lambda seen: seen.failed_recving == {"d"}, "the refused pull")
        assert_untouched(decode)
