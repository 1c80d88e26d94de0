"""KV transfer bandwidth: 1, 16 and 256 MiB of KV blocks pulled between two engine processes with
the NIXL and the TCP transports, against numpy copying the same bytes inside one process.

Each process runs pdserve's real transfer agent (the one the engines use) on a KV cache of
256 KiB blocks, allocated as the engines allocate it; the "prefill" process holds a request's
blocks, the "decode" process pulls them into its own blocks (random block ids, as blocks are
scattered in a real cache, and new ones each time, so caches are cold), checks their
generations and releases them. A pull is timed from the moment decode's agent gets the work to
the moment it reports the blocks landed, after one warm-up pull (the handshake). The baseline
copies the same kind of block sets (random, cold) between two such caches in one process with
numpy. Best of 5 each.

Then P/D between tensor-parallel sizes: 16 MiB of a model's KV (8 layers, 8 KV heads of 128, blocks of
16 tokens: 1 MiB a block) pulled from a prefill engine at TP 1 or 2 (one process per rank) into a
decode engine at TP 1 or 2 (its rank agents in this process), each decode rank reading exactly its
heads from the prefill ranks holding them; GB/s of the whole KV moved, and against the TP1->TP1 row.

Then what the side channel's protection costs, in the same run: 16 KiB and 16 MiB pulls (one 16 KiB block: the
per-pull cost of the handshake-less exchange; 64 blocks of 256 KiB: the per-byte cost) without keys, with keys,
and with keys while a stranger floods the holding engine's side channel with the costliest junk there is (fresh,
well-addressed, wrongly keyed frames of the largest size it takes, from four connections); median of 9 each.

With --plot DIR, writes DIR/kv_transfer.png. Runs in about two minutes.
Last line: {"bench": "kv_transfer", "nixl_16mib_gbps", "memcpy_16mib_gbps", "ratio", ...}.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import time

from plots import add_plot_argument, bar_chart

BLOCK_BYTES = 256 << 10
SIZES_MIB = (1, 16, 256)
NUM_BLOCKS = (max(SIZES_MIB) << 20) // BLOCK_BYTES + 16
REPEATS = 5


def _kv_cache():
    import torch

    from pdserve.worker.kv_cache import allocate_kv_memory

    kv_cache = allocate_kv_memory((NUM_BLOCKS, BLOCK_BYTES // 4), torch.float32, torch.device("cpu"))
    kv_cache.fill_(1.0)  # touch every page now, as a serving engine's cache is after warm-up
    return kv_cache


def _pull_all(transport: str) -> dict[int, float]:
    """GB/s of the best of REPEATS pulls of each size (pdserve.bench.kv_pull)."""
    from pdserve.bench.kv_pull import measure_pulls

    counts = [(size << 20) // BLOCK_BYTES for size in SIZES_MIB]
    pulls = measure_pulls(transport, counts, BLOCK_BYTES, REPEATS)
    best: dict[int, float] = {}
    for num_bytes, seconds in pulls:
        size = num_bytes >> 20
        best[size] = min(best.get(size, float("inf")), seconds)
    return {size: (size << 20) / seconds / 1e9 for size, seconds in best.items()}


# P/D between tensor-parallel sizes: a model's KV cache layout (blocks, layers, K/V, heads, tokens, dim).
TP_LAYERS, TP_HEADS, TP_BLOCK_SIZE, TP_HEAD_DIM = 8, 8, 16, 128
TP_PULL_BLOCKS = 16  # 1 MiB each (all heads): 16 MiB a pull, split over the ranks
TP_NUM_BLOCKS = 4 * TP_PULL_BLOCKS
TP_PAIRS = ((1, 1), (2, 1), (1, 2), (2, 2))


def _rank_agent(transport: str, engine_id: str, rank: int, ranges: list[tuple[int, int]]):
    import numpy as np
    import torch

    from pdserve.kvtransfer.agent import TransferAgent
    from pdserve.kvtransfer.config import KVTransferConfig
    from pdserve.worker.kv_cache import allocate_kv_memory

    heads = ranges[rank][1] - ranges[rank][0]
    shape = (TP_NUM_BLOCKS, TP_LAYERS, 2, heads, TP_BLOCK_SIZE, TP_HEAD_DIM)
    kv_cache = allocate_kv_memory(shape, torch.float32, torch.device("cpu"))
    kv_cache.fill_(1.0)
    generations = np.zeros(TP_NUM_BLOCKS, dtype=np.int64)
    config = KVTransferConfig(transport=transport, lease_seconds=60, engine_id=engine_id)
    return TransferAgent(config, kv_cache, generations, "bench", ranges, rank)


def _prefill_rank(transport: str, engine_id: str, rank: int, ranges: list[tuple[int, int]], pipe) -> None:
    from pdserve.kvtransfer.work import TransferWork

    agent = _rank_agent(transport, engine_id, rank, ranges)
    pipe.send(agent.port)
    while True:
        message = pipe.recv()
        if message is None:
            break
        agent.submit(TransferWork(holds=[message]))
        time.sleep(0.01)  # the agent registers the hold before decode asks for the blocks
        pipe.send(True)
    agent.close()


def _pull_between_tp_sizes(transport: str, prefill_tp: int, decode_tp: int) -> float:
    """GB/s of the whole KV of TP_PULL_BLOCKS blocks moved from prefill's ranks into decode's."""
    import uuid

    from pdserve.kvtransfer.layout import head_ranges
    from pdserve.kvtransfer.params import RemotePrefill, new_hold_token
    from pdserve.kvtransfer.work import LoadSpec, TransferWork

    context = multiprocessing.get_context("spawn")
    prefill_id, decode_id = uuid.uuid4().hex, uuid.uuid4().hex
    prefill_ranges, decode_ranges = head_ranges(TP_HEADS, prefill_tp), head_ranges(TP_HEADS, decode_tp)
    pipes, processes = [], []
    for rank in range(prefill_tp):
        pipe, child_pipe = context.Pipe()
        process = context.Process(
            target=_prefill_rank, args=(transport, prefill_id, rank, prefill_ranges, child_pipe), daemon=True
        )
        process.start()
        pipes.append(pipe)
        processes.append(process)
    agents = [_rank_agent(transport, decode_id, rank, decode_ranges) for rank in range(decode_tp)]
    ports = tuple(pipe.recv() for pipe in pipes)
    rng = random.Random(2)
    times = []
    try:
        for repeat in range(REPEATS + 1):  # the first pull warms up (handshakes)
            request_id = f"tp-{repeat}"
            remote_ids = rng.sample(range(TP_NUM_BLOCKS), TP_PULL_BLOCKS)
            token = new_hold_token()
            for pipe in pipes:
                pipe.send((request_id, remote_ids, token))
            for pipe in pipes:
                pipe.recv()
            generations = [0] * TP_PULL_BLOCKS
            remote = RemotePrefill(
                prefill_id, request_id, "127.0.0.1", ports[0], remote_ids, generations, 0, "", "", 60.0, ports, token
            )
            local_ids = rng.sample(range(TP_NUM_BLOCKS), TP_PULL_BLOCKS)
            spec = LoadSpec(request_id, remote, local_ids, remote_ids, generations)
            start = time.perf_counter()
            for agent in agents:
                agent.submit(TransferWork(loads=[spec]))
            waiting = set(range(decode_tp))
            while waiting:
                for rank in list(waiting):
                    output = agents[rank].collect()
                    if output is not None and (output.finished_recving or output.failed_recving):
                        assert output.finished_recving == {request_id}, output
                        waiting.discard(rank)
                time.sleep(0.0002)
            if repeat:
                times.append(time.perf_counter() - start)
    finally:
        for pipe in pipes:
            pipe.send(None)
        for process in processes:
            process.join(10)
        for agent in agents:
            agent.close()
    block_bytes = TP_LAYERS * 2 * TP_HEADS * TP_BLOCK_SIZE * TP_HEAD_DIM * 4
    return TP_PULL_BLOCKS * block_bytes / min(times) / 1e9


AUTH_SIZES = ((16 << 10, 1), (256 << 10, 64))  # (block bytes, blocks a pull)
AUTH_REPEATS = 9


def _protection_costs() -> dict[tuple[str, str, int], float]:
    """Median seconds of a pull, per (transport, setting, bytes), settings: no keys, keys, keys + flood."""
    import statistics
    import tempfile

    from pdserve.api.keys import new_bundle, write_bundle
    from pdserve.bench.kv_pull import measure_pulls

    folder = tempfile.mkdtemp(prefix="pdserve-bench-keys-")
    write_bundle(folder, new_bundle())
    found = {}
    for transport in ("tcp", "nixl"):
        for setting, keys_dir, flood in (("none", None, False), ("keys", folder, False), ("flood", folder, True)):
            for block_bytes, count in AUTH_SIZES:
                pulls = measure_pulls(transport, [count], block_bytes, AUTH_REPEATS, keys_dir=keys_dir, flood=flood)
                found[transport, setting, block_bytes * count] = statistics.median(seconds for _, seconds in pulls)
    return found


def _contiguous_memcpy() -> float:
    """For reference: one contiguous, cache-warm 16 MiB copy (the most flattering baseline)."""
    import numpy as np

    source = np.ones(16 << 20, dtype=np.uint8)
    target = np.zeros_like(source)
    times = []
    for _ in range(REPEATS * 2):
        start = time.perf_counter()
        np.copyto(target, source)
        times.append(time.perf_counter() - start)
    return (16 << 20) / min(times) / 1e9


def _memcpy() -> dict[int, float]:
    import numpy as np

    source = _kv_cache().view(-1).numpy().view(np.uint8).reshape(NUM_BLOCKS, BLOCK_BYTES)
    target = _kv_cache().view(-1).numpy().view(np.uint8).reshape(NUM_BLOCKS, BLOCK_BYTES)
    rng = random.Random(1)
    result = {}
    for size in SIZES_MIB:
        count = (size << 20) // BLOCK_BYTES
        times = []
        for _ in range(REPEATS):
            pairs = list(zip(rng.sample(range(NUM_BLOCKS), count), rng.sample(range(NUM_BLOCKS), count), strict=True))
            start = time.perf_counter()
            for local, remote in pairs:
                np.copyto(target[local], source[remote])
            times.append(time.perf_counter() - start)
        result[size] = (size << 20) / min(times) / 1e9
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_plot_argument(parser)
    args = parser.parse_args()
    memcpy = _memcpy()
    contiguous = _contiguous_memcpy()
    nixl = _pull_all("nixl")
    tcp = _pull_all("tcp")
    between = {
        (transport, pair): _pull_between_tp_sizes(transport, *pair)
        for transport in ("nixl", "tcp")
        for pair in TP_PAIRS
    }
    protection = _protection_costs()
    print(
        f"KV pull between two processes vs numpy copying the same blocks in one process; "
        f"{BLOCK_BYTES >> 10} KiB blocks, best of {REPEATS} (GB/s)"
    )
    print(f"{'size':>8} {'memcpy':>8} {'nixl':>8} {'tcp':>8} {'nixl/memcpy':>12} {'tcp/memcpy':>11}")
    for size in SIZES_MIB:
        print(
            f"{size:>5} MiB {memcpy[size]:8.2f} {nixl[size]:8.2f} {tcp[size]:8.2f} "
            f"{nixl[size] / memcpy[size]:12.2f} {tcp[size] / memcpy[size]:11.2f}"
        )
    print(
        f"one contiguous cache-warm 16 MiB numpy copy: {contiguous:.2f} GB/s (nixl at 16 MiB: "
        f"{nixl[16] / contiguous:.2f} of it)"
    )
    print(f"P/D between tensor-parallel sizes: {TP_PULL_BLOCKS} MiB of KV a pull, best of {REPEATS} (GB/s)")
    print(f"{'prefill -> decode':>18} {'nixl':>8} {'vs TP1->TP1':>12} {'tcp':>8} {'vs TP1->TP1':>12}")
    for pair in TP_PAIRS:
        nixl_tp, tcp_tp = between["nixl", pair], between["tcp", pair]
        print(
            f"{f'TP{pair[0]} -> TP{pair[1]}':>18} {nixl_tp:8.2f} {nixl_tp / between['nixl', (1, 1)]:12.2f} "
            f"{tcp_tp:8.2f} {tcp_tp / between['tcp', (1, 1)]:12.2f}"
        )
    print(f"What the side channel's protection costs a pull: median of {AUTH_REPEATS} (ms), and ratios")
    header = ("transport", "size", "no keys", "keys", "flooded", "keys/none", "flood/keys")
    print(" ".join(f"{name:>{width}}" for name, width in zip(header, (9, 8, 8, 8, 8, 10, 11), strict=True)))
    for transport in ("tcp", "nixl"):
        for block_bytes, count in AUTH_SIZES:
            size = block_bytes * count
            none, keyed, flooded = (protection[transport, setting, size] for setting in ("none", "keys", "flood"))
            print(
                f"{transport:>9} {size >> 10:>5} KiB {none * 1e3:8.2f} {keyed * 1e3:8.2f} {flooded * 1e3:8.2f} "
                f"{keyed / none:10.2f} {flooded / keyed:11.2f}"
            )
    if args.plot:
        bar_chart(
            args.plot,
            "kv_transfer",
            "KV pull between two processes vs numpy copying the same blocks (GB/s)",
            "GB/s",
            {
                f"{size} MiB": {"numpy, same blocks": memcpy[size], "NIXL": nixl[size], "TCP": tcp[size]}
                for size in SIZES_MIB
            },
        )
    print(
        json.dumps(
            {
                "bench": "kv_transfer",
                "nixl_16mib_gbps": round(nixl[16], 2),
                "memcpy_16mib_gbps": round(memcpy[16], 2),
                "ratio": round(nixl[16] / memcpy[16], 2),
                "tcp_16mib_gbps": round(tcp[16], 2),
                "nixl_256mib_gbps": round(nixl[256], 2),
                "memcpy_256mib_gbps": round(memcpy[256], 2),
                "memcpy_contiguous_16mib_gbps": round(contiguous, 2),
                **{
                    f"{transport}_p{pair[0]}_d{pair[1]}_gbps": round(gbps, 2)
                    for (transport, pair), gbps in between.items()
                },
                **{
                    f"{transport}_{setting}_{size >> 10}kib_ms": round(seconds * 1e3, 3)
                    for (transport, setting, size), seconds in protection.items()
                },
            }
        )
    )


if __name__ == "__main__":
    main()
