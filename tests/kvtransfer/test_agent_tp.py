"""Transfer agents of engines at different tensor-parallel sizes, in this process: one real agent per
rank over a cache of the real layout (blocks, layers, K/V, KV heads, tokens, head dim), on 127.0.0.1
over TCP and NIXL.

Each decode rank must end up with exactly its own KV heads of the held blocks, read from the prefill
ranks that hold them, each head once; a prefill rank's hold ends only once every decode rank released
it (one may still read while another is done). Every wait is a bounded poll, every agent is closed.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import numpy as np
import pytest

from pdserve.kvtransfer.aggregate import RankReports
from pdserve.kvtransfer.base import KVConnectorOutput
from pdserve.kvtransfer.layout import head_ranges, read_plan
from pdserve.kvtransfer.params import RemotePrefill
from pdserve.kvtransfer.work import LoadSpec, TransferWork
from tests.kvtransfer.agents import COMPAT, Engine, token_of

NUM_BLOCKS, LAYERS, BLOCK_SIZE, HEAD_DIM = 6, 2, 4, 8


def _model_kv(num_heads: int):
    """Every block's KV of every head, all values distinct and non-zero: [blocks, layers, 2, heads, tokens, dim]."""
    import torch

    shape = (NUM_BLOCKS, LAYERS, 2, num_heads, BLOCK_SIZE, HEAD_DIM)
    return torch.arange(1, np.prod(shape) + 1, dtype=torch.float32).reshape(shape)


@contextmanager
def engine(num_heads: int, tp: int, transport: str, filled: bool) -> Iterator[list[Engine]]:
    """An engine's rank agents: one engine id, one generation array, each rank's slice of the KV."""
    import torch

    ranges = head_ranges(num_heads, tp)
    engine_id = uuid.uuid4().hex
    generations = np.zeros(NUM_BLOCKS, dtype=np.int64)
    kv = _model_kv(num_heads)
    ranks: list[Engine] = []
    try:
        for rank, (start, end) in enumerate(ranges):
            shape = (NUM_BLOCKS, LAYERS, 2, end - start, BLOCK_SIZE, HEAD_DIM)
            cache = kv[:, :, :, start:end].contiguous() if filled else torch.zeros(shape)
            ranks.append(
                Engine(
                    filled=filled,
                    heads=ranges,
                    kv_cache=cache,
                    generations=generations,
                    rank=rank,
                    engine_id=engine_id,
                    transport=transport,
                )
            )
        yield ranks
    finally:
        for rank_engine in ranks:
            rank_engine.agent.close()


def _remote(prefill: list[Engine], request_id: str, block_ids: list[int]) -> RemotePrefill:
    ports = tuple(rank.agent.port for rank in prefill)
    return RemotePrefill(
        engine_id=prefill[0].config.engine_id,
        request_id=request_id,
        host="127.0.0.1",
        port=ports[0],
        block_ids=block_ids,
        generations=prefill[0].generations[block_ids].tolist(),
        num_tokens=BLOCK_SIZE * len(block_ids),
        prompt_hash="",
        compat_hash=COMPAT,
        lease_seconds=30.0,
        hold_token=token_of(request_id),
        ports=ports,
    )


LAYOUTS = [
    pytest.param(4, 2, 1, id="P-TP2-to-D-TP1"),
    pytest.param(4, 1, 2, id="P-TP1-to-D-TP2"),
    pytest.param(4, 2, 2, id="P-TP2-to-D-TP2"),
    pytest.param(4, 4, 2, id="P-TP4-to-D-TP2"),
    pytest.param(1, 2, 2, id="one-KV-head-P-TP2-to-D-TP2"),
]


@pytest.mark.parametrize("transport", ["tcp", "nixl"])
@pytest.mark.parametrize(("num_heads", "prefill_tp", "decode_tp"), LAYOUTS)
def test_each_decode_rank_gets_exactly_its_heads_and_prefill_frees_once_every_rank_released(
    num_heads, prefill_tp, decode_tp, transport
):
    import torch

    held, local = [1, 4], [5, 0]
    with ExitStack() as stack:
        prefill = stack.enter_context(engine(num_heads, prefill_tp, transport, filled=True))
        decode = stack.enter_context(engine(num_heads, decode_tp, transport, filled=False))
        prefill[0].generations[:] = np.arange(NUM_BLOCKS) + 7
        for rank in prefill:
            rank.agent.submit(TransferWork(holds=[("p", held, token_of("p"))]))
        remote = _remote(prefill, "p", held)
        spec = LoadSpec("d", remote, local, held, remote.generations)

        # The first decode rank pulls and releases; with more decode ranks the holds stay.
        decode[0].agent.submit(TransferWork(loads=[spec]))
        decode[0].wait_for(lambda seen: seen.finished_recving or seen.failed_recving, "rank 0's pull")
        if decode_tp > 1:
            assert not any(rank.quiet_for(0.3).finished_sending for rank in prefill)
        for rank in decode[1:]:
            rank.agent.submit(TransferWork(loads=[spec]))
            rank.wait_for(lambda seen: seen.finished_recving or seen.failed_recving, "the pull")

        full = _model_kv(num_heads)
        slice_bytes = [
            LAYERS * 2 * (end - start) * BLOCK_SIZE * HEAD_DIM * 4 for start, end in head_ranges(num_heads, decode_tp)
        ]
        for rank, (start, end) in zip(decode, head_ranges(num_heads, decode_tp), strict=True):
            assert rank.seen.finished_recving == {"d"} and not rank.seen.failed_recving
            [(num_bytes, _)] = rank.seen.transfers  # one transfer report per rank, for its heads only
            assert num_bytes == len(held) * slice_bytes[decode.index(rank)]
            for local_block, held_block in zip(local, held, strict=True):
                assert torch.equal(rank.kv_cache[local_block], full[held_block, :, :, start:end])
            untouched = [b for b in range(NUM_BLOCKS) if b not in local]
            assert torch.equal(rank.kv_cache[untouched], rank.initial[untouched])
        for rank in prefill:  # every prefill rank's hold ends, once
            rank.wait_for(lambda seen: seen.finished_sending, "the hold's end")
            assert rank.seen.finished_sending == {"p"} and rank.seen.num_expired_leases == 0
            assert torch.equal(rank.kv_cache, rank.initial)


def test_a_head_is_read_once_from_one_of_the_ranks_holding_it():
    # One KV head on both prefill ranks: each decode rank reads it from another prefill rank.
    assert read_plan((0, 1), [(0, 1), (0, 1)], 0)[0].source_rank == 0
    assert read_plan((0, 1), [(0, 1), (0, 1)], 1)[0].source_rank == 1
    # Decode TP 1 from prefill TP 4 with two KV heads (each replicated twice): two reads, not four.
    plan = read_plan((0, 2), head_ranges(2, 4), 0)
    assert [(s.source_rank, s.start, s.end) for s in plan] == [(0, 0, 1), (2, 1, 2)]
    # Decode TP 2 from prefill TP 1: each reads its half from the one rank.
    assert [(s.source_rank, s.start, s.end) for s in read_plan((2, 4), [(0, 4)], 1)] == [(0, 2, 4)]
    with pytest.raises(ValueError, match="head 3"):
        read_plan((2, 4), [(0, 3)], 0)


def test_a_failed_rank_fails_the_load_at_once_and_its_blocks_stay_quarantined_until_every_rank_ended():
    reports = RankReports(2)
    assert reports.join([KVConnectorOutput(finished_recving={"a"}), None]) is None  # rank 1 still pulls
    joined = reports.join([None, KVConnectorOutput(finished_recving={"a"})])
    assert joined is not None and joined.finished_recving == {"a"}

    # Rank 0 fails while rank 1 still writes: failed in flight now, failed once rank 1 ended.
    joined = reports.join([KVConnectorOutput(failed_recving={"b"}), None])
    assert joined is not None and joined.failed_recving_in_flight == {"b"} and not joined.failed_recving
    joined = reports.join([None, KVConnectorOutput(finished_recving={"b"})])
    assert joined is not None and joined.failed_recving == {"b"} and not joined.finished_recving

    # A read that may still write on rank 1 keeps the blocks quarantined until it drained.
    reports.join([KVConnectorOutput(finished_recving={"c"}), KVConnectorOutput(failed_recving_in_flight={"c"})])
    joined = reports.join([None, KVConnectorOutput(failed_recving={"c"})])
    assert joined is not None and joined.failed_recving == {"c"}

    # Held blocks are finished sending once both ranks' holds ended; counters add up.
    joined = reports.join([KVConnectorOutput(finished_sending={"h"}, num_expired_leases=1), None])
    assert joined is not None and not joined.finished_sending and joined.num_expired_leases == 1
    joined = reports.join([None, KVConnectorOutput(finished_sending={"h"})])
    assert joined is not None and joined.finished_sending == {"h"}
