"""Tensor-parallel KV layouts across engines: which KV heads each rank of an engine holds, what each
rank's transfer agent is called, and which prefill rank each decode rank reads each of its heads from.

An engine at TP n runs one transfer agent per rank (each next to its rank's KV cache, on a side channel
of its own). Rank r holds the KV heads ``TensorParallel(r, n).kv_head_range``: an even share, or one
replicated head when there are fewer KV heads than ranks. A decode rank reads exactly the heads it
holds, each once, from a prefill rank holding it (``read_plan``); a head replicated on several prefill
ranks is read from one of them, spread over the decode ranks so no prefill rank serves them all.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.models.parallel import TensorParallel


def rank_agent_id(engine_id: str, rank: int) -> str:
    """The transfer agent of rank ``rank`` of engine ``engine_id`` (its NIXL name and side-channel
    sender): rank 0 is the engine id itself, so a TP-1 engine is named as it always was."""
    return engine_id if rank == 0 else f"{engine_id}-rank{rank}"


def head_ranges(num_kv_heads: int, tp_size: int) -> list[tuple[int, int]]:
    """Per rank of an engine at TP ``tp_size``, the [start, end) of the model's KV heads it holds."""
    return [TensorParallel(rank, tp_size).kv_head_range(num_kv_heads) for rank in range(tp_size)]


def num_kv_heads_of(ranges: list[tuple[int, int]]) -> int:
    """The model's KV-head count, from an engine's per-rank ranges (its ranks hold every head)."""
    return max(end for _, end in ranges)


@dataclass(frozen=True, slots=True)
class Segment:
    """KV heads [start, end) that one decode rank reads from prefill rank ``source_rank``."""

    source_rank: int
    start: int
    end: int


def read_plan(heads: tuple[int, int], remote: list[tuple[int, int]], reader_rank: int) -> list[Segment]:
    """Where a decode rank holding ``heads`` reads each of them from, given the prefill engine's
    per-rank ``remote`` ranges: one segment per prefill rank read, each head exactly once. A head held
    by k prefill ranks is read from the (reader_rank mod k)-th of them. ValueError if a head is held
    by no prefill rank (the handshake's ``head_mapping_problem`` says so first)."""
    sources: dict[int, list[int]] = {}
    for head in range(*heads):
        holders = [rank for rank, (start, end) in enumerate(remote) if start <= head < end]
        if not holders:
            raise ValueError(f"no prefill rank holds KV head {head}")
        sources.setdefault(holders[reader_rank % len(holders)], []).append(head)
    plan = []
    for rank, read in sorted(sources.items()):
        if read != list(range(read[0], read[-1] + 1)):  # rank ranges are contiguous, so never
            raise ValueError(f"KV heads {read} of prefill rank {rank} are not contiguous")
        plan.append(Segment(rank, read[0], read[-1] + 1))
    return plan


def head_mapping_problem(local: list[tuple[int, int]], remote: list[tuple[int, int]]) -> str | None:
    """Why KV heads held as ``remote`` (per rank [start, end)) cannot fill ``local``'s ranks, or None.
    Either side not saying its layout (an empty list) is taken as one rank holding every head."""
    if not local or not remote:
        return None
    covered: set[int] = set()
    for start, end in remote:
        covered.update(range(start, end))
    missing = sorted(head for start, end in local for head in range(start, end) if head not in covered)
    if missing:
        return f"the remote engine holds no KV for heads {missing[:8]} that this engine's ranks need"
    return None
