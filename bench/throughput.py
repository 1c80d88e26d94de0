"""Offline generation throughput: pdserve's LLM.generate against transformers' continuous batching
(``generate_batch``) on the same weights, in one command.

Model: a ~110M Llama (hidden 768, 12 layers, 12 heads, intermediate 2048, vocab 32000, tied
embeddings), random seeded weights, fp32. Workload: 64 requests, 128-token random prompts, 128 new
tokens each, greedy, EOS ignored. Each engine is warmed up on a small batch first. Also reports
pdserve's decode step at batch 64 against the decode roofline (weight bytes per step / measured
weight-streaming bandwidth). Takes 3-5 minutes on 2 cores.

transformers' configuration (the best of those tried for this workload, see docs/benchmarks.md):
page_size 32, num_blocks 640 (20480 token slots: all 64 requests stay resident), max_batch_tokens
32, max_requests_per_batch 64, sdpa attention. (transformers gets faster as max_batch_tokens
shrinks, down to 32: its paged attention on CPU seems to cost more than linearly in batch size.)

--family qwen3-moe runs a Qwen3-MoE model of the same scale instead (hidden 768, 12 layers, every
layer routing each token to 2 of 16 experts of 512 features: ~270M parameters, ~72M active per
token), and reports the share of a decode step spent in the routed layers (router + experts).
transformers' experts implementation (eager, batched_mm, grouped_mm) is chosen by a short probe
run of each on the same model: the fastest runs the full workload.

--family qwen3.5 runs a hybrid Qwen3.5 model of the same scale (hidden 768, 12 layers: 9 Gated
DeltaNet layers of 6 key and 12 value heads of 64, and 3 gated full-attention layers; ~125M
parameters). transformers' continuous batching does not run linear-attention layers, so its side
is ``generate`` on the whole batch at once (the prompts have one length: no padding), with its
torch implementations of the gated delta rule (no flash-linear-attention on CPU).

With --plot DIR (and transformers measured), writes DIR/throughput.png (DIR/throughput-FAMILY.png).
Last line: {"bench": "throughput", "family": F, "pdserve_tok_s": X, "hf_tok_s": Y, "ratio": R}
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time

import pdserve  # noqa: F401  (before torch loads: how its OpenMP threads wait, pdserve.OPENMP_ENV)

# isort: split
import torch
from plots import add_plot_argument, bar_chart

from pdserve import LLM, SamplingParams
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.request import Request
from pdserve.models.demo import ensure_demo_model

MODEL = {
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "vocab_size": 32000,
    "tie_word_embeddings": True,
    "max_position_embeddings": 1024,
}
MOE_MODEL = {
    **MODEL,
    "num_experts": 16,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 512,
    "norm_topk_prob": True,
    "head_dim": 64,
}
HYBRID_MODEL = {
    **MODEL,
    "head_dim": 64,
    "num_key_value_heads": 4,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 3,
    "linear_num_key_heads": 6,
    "linear_num_value_heads": 12,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
}
# family -> (transformers config class, model class, config)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", MODEL),
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", MOE_MODEL),
    "qwen3.5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", HYBRID_MODEL),
}
EXPERTS_IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm")
HF_CB = {"page_size": 32, "num_blocks": 640, "max_batch_tokens": 32, "max_requests_per_batch": 64}


def build_model(folder: str, family: str = "llama") -> int:
    import transformers

    config_name, model_name, config = FAMILIES[family]
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(getattr(transformers, config_name)(**config)).eval()
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def active_parameters(num_params: int, family: str) -> int:
    """Parameters a token's forward pass multiplies: all of a dense model's; the chosen experts' of a MoE."""
    config = FAMILIES[family][2]
    if "num_experts" not in config:
        return num_params
    per_expert = 3 * config["hidden_size"] * config["moe_intermediate_size"]
    idle = config["num_experts"] - config["num_experts_per_tok"]
    return num_params - config["num_hidden_layers"] * idle * per_expert


def weight_streaming_gbps() -> float:
    """GB/s of a large fp32 matrix-vector product: how fast decode can stream weights here."""
    matrix = torch.randn(8192, 8192)
    vector = torch.randn(8192)
    torch.mv(matrix, vector)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        torch.mv(matrix, vector)
        times.append(time.perf_counter() - start)
    return matrix.numel() * 4 / min(times) / 1e9


def gemm_gflops() -> float:
    """fp32 GFLOP/s of a large matrix product: the compute roof of a batched decode step."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    torch.mm(a, b)
    start = time.perf_counter()
    for _ in range(3):
        torch.mm(a, b)
    return 3 * 2 * 2048**3 / (time.perf_counter() - start) / 1e9


def run_pdserve(folder: str, prompts: list[list[int]], new_tokens: int) -> tuple[float, float, float]:
    """(output tokens/s of the whole generate, median seconds of a batch-64 decode step, the share of
    that step spent in routed MLP layers: 0 for a dense model)."""
    llm = LLM(
        folder,
        tokenizer=str(ensure_demo_model()),
        max_model_len=512,
        kv_cache_memory=2 << 30,
        max_num_batched_tokens=2048,
    )
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    tok_s = tokens_per_second(llm, prompts, new_tokens)
    timed_steps = 8
    with RoutedLayerClock(llm) as clock:
        step_s = median_decode_step(llm.engine, prompts, params, timed_steps)
    # The timed decode steps are the last forward passes (the prompts' steps come before them).
    routed = clock.per_step[-timed_steps:]
    return tok_s, step_s, statistics.median(routed) / step_s if routed else 0.0


class RoutedLayerClock:
    """Wall time inside the model's routed MLP layers (forward hooks: CPU work is synchronous), per
    forward pass (``per_step``, in order). Needs the model in this process (the default executor)."""

    def __init__(self, llm: LLM) -> None:
        from pdserve.models.moe import SparseMoeBlock

        model = llm.engine.model_executor.model  # the in-process executor is the ModelRunner
        self.blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
        self.per_step: list[float] = []
        self.handles: list[torch.utils.hooks.RemovableHandle] = []
        self.started, self.running_sum, self.calls = 0.0, 0.0, 0

    def _before(self, *_: object) -> None:
        self.started = time.perf_counter()

    def _after(self, *_: object) -> None:
        self.running_sum += time.perf_counter() - self.started
        self.calls += 1
        if self.calls % len(self.blocks) == 0:  # the last routed layer of a forward pass
            self.per_step.append(self.running_sum)
            self.running_sum = 0.0

    def __enter__(self) -> RoutedLayerClock:
        for block in self.blocks:
            self.handles += [block.register_forward_pre_hook(self._before), block.register_forward_hook(self._after)]
        return self

    def __exit__(self, *_: object) -> None:
        for handle in self.handles:
            handle.remove()


def tokens_per_second(llm: LLM, prompts: list[list[int]], new_tokens: int) -> float:
    """Output tokens/s of one ``generate`` of ``prompts`` (greedy, EOS ignored), after a small warm-up."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert num_tokens == len(prompts) * new_tokens
    return num_tokens / elapsed


def median_decode_step(engine: EngineCore, prompts: list[list[int]], params: SamplingParams, steps: int) -> float:
    """Seconds of a pure decode step with ``prompts`` running: each brought past its prompt first,
    then ``steps`` steps timed (median); the requests are aborted afterwards."""
    ids = [f"decode-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(Request(request_id, prompt, params))
    scheduler = engine.scheduler
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running) or scheduler.waiting:
        engine.step()
    step_times = []
    for _ in range(steps):
        start_step = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - start_step)
    engine.abort_requests(ids)
    engine.step()
    return statistics.median(step_times)


def run_hf(folder: str, prompts: list[list[int]], new_tokens: int, experts_implementation: str | None = None) -> float:
    from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

    options = {} if experts_implementation is None else {"experts_implementation": experts_implementation}
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="sdpa", **options
    ).eval()
    generation = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    batching = ContinuousBatchingConfig(**HF_CB)
    with torch.inference_mode():
        model.generate_batch(
            prompts[:4],
            generation_config=GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0),
            continuous_batching_config=batching,
        )
        start = time.perf_counter()
        outputs = model.generate_batch(
            prompts, generation_config=generation, continuous_batching_config=batching, warmup=False
        )  # warmed up above: time the work alone
        elapsed = time.perf_counter() - start
    num_tokens = sum(len(o.generated_tokens) for o in outputs.values())
    assert num_tokens == len(prompts) * new_tokens, num_tokens
    return num_tokens / elapsed


def run_hf_generate(folder: str, prompts: list[list[int]], new_tokens: int) -> float:
    """transformers' ``generate`` on the whole batch at once (prompts of one length), after a warm-up."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
    batch = torch.tensor(prompts)
    options = {"do_sample": False, "eos_token_id": None, "pad_token_id": 0}
    with torch.inference_mode():
        model.generate(
            batch[:4], attention_mask=torch.ones_like(batch[:4]), max_new_tokens=4, min_new_tokens=4, **options
        )
        start = time.perf_counter()
        out = model.generate(
            batch,
            attention_mask=torch.ones_like(batch),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            **options,
        )
        elapsed = time.perf_counter() - start
    num_tokens = (out.shape[1] - batch.shape[1]) * out.shape[0]
    assert num_tokens == len(prompts) * new_tokens, num_tokens
    return num_tokens / elapsed


def fastest_experts_implementation(folder: str, prompts: list[list[int]]) -> str:
    """transformers' fastest experts implementation here, by a short run of each (16 requests, 16 tokens)."""
    rates = {}
    for implementation in EXPERTS_IMPLEMENTATIONS:
        try:
            rates[implementation] = run_hf(folder, prompts[:16], 16, implementation)
        except Exception as error:  # an implementation this build lacks is skipped, and said
            print(f"transformers experts_implementation={implementation}: failed ({error})")
            continue
        print(f"transformers experts_implementation={implementation}: {rates[implementation]:.1f} tok/s (probe)")
    return max(rates, key=rates.__getitem__)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--skip-hf", action="store_true", help="measure pdserve only (no ratio)")
    parser.add_argument("--family", choices=list(FAMILIES), default="llama")
    add_plot_argument(parser)
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(MODEL["vocab_size"]) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    with tempfile.TemporaryDirectory() as folder:
        num_params = build_model(folder, args.family)
        active = active_parameters(num_params, args.family)
        weight_bytes = active * 4  # what a decode step streams (at batch 64 every expert is busy: a lower bound)
        print(
            f"model ({args.family}): {num_params / 1e6:.1f}M parameters ({active / 1e6:.1f}M active per token), "
            f"{num_params * 4 / 1e6:.0f} MB fp32, torch threads {torch.get_num_threads()}"
        )
        print(
            f"workload: {args.requests} requests x {args.prompt_len} prompt + {args.new_tokens} new tokens, "
            "greedy, EOS ignored",
            flush=True,
        )
        pdserve_tok_s, decode_step_s, routed_share = run_pdserve(folder, prompts, args.new_tokens)
        print(f"pdserve LLM.generate:        {pdserve_tok_s:8.1f} output tok/s", flush=True)
        if routed_share:
            print(f"routed MLP layers (router + experts): {routed_share:.0%} of a batch-{args.requests} decode step")
        bandwidth = weight_streaming_gbps()
        roofline_s = weight_bytes / (bandwidth * 1e9)
        compute_s = 2 * active * args.requests / (gemm_gflops() * 1e9)
        print(
            f"decode step at batch {args.requests}: {decode_step_s * 1e3:.1f} ms; weight-read roofline "
            f"{roofline_s * 1e3:.1f} ms at {bandwidth:.1f} GB/s -> {roofline_s / decode_step_s:.0%} of roofline; "
            f"peak-GEMM compute floor {compute_s * 1e3:.1f} ms -> {compute_s / decode_step_s:.0%} (at this batch "
            "a step is compute-bound, not weight-bound)"
        )
        hf_tok_s = None
        hf_name = "transformers generate_batch"
        if not args.skip_hf and "layer_types" in FAMILIES[args.family][2]:
            hf_name = "transformers generate"
            hf_tok_s = run_hf_generate(folder, prompts, args.new_tokens)
            print(f"{hf_name}: {hf_tok_s:8.1f} output tok/s (batch {args.requests})")
        elif not args.skip_hf:
            implementation = None
            if "num_experts" in FAMILIES[args.family][2]:
                implementation = fastest_experts_implementation(folder, prompts)
            hf_tok_s = run_hf(folder, prompts, args.new_tokens, implementation)
            chosen = "" if implementation is None else f", experts_implementation={implementation}"
            print(f"{hf_name}: {hf_tok_s:8.1f} output tok/s ({HF_CB}{chosen})")
        if hf_tok_s is not None:
            print(f"ratio: {pdserve_tok_s / hf_tok_s:.2f}x")
            if args.plot:
                described = "~110M Llama" if args.family == "llama" else f"{num_params / 1e6:.0f}M {args.family}"
                bar_chart(
                    args.plot,
                    "throughput" if args.family == "llama" else f"throughput-{args.family}",
                    f"offline generation, {args.requests} x ({args.prompt_len} + "
                    f"{args.new_tokens}) tokens, {described} fp32",
                    "output tokens/s",
                    {
                        "pdserve LLM.generate": {"tok/s": pdserve_tok_s},
                        hf_name: {"tok/s": hf_tok_s},
                    },
                )
    print(
        json.dumps(
            {
                "bench": "throughput",
                "family": args.family,
                "pdserve_tok_s": round(pdserve_tok_s, 1),
                "hf_tok_s": None if hf_tok_s is None else round(hf_tok_s, 1),
                "ratio": None if hf_tok_s is None else round(pdserve_tok_s / hf_tok_s, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
