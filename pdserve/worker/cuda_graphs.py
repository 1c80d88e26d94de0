"""Decode steps replayed as CUDA graphs: at small and medium batch a GPU otherwise waits on Python and kernel
launches for much of a step.

Graphs are captured at start (the ``capture_graphs`` phase, after the KV cache is allocated and the model
warmed up) for a ladder of batch sizes (``--cuda-graph-sizes``; default 1, 2, 4, then every 8 up to
``max_num_seqs``, at most 256), largest first, sharing one memory pool. A decode-only step of ``b`` requests
runs the graph of the smallest captured size ``s >= b``: ``prepare_inputs`` pads the batch to ``s`` by
repeating its last request (the padding rows compute that request's token again and write the same K and V
to the same slot, so they change nothing) and writes it into the persistent input buffers, which are the
addresses the graph reads; the graph replays the forward pass; the sampler reads the real rows. Prefill and
mixed steps, larger batches, hybrid models (a padding row would update its request's linear-attention state
twice) and ``--enforce-eager`` run eagerly. The attention grid inside a graph is fixed at capture
(``triton_attention.static_partitions``), not sized from the step's longest context. KV loads of the P/D
connector and the grammar bitmask happen outside the graph, before and after it.

``DecodeGraphs.eager`` runs the same padded, fixed-grid path without capture (the CPU tests' way to check it
is token-exact); on a GPU, capture and replay are checked by ``bench/gpu_check.sh``, and nowhere else yet. Under tensor
parallelism every rank captures and replays its own graphs in step (unverified: one GPU is all the lent
machines have).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from pdserve.kernels.metadata import AttentionMetadata, InputBuffers

if TYPE_CHECKING:
    from pdserve.models.config import ModelConfig
    from pdserve.worker.kv_cache import RunnerConfig

logger = logging.getLogger(__name__)

DEFAULT_MAX_GRAPH_BATCH = 256


def default_graph_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every 8 up to ``max_num_seqs`` (at most ``DEFAULT_MAX_GRAPH_BATCH``)."""
    largest = min(max_num_seqs, DEFAULT_MAX_GRAPH_BATCH)
    return sorted({size for size in (1, 2, 4, *range(8, largest + 1, 8)) if size <= largest} | {largest})


def graph_sizes(config: RunnerConfig, model_config: ModelConfig) -> list[int]:
    """The batch sizes an engine captures (none where graphs do not apply: CPU, ``--enforce-eager``, hybrid
    models), within what one step can hold."""
    if config.device.type != "cuda" or config.enforce_eager or model_config.is_hybrid:
        return []
    largest = min(config.max_num_seqs, config.max_num_batched_tokens)
    sizes = config.cuda_graph_sizes or default_graph_sizes(config.max_num_seqs)
    return [size for size in sizes if size <= largest]


def graph_pool_estimate(activation_bytes: int, profiled_tokens: int, sizes: Sequence[int]) -> int:
    """What the graphs' memory pool will hold, for the KV cache's budget (it is sized before they are captured):
    the activations of a step at the largest graph's batch (scaled from the memory profile's, measured at
    ``profiled_tokens`` tokens: activations grow with a step's tokens) with a quarter more for the graphs'
    static outputs and the allocator's rounding. The start-up log sets the measured pool beside it."""
    if not sizes:
        return 0
    return int(activation_bytes * min(1.0, max(sizes) / profiled_tokens) * 1.25)


# (input ids, positions, metadata) -> the forward pass's hidden states
Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


class DecodeGraphs:
    """Captured decode steps by batch size, and how a step finds and pads to its size."""

    def __init__(self, sizes: Sequence[int], partitions: tuple[int, int] | None, forward: Forward) -> None:
        self.sizes = sorted(sizes)
        self.partitions = partitions  # the attention grid every step through here runs with
        self._forward = forward
        self._replays: dict[int, Callable[[], torch.Tensor]] = {}

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def size_for(self, batch: int) -> int | None:
        """The captured size a decode step of ``batch`` requests pads to (None: larger than any)."""
        index = bisect.bisect_left(self.sizes, batch)
        return self.sizes[index] if index < len(self.sizes) else None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """The hidden states of every row of a padded decode step whose inputs ``prepare_inputs`` wrote into the
        buffers: its graph's replay (which reads the buffers, not these views), or without capture (``eager``)
        the forward pass over them."""
        replay = self._replays.get(len(input_ids))
        return replay() if replay is not None else self._forward(input_ids, positions, metadata)

    @classmethod
    def capture(
        cls,
        forward: Forward,
        buffers: InputBuffers,
        sizes: Sequence[int],
        partitions: tuple[int, int],
        device: torch.device,
    ) -> DecodeGraphs:
        """Capture ``forward`` over a decode step of each size, largest first, in one memory pool. Each
        capture runs a step of that size once first (kernels compile, the allocator settles), over block 0,
        which no request owns yet."""
        graphs = cls(sizes, partitions, forward)
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(graphs.sizes):
            input_ids, positions, metadata = buffers.prepare([[0]] * size, [1] * size, [0] * size, [[0]] * size)
            metadata.partitions = partitions
            forward(input_ids, positions, metadata)
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = forward(input_ids, positions, metadata)
            graphs._replays[size] = _replayer(graph, hidden)
        torch.cuda.synchronize(device)
        return graphs

    @classmethod
    def eager(cls, forward: Forward, sizes: Sequence[int], partitions: tuple[int, int] | None = None) -> DecodeGraphs:
        """The graphs' path without capture: steps are padded to the sizes and run with the fixed attention
        grid, eagerly (the CPU tests' way to check that path is token-exact; nothing else runs it)."""
        return cls(sizes, partitions, forward)


def _replayer(graph: torch.cuda.CUDAGraph, hidden: torch.Tensor) -> Callable[[], torch.Tensor]:
    def replay() -> torch.Tensor:
        graph.replay()
        return hidden

    return replay
