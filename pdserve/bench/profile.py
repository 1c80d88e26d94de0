"""`pdserve profile`: measure an engine on this machine into the planner's `Profile`.

The engine is built as a pod builds it (`pdserve.engine.build`: the same model, dtype,
device, KV cache and batch limits) and driven step by step, each step timed with what its
scheduler put in it:
- prompts alone, of lengths doubling from 16 tokens up to four step budgets (chunked beyond one),
  each after half of it was cached once (prefix hits: chunks that start past 0);
- decode batches of 1 to `max_num_seqs` requests (doubling) at short and long contexts, 16 tokens
  each (their prefill steps, mixed with decode steps, are measured too).
A step-time model is fitted to every step (`pdserve.planner.profile`). KV pulls of a few sizes
between two processes with the real transfer agent give the transfer model; the KV capacity and
the bytes of one token's KV come from the engine. Warm-up steps are not recorded.
"""

from __future__ import annotations

import platform
import random
import time
from dataclasses import replace
from typing import Any

from pdserve.bench.kv_pull import measure_pulls
from pdserve.engine.build import build_engine_core
from pdserve.engine.engine_args import EngineArgs
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.planner.profile import EngineShape, Profile, StepPoint, StepTimeModel, TransferModel

PULL_BLOCK_COUNTS = (1, 8, 64)


class _StepRecorder:
    """Times an engine core's steps, with the scheduler output each one ran."""

    def __init__(self, core: Any) -> None:
        self.core = core
        self.points: list[StepPoint] = []
        self._outputs: list[Any] = []
        schedule = core.scheduler.schedule

        def recorded() -> Any:  # the step's composition, as the core's own scheduler made it
            output = schedule()
            self._outputs.append(output)
            return output

        core.scheduler.schedule = recorded

    def run(self, requests: list[Request], record: bool = True) -> None:
        for request in requests:
            self.core.add_request(request)
        while self.core.has_work():
            self._outputs.clear()
            started = time.perf_counter()
            self.core.step()
            seconds = time.perf_counter() - started
            scheduled = [o for o in self._outputs if o.requests]
            if record and len(scheduled) == 1:
                output = scheduled[0]
                self.points.append(StepPoint(list(output.num_scheduled_tokens), list(output.start_positions), seconds))


def _hardware() -> str:
    import torch

    if torch.cuda.is_available():
        return f"gpu: {torch.cuda.get_device_name(0)}"
    model = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            model = next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"cpu: {model} ({torch.get_num_threads()} threads)"


def profile_engine(
    args: EngineArgs,
    transport: str = "nixl",
    gpus_per_pod: int | None = None,
    cpus_per_pod: float = 1.0,
    max_batch: int | None = None,
    seed: int = 0,
) -> Profile:
    """Measure the engine `args` describes (its colocated role: the step costs are the role's either way)."""
    args = replace(args, role="colocated", kv_transfer=None, kv_events_port=None, async_scheduling=False)
    core, model_config, _ = build_engine_core(args)
    try:
        config = core.config
        rng = random.Random(seed)
        vocab = model_config.vocab_size
        counter = iter(range(1 << 30))

        def request(length: int, max_tokens: int, prefix: list[int] | None = None) -> Request:
            head = list(prefix or [])[:length]
            prompt = head + [rng.randrange(vocab) for _ in range(length - len(head))]
            return Request(f"p{next(counter)}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))

        recorder = _StepRecorder(core)
        recorder.run([request(64, 4) for _ in range(2)], record=False)  # warm-up: kernels, allocator
        longest = min(config.max_model_len - 2, 4 * config.max_num_batched_tokens)
        length = 16
        while length <= longest:
            recorder.run([request(length, 1)])
            half = request(length // 2, 1)
            recorder.run([half], record=False)
            recorder.run([request(length, 1, prefix=half.prompt_token_ids)])  # its first half is cached
            length *= 2
        batch_cap = min(config.max_num_seqs, max_batch or config.max_num_seqs)
        for context in sorted({min(64, longest), min(config.max_model_len // 4, longest)}):
            batch = 1
            while batch <= batch_cap:
                if batch * -(-(context + 16) // config.block_size) > config.num_blocks:
                    break  # more than the KV cache holds at once
                recorder.run([request(context, 16) for _ in range(batch)])
                batch *= 2
        kv_bytes_per_token = model_config.kv_bytes_per_token(_kv_dtype(args))
        block_bytes = kv_bytes_per_token * config.block_size
        shape = EngineShape.of(config, kv_bytes_per_token)
    finally:
        core.close()
    pulls = measure_pulls(transport, PULL_BLOCK_COUNTS, block_bytes, repeats=3, seed=seed)
    import torch

    gpus = gpus_per_pod if gpus_per_pod is not None else (args.tensor_parallel_size if torch.cuda.is_available() else 0)
    return Profile(
        model=model_config.architecture,
        hardware=_hardware(),
        engine=shape,
        step=StepTimeModel.fit(recorder.points),
        transfer=TransferModel.fit(pulls),
        gpus_per_pod=gpus,
        cpus_per_pod=cpus_per_pod,
        step_points=recorder.points,
        transfer_points=pulls,
    )


def _kv_dtype(args: EngineArgs) -> Any:
    import torch

    from pdserve.models.dtype import resolve_dtype, resolve_kv_cache_dtype

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return resolve_kv_cache_dtype(args.kv_cache_dtype, resolve_dtype(args.dtype, device), device)
