"""Timed KV pulls between two processes with pdserve's real transfer agent (NIXL or TCP).

A "prefill" process holds blocks of its KV cache for a request; this process pulls them into its
own cache, as a decode engine does, and times each pull from the moment its agent gets the work
to the moment it reports the blocks landed. Block ids are random (blocks are scattered in a real
cache) and new each time. The first pull is a warm-up (the handshake). Used by
`bench/kv_transfer.py` and by `pdserve profile` (the planner's transfer model).

With ``flood``, a third process floods the holder's side channel all the while: fresh, well-addressed, wrongly
keyed frames of the largest size it takes (each costs the holder's agent an HMAC when it has keys), as fast as
four connections carry them; what that costs a pull is the flooded time against the unflooded one.
"""

from __future__ import annotations

import multiprocessing
import random
import time
from collections.abc import Sequence
from typing import Any


def _kv_cache(num_blocks: int, block_bytes: int) -> Any:
    import torch

    from pdserve.worker.kv_cache import allocate_kv_memory

    kv_cache = allocate_kv_memory((num_blocks, block_bytes // 4), torch.float32, torch.device("cpu"))
    kv_cache.fill_(1.0)  # touch every page now, as a serving engine's cache is after warm-up
    return kv_cache


def _agent(transport: str, num_blocks: int, block_bytes: int, keys_dir: str | None) -> tuple[Any, Any]:
    import numpy as np

    from pdserve.kvtransfer.agent import TransferAgent
    from pdserve.kvtransfer.config import KVTransferConfig

    kv_cache = _kv_cache(num_blocks, block_bytes)
    generations = np.zeros(num_blocks, dtype=np.int64)
    config = KVTransferConfig(transport=transport, lease_seconds=60, keys_dir=keys_dir)
    return TransferAgent(config, kv_cache, generations, "bench"), generations


def _holder(transport: str, num_blocks: int, block_bytes: int, keys_dir: str | None, pipe: Any) -> None:
    """The prefill side: holds the blocks it is told to, reports their generations."""
    from pdserve.kvtransfer.work import TransferWork

    agent, generations = _agent(transport, num_blocks, block_bytes, keys_dir)
    pipe.send((agent.config.engine_id, agent.port))
    while True:
        message = pipe.recv()
        if message is None:
            break
        request_id, block_ids, token = message
        agent.submit(TransferWork(holds=[(request_id, block_ids, token)]))
        time.sleep(0.01)  # the agent registers the hold before decode asks for the blocks
        pipe.send(generations[block_ids].tolist())
    agent.close()


def measure_pulls(
    transport: str,
    block_counts: Sequence[int],
    block_bytes: int,
    repeats: int = 3,
    seed: int = 0,
    keys_dir: str | None = None,
    flood: bool = False,
) -> list[tuple[int, float]]:
    """(bytes, seconds) of `repeats` pulls of each block count (after one warm-up pull); ``keys_dir``: both
    agents seal the side channel with its engine.key; ``flood``: a stranger floods the holder's side channel."""
    from pdserve.bench.flood import flood_until
    from pdserve.kvtransfer.agent import max_request_bytes
    from pdserve.kvtransfer.params import RemotePrefill, new_hold_token
    from pdserve.kvtransfer.work import LoadSpec, TransferWork

    num_blocks = 2 * max(block_counts) + 16
    context = multiprocessing.get_context("spawn")
    pipe, child_pipe = context.Pipe()
    holder = context.Process(
        target=_holder, args=(transport, num_blocks, block_bytes, keys_dir, child_pipe), daemon=True
    )
    holder.start()
    agent, _ = _agent(transport, num_blocks, block_bytes, keys_dir)
    engine_id, port = pipe.recv()
    stop = context.Event()
    flooder = None
    if flood:
        targets = [(f"tcp://127.0.0.1:{port}", engine_id)]
        flooder = context.Process(target=flood_until, args=(targets, max_request_bytes(num_blocks), stop), daemon=True)
        flooder.start()
        time.sleep(0.5)  # under way before the first pull
    rng = random.Random(seed)
    found: list[tuple[int, float]] = []
    try:
        for index, count in enumerate([block_counts[0], *(c for c in block_counts for _ in range(repeats))]):
            request_id = f"pull-{index}"
            remote_ids = rng.sample(range(num_blocks), count)
            token = new_hold_token()
            pipe.send((request_id, remote_ids, token))
            generations = pipe.recv()
            remote = RemotePrefill(
                engine_id, request_id, "127.0.0.1", port, remote_ids, generations, 0, "", "", 60.0, hold_token=token
            )
            local_ids = rng.sample(range(num_blocks), count)
            start = time.perf_counter()
            agent.submit(TransferWork(loads=[LoadSpec(request_id, remote, local_ids, remote_ids, generations)]))
            while True:
                output = agent.collect()
                if output is not None and (output.finished_recving or output.failed_recving):
                    if output.finished_recving != {request_id}:
                        raise RuntimeError(f"pull {request_id} failed: {output}")
                    break
                time.sleep(0.0002)
            if index:  # not the warm-up
                found.append((count * block_bytes, time.perf_counter() - start))
    finally:
        stop.set()
        if flooder is not None:
            flooder.join(10)
        pipe.send(None)
        holder.join(10)
        agent.close()
    return found
