"""ModelRunner: owns one device's model, KV-cache tensors, sampler and the KV connector's worker
side; runs one scheduled step (a forward over every scheduled token, then sampling).

Under tensor parallelism every rank runs the same steps on its share of the model (its heads, its
KV heads' cache); the logits come whole to every rank, so each samples the same tokens (seeded
generators agree) and rank 0's answer is the one the core reads.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.kernels.cpu_kernels import cpu_ops
from pdserve.kernels.metadata import AttentionMetadata, InputBuffers
from pdserve.kvtransfer.base import KVConnectorWorker
from pdserve.models.config import ModelConfig
from pdserve.models.dtype import dtype_name
from pdserve.models.loader import load_model
from pdserve.models.parallel import TensorParallel, rank_config
from pdserve.worker.cpu_budget import ThreadGovernor
from pdserve.worker.cuda_graphs import DecodeGraphs, graph_sizes
from pdserve.worker.interface import NO_TOKEN, ModelRunnerOutput, ScheduledRequest, SchedulerOutput, TokenLogprobs
from pdserve.worker.kv_cache import (
    CacheSize,
    RunnerConfig,
    allocate_kv_cache,
    cache_size_for,
    layer_caches,
    state_views,
)
from pdserve.worker.sampler import Sampler, logprob_entries
from pdserve.worker.startup import StartupPhases

logger = logging.getLogger(__name__)


def retain_freed_memory() -> None:
    """Keep freed memory in the process heap (glibc malloc) instead of returning it to the OS.

    Every forward pass allocates and frees activations of several MB. By default glibc serves those
    with fresh mmaps and unmaps them on free, so each op pays page faults on zeroed pages: a 2048-
    token prefill step spent about a fifth of its time there. Raising the mmap and trim thresholds
    (what tcmalloc/jemalloc do by design) makes the memory get reused instead. No-op off glibc.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    libc.mallopt(m_mmap_threshold, 1 << 30)
    libc.mallopt(m_trim_threshold, 1 << 34)
    libc.mallopt(m_top_pad, 64 << 20)


@dataclass
class StepInputs:
    """What ``prepare_inputs`` hands the other two stages."""

    input_ids: torch.Tensor  # [num_tokens], a view of the persistent buffers (as are the next two)
    positions: torch.Tensor  # [num_tokens]
    metadata: AttentionMetadata
    sample_rows: list[int]  # the output row each sampling request's token comes from
    sample_requests: list[int]  # which request (index in the step) samples from each of those rows
    prompt_rows: list[tuple[int, int, int, int]]  # prompt logprobs: (request index, first row, position, count)
    graph_size: int | None = None  # a decode step padded to this captured size (``worker.cuda_graphs``)


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        config: RunnerConfig,
        make_kv_connector: Callable[[torch.Tensor], KVConnectorWorker] | None = None,
    ) -> None:
        """Load the weights, size and allocate the KV cache, then (P/D) build the KV connector's
        worker side over that cache with ``make_kv_connector``."""
        self.model_config = model_config
        self.config = config
        self.device = config.device
        self.block_size = config.block_size
        self.tp = TensorParallel(config.tp_rank, config.tp_size)
        self.startup = StartupPhases()
        on_cpu = self.device.type == "cpu"
        if on_cpu and config.cpu_threads is not None:  # set here: a worker process has its own OpenMP pool
            torch.set_num_threads(config.cpu_threads)
        with self.startup.phase("load_weights"):
            self.model = load_model(
                Path(config.model), model_config, config.dtype, config.device, config.max_model_len, self.tp
            )
            if on_cpu:
                retain_freed_memory()  # after loading: the loader's transient buffers go back to the OS
                # Build (or load) the fused CPU kernels now, not inside the first request.
                if config.dtype == torch.float32 and cpu_ops() is not None:
                    self.model.pack_for_cpu()
        # The KV cache holds this rank's KV heads: sized and shaped from its share of the model.
        self.rank_model_config = rank_config(model_config, self.tp)
        self.sampler = Sampler(model_config.vocab_size, config.device)
        with self.startup.phase("profile_memory"):
            size = cache_size_for(self.model, self.rank_model_config, config)
            num_blocks, num_slots = size.num_blocks, size.num_state_slots
            if self.tp.size > 1:  # every rank holds the same block and slot ids: the smallest budget decides
                agreed = torch.tensor([num_blocks, num_slots])
                torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN)
                num_blocks, num_slots = (int(value) for value in agreed.tolist())
        self.num_blocks = num_blocks
        # The pool's blocks, then (hybrid models) the state slots' rows: one tensor, one registration.
        self.cache_size = CacheSize(num_blocks, num_slots, size.rows_per_state_slot)
        with self.startup.phase("allocate_kv_cache"):
            self.kv_cache = allocate_kv_cache(
                self.rank_model_config, self.cache_size.num_rows, self.block_size, config.kv_dtype, config.device
            )
            self.state_cache = state_views(self.rank_model_config, self.kv_cache, self.cache_size, config.dtype)
            self.layer_caches = layer_caches(self.rank_model_config, self.kv_cache, self.state_cache)
            self.kv_connector = make_kv_connector(self.kv_cache) if make_kv_connector is not None else None
        # Sized for the largest step the scheduler issues, with a block of slack past max_model_len.
        self.inputs = InputBuffers(
            config.max_num_batched_tokens,
            config.max_num_seqs,
            config.max_model_len + config.block_size,
            config.block_size,
            config.device,
        )
        with self.startup.phase("warm_up"):
            self._warm_up()
        self.graphs: DecodeGraphs | None = None
        sizes = graph_sizes(config, model_config)
        if sizes:
            with self.startup.phase("capture_graphs"):
                self.graphs = self._capture_graphs(sizes)
        self.threads = (
            ThreadGovernor(torch.get_num_threads(), torch.set_num_threads)
            if self.device.type == "cpu" and config.follow_contention
            else None
        )

    @torch.inference_mode()
    def _warm_up(self) -> None:
        """One small step straight through the model: a prefill chunk of two blocks and a one-token decode,
        in the cache's first blocks (and state slots), which no request owns yet. Whatever it writes there is
        overwritten before it is read: a block's slots are written before attention reads them, and a
        request's state slot is zeroed when it starts."""
        block_size = self.block_size
        prefill = min(2 * block_size, self.config.max_num_batched_tokens - 1, self.config.max_model_len)
        blocks_needed = -(-prefill // block_size) + 1
        if prefill < 2 or self.num_blocks < blocks_needed or self.config.max_num_seqs < 2:
            return
        slots = None
        if self.model_config.is_hybrid:
            if self.cache_size.num_state_slots < 2:
                return
            slots = [0, 1]
        input_ids, positions, metadata = self.inputs.prepare(
            [[0] * prefill, [0]], [prefill, 1], [0, 0], [list(range(blocks_needed - 1)), [blocks_needed - 1]], slots
        )
        hidden = self._forward(input_ids, positions, metadata)
        self.model.compute_logits(hidden[[prefill - 1, prefill]])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def _capture_graphs(self, sizes: list[int]) -> DecodeGraphs:
        from pdserve.kernels.triton_attention import static_partitions  # imports triton: GPU only

        reserved = torch.cuda.memory_reserved(self.device)
        graphs = DecodeGraphs.capture(
            self._forward, self.inputs, sizes, static_partitions(self.inputs.max_blocks), self.device
        )
        logger.info(
            "CUDA graphs: decode steps of %d batch sizes (%s); their pool took %.0f MiB",
            len(sizes),
            ", ".join(map(str, sizes)),
            (torch.cuda.memory_reserved(self.device) - reserved) / 2**20,
        )
        return graphs

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, self.layer_caches, metadata)

    @property
    def bytes_per_block(self) -> int:
        """Of this rank's KV cache."""
        return self.block_size * self.rank_model_config.kv_bytes_per_token(self.config.kv_dtype)

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput[ScheduledRequest]) -> ModelRunnerOutput:
        """One step, in three stages: ``prepare_inputs`` (into the persistent buffers), ``run_model``,
        ``sample``."""
        if self.threads is not None:
            self.threads.tick()
        agent = self.kv_connector
        if agent is not None and scheduler_output.kv_connector_metadata is not None:
            agent.submit(scheduler_output.kv_connector_metadata)
        threads = self.threads.threads if self.threads is not None else None
        if not scheduler_output.requests:
            return ModelRunnerOutput(
                [], kv_connector_output=agent.collect() if agent is not None else None, compute_threads=threads
            )
        inputs = self.prepare_inputs(scheduler_output)
        hidden = self.run_model(inputs, scheduler_output.state_restores)
        output = self.sample(hidden, inputs, scheduler_output)
        output.kv_connector_output = agent.collect() if agent is not None else None
        output.compute_threads = threads
        return output

    def prepare_inputs(self, scheduler_output: SchedulerOutput[ScheduledRequest]) -> StepInputs:
        """The step's token ids, positions and attention metadata, written into the persistent buffers; and
        which rows of the output each request samples from (and, asking for them, reads prompt logprobs of)."""
        requests = scheduler_output.requests
        slots = scheduler_output.state_slots
        if slots is not None:
            self._zero_fresh_states(slots, scheduler_output.start_positions)
        token_ids = [request.all_token_ids for request in requests]
        counts, starts = scheduler_output.num_scheduled_tokens, scheduler_output.start_positions
        block_ids = scheduler_output.block_ids
        graph_size = None
        # Never a hybrid model's step: a padding row would update its request's linear-attention state twice.
        if self.graphs is not None and slots is None and scheduler_output.total_num_scheduled_tokens == len(requests):
            graph_size = self.graphs.size_for(len(requests))
        if graph_size is not None:  # a decode step a graph runs: padded with copies of its last request
            padding = graph_size - len(requests)
            token_ids = [*token_ids, *[token_ids[-1]] * padding]
            counts, starts = [*counts, *[1] * padding], [*starts, *[starts[-1]] * padding]
            block_ids = [*block_ids, *[block_ids[-1]] * padding]
        input_ids, positions, metadata = self.inputs.prepare(token_ids, counts, starts, block_ids, slots)
        if graph_size is not None:
            assert self.graphs is not None
            metadata.partitions = self.graphs.partitions
        sample_rows: list[int] = []  # batch token index whose logits give each sampled request's token
        sample_requests: list[int] = []
        prompt_rows: list[tuple[int, int, int, int]] = []  # (request index, first row, first position, count)
        for index, (request, num_new, start) in enumerate(
            zip(requests, scheduler_output.num_scheduled_tokens, scheduler_output.start_positions, strict=True)
        ):
            end = start + num_new
            if end == request.num_tokens:
                sample_rows.append(metadata.query_start_loc[index + 1] - 1)
                sample_requests.append(index)
            if request.sampling_params.prompt_logprobs is not None and start < request.num_prompt_tokens - 1:
                count = min(end, request.num_prompt_tokens - 1) - start
                prompt_rows.append((index, metadata.query_start_loc[index], start, count))
        return StepInputs(input_ids, positions, metadata, sample_rows, sample_requests, prompt_rows, graph_size)

    def run_model(self, inputs: StepInputs, state_restores: list[int] | None = None) -> torch.Tensor:
        """The forward pass over the step's tokens: their last hidden states. ``state_restores``: state
        slots (hybrid models) the step must leave as it found them."""
        kept = self._keep_states(state_restores) if state_restores else None
        if inputs.graph_size is not None and self.graphs is not None:
            hidden = self.graphs.run(inputs.input_ids, inputs.positions, inputs.metadata)
        else:
            hidden = self._forward(inputs.input_ids, inputs.positions, inputs.metadata)
        if kept is not None:
            self._restore_states(*kept)
        return hidden

    def sample(
        self, hidden: torch.Tensor, inputs: StepInputs, scheduler_output: SchedulerOutput[ScheduledRequest]
    ) -> ModelRunnerOutput:
        """The sampled token of each request at the end of its tokens (NO_TOKEN for the others, mid-prompt),
        under the step's grammar bitmask where it has one; logprobs and prompt logprobs where asked for."""
        requests = scheduler_output.requests
        sample_requests = inputs.sample_requests
        sampled = [NO_TOKEN] * len(requests)
        logprobs: list[TokenLogprobs | None] | None = None
        if inputs.sample_rows:
            logits = self.model.compute_logits(hidden[inputs.sample_rows]).float()
            grammar = None
            step_grammar = scheduler_output.grammar
            if step_grammar is not None:  # its rows, as rows of these logits
                row_of = {index: row for row, index in enumerate(sample_requests)}
                grammar = ([row_of[index] for index in step_grammar.rows], step_grammar.bitmask())
            token_ids, row_logprobs = self.sampler.sample(logits, [requests[i] for i in sample_requests], grammar)
            for index, token_id in zip(sample_requests, token_ids, strict=True):
                sampled[index] = token_id
            if row_logprobs is not None:
                logprobs = [None] * len(requests)
                for index, entry in zip(sample_requests, row_logprobs, strict=True):
                    logprobs[index] = entry
        prompt_rows = inputs.prompt_rows
        prompt_logprobs = self._prompt_logprobs(hidden, requests, prompt_rows) if prompt_rows else None
        return ModelRunnerOutput(sampled, logprobs=logprobs, prompt_logprobs=prompt_logprobs)

    def _zero_fresh_states(self, slots: list[int], start_positions: list[int]) -> None:
        """Zero the state slots of requests that start now (hybrid models)."""
        fresh = [slot for slot, start in zip(slots, start_positions, strict=True) if start == 0]
        if fresh:
            index = torch.tensor(fresh, dtype=torch.int64, device=self.device)
            for conv, recurrent in self.state_cache:
                conv.index_fill_(0, index, 0.0)
                recurrent.index_fill_(0, index, 0.0)

    def _keep_states(self, slots: list[int]) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Copies of these slots' states, taken before the forward pass that ``_restore_states`` undoes."""
        index = torch.tensor(slots, dtype=torch.int64, device=self.device)
        return index, [(conv[index], recurrent[index]) for conv, recurrent in self.state_cache]

    def _restore_states(self, index: torch.Tensor, kept: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for (conv, recurrent), (conv_kept, recurrent_kept) in zip(self.state_cache, kept, strict=True):
            conv[index] = conv_kept
            recurrent[index] = recurrent_kept

    def close(self) -> None:
        if self.kv_connector is not None:
            self.kv_connector.close()

    def _prompt_logprobs(
        self, hidden: torch.Tensor, requests: Sequence[ScheduledRequest], prompt_rows: list[tuple[int, int, int, int]]
    ) -> dict[str, tuple[int, list[TokenLogprobs]]]:
        result = {}
        for index, first_row, first_position, count in prompt_rows:
            request = requests[index]
            logits = self.model.compute_logits(hidden[first_row : first_row + count]).float()
            targets = request.prompt_token_ids[first_position + 1 : first_position + 1 + count]
            entries = logprob_entries(
                torch.log_softmax(logits, dim=-1), targets, [request.sampling_params.prompt_logprobs or 0] * count
            )
            result[request.request_id] = (first_position, entries)
        return result

    def describe(self) -> str:
        tokens = self.num_blocks * self.block_size
        layout = ""
        if self.tp.size > 1:
            config, kv_start, kv_end = self.rank_model_config, *self.tp.kv_head_range(self.model_config.num_kv_heads)
            layout = (
                f"tensor parallel {self.tp.size}: per rank {config.num_heads} attention heads, KV heads "
                f"[{kv_start}, {kv_end}) of {self.model_config.num_kv_heads}, {config.intermediate_size} MLP features; "
            )
        state = ""
        num_slots = self.cache_size.num_state_slots
        if num_slots:
            slot_bytes = self.cache_size.rows_per_state_slot * self.bytes_per_block
            size = f"{slot_bytes / 2**20:.2f} MiB" if slot_bytes >= 2**20 else f"{slot_bytes / 2**10:.1f} KiB"
            state = (
                f"linear-attention state: {num_slots} slots of {size} "
                f"({len(self.model_config.linear_layers)} layers; one per running request); "
            )
        return (
            f"{layout}{state}KV cache: {self.num_blocks} blocks of {self.block_size} tokens ({tokens} tokens, "
            f"{self.num_blocks * self.bytes_per_block / 2**30:.2f} GiB {dtype_name(self.config.kv_dtype)}"
            f"{' per rank' if self.tp.size > 1 else ''}); "
            f"max concurrency at {self.config.max_model_len} tokens per request: "
            f"{self._max_concurrency(tokens):.1f}x"
        )

    def _max_concurrency(self, tokens: int) -> float:
        """Requests of max_model_len tokens that fit at once (a hybrid model's also need a slot each)."""
        by_kv = tokens / self.config.max_model_len
        num_slots = self.cache_size.num_state_slots
        return min(by_kv, num_slots) if num_slots else by_kv
