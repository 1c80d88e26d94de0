"""pdserve against llama.cpp on the same weights, on this CPU, in one command.

llama.cpp is built from the source the ``llama-cpp-python`` sdist on PyPI vendors (its own CMake, native CPU,
the ``llama-server`` and ``llama-batched-bench`` targets; about 11 minutes on 2 cores, cached under
``~/.cache/pdserve/llamacpp``). The bench model (``bench/throughput.py``'s ~110M Llama, random seeded weights)
is converted to GGUF f32 with the converter shipped in that source; its tokenizer is a stand-in with the
model's vocabulary size (byte-fallback BPE), since the workload is token ids.

Workload (as bench/throughput.py): 64 requests of 128 random prompt tokens, 128 new tokens each, greedy, EOS
ignored. llama.cpp: ``llama-server -np 64`` (continuous batching, ``cache_prompt`` off), all requests sent at
once; its prompt and generation phases from ``llama-batched-bench`` (the same shapes). pdserve:
``LLM.generate`` on the same prompts, prefix caching off; its prompt phase timed alone (``max_tokens=1``),
generation = the rest.
Then batch 1 (one request, 128 + 128) for each. Both use every core (``--threads``, default all; pdserve's
engine sizes its own threads from the CPU budget and follows contention, llama.cpp keeps ``--threads``).
``--spinners 0 1`` repeats each run with that many single-threaded busy processes beside the engine being timed.
``--runs N`` repeats both engines N times (one after the other); the JSON line gives the run with the median
ratio, and every run's ratios. ``--isa avx2`` holds both engines to AVX2 on an AVX-512 host: llama.cpp built for
``x86-64-v3``, and torch, oneDNN, MKL and pdserve's C++ kernels limited by their environment variables.

Needs the ``bench`` extra (the converter imports ``sentencepiece``) plus cmake and a C++ compiler.
Last line: {"bench": "vs_llamacpp", "pdserve_tok_s": X, "llamacpp_tok_s": Y, "ratio": R, "cpu": "...", ...}
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import random
import re
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path

from contention import spinning
from plots import add_plot_argument, bar_chart
from throughput import MODEL, build_model

from pdserve import LLM, SamplingParams
from pdserve.launcher import free_port

LLAMA_CPP_PYTHON = "0.3.36"  # the llama-cpp-python sdist whose vendored llama.cpp is built
TARGETS = ("llama-server", "llama-batched-bench")


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def llamacpp_source(cache: Path) -> Path:
    """The vendored llama.cpp folder of the llama-cpp-python sdist (downloaded and unpacked once)."""
    source = cache / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
    if (source / "CMakeLists.txt").is_file():
        return source
    cache.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:"]
        + [f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(cache)],
        check=True,
    )
    with tarfile.open(cache / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz") as archive:
        archive.extractall(cache, filter="data")
    return source


def build_llamacpp(source: Path, build: Path, march: str | None) -> Path:
    """Build the targets (native CPU, or ``-march=MARCH``) once; returns the folder of the binaries."""
    binaries = build / "bin"
    if all((binaries / target).is_file() for target in TARGETS):
        return binaries
    flags = ["-DGGML_NATIVE=ON"] if march is None else ["-DGGML_NATIVE=OFF", f"-DCMAKE_C_FLAGS=-march={march}"]
    if march is not None:
        flags.append(f"-DCMAKE_CXX_FLAGS=-march={march}")
    started = time.perf_counter()
    subprocess.run(
        ["cmake", "-S", str(source), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF"]
        + ["-DLLAMA_BUILD_TESTS=OFF", "-DBUILD_SHARED_LIBS=OFF", *flags],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    subprocess.run(
        ["cmake", "--build", str(build), "--config", "Release", "-j", str(os.cpu_count() or 1), "--target", *TARGETS],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    print(f"llama.cpp built in {time.perf_counter() - started:.0f} s ({build})", flush=True)
    return binaries


def write_stand_in_tokenizer(folder: Path, vocab_size: int) -> None:
    """A byte-fallback BPE tokenizer with ``vocab_size`` tokens (what the GGUF converter reads for a Llama)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{byte:02X}>": 3 + byte for byte in range(256)})
    vocab.update({f"▁t{index}": index for index in range(len(vocab), vocab_size)})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    wrapped.save_pretrained(str(folder))


def convert_to_gguf(source: Path, model: Path, output: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(source / "gguf-py"))
    subprocess.run(
        [sys.executable, str(source / "convert_hf_to_gguf.py"), str(model), "--outtype", "f32"]
        + ["--outfile", str(output)],
        check=True,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


# ----- llama.cpp ------------------------------------------------------------------------------------------------


def _post(url: str, body: dict, timeout: float = 600) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


class LlamaServer:
    def __init__(self, binaries: Path, gguf: Path, slots: int, slot_tokens: int, threads: int) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen(
            [str(binaries / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port)]
            + ["-t", str(threads), "-tb", str(threads), "-np", str(slots), "-c", str(slots * slot_tokens)]
            + ["-b", "2048", "-ub", "512", "--cont-batching", "--no-webui"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 300
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"llama-server did not start (exit code {self.process.poll()})")
            time.sleep(0.5)

    def complete(self, prompt: list[int], new_tokens: int) -> int:
        answer = _post(
            self.url + "/completion",
            {
                "prompt": prompt,
                "n_predict": new_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "cache_prompt": False,
            },
        )
        return int(answer["timings"]["predicted_n"])

    def tokens_per_second(self, prompts: list[list[int]], new_tokens: int) -> float:
        """Output tok/s of all ``prompts`` sent at once."""
        self.complete(prompts[0][:8], 4)  # warm-up
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            counts = list(pool.map(lambda prompt: self.complete(prompt, new_tokens), prompts))
        elapsed = time.perf_counter() - start
        assert sum(counts) == len(prompts) * new_tokens, counts
        return sum(counts) / elapsed

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(30)


def batched_bench(binaries: Path, gguf: Path, prompt_len: int, new_tokens: int, batch: int, threads: int) -> dict:
    """llama-batched-bench's prompt (S_PP) and generation (S_TG) tok/s for ``batch`` sequences."""
    output = subprocess.run(
        [str(binaries / "llama-batched-bench"), "-m", str(gguf), "-c", str(batch * (prompt_len + new_tokens + 16))]
        + ["-b", "2048", "-ub", "512", "-npp", str(prompt_len), "-ntg", str(new_tokens), "-npl", str(batch)]
        + ["-t", str(threads), "-tb", str(threads)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    for line in output.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) >= 10 and re.fullmatch(r"\d+", cells[0]) and int(cells[2]) == batch:
            return {"prompt_tok_s": float(cells[5]), "generation_tok_s": float(cells[7])}
    raise RuntimeError(f"no result in llama-batched-bench's output:\n{output}")


# ----- pdserve --------------------------------------------------------------------------------------------------


def pdserve_figures(llm: LLM, prompts: list[list[int]], new_tokens: int) -> dict:
    """End-to-end output tok/s of ``prompts``, and its prompt phase (max_tokens 1, timed alone) and generation phase."""
    greedy = dict(temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(max_tokens=4, **greedy))  # warm-up
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=1, **greedy))
    prompt_s = time.perf_counter() - start
    start = time.perf_counter()
    outputs = llm.generate(prompts, SamplingParams(max_tokens=new_tokens, **greedy))
    total_s = time.perf_counter() - start
    num_tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
    assert num_tokens == len(prompts) * new_tokens
    return {
        "tok_s": num_tokens / total_s,
        "prompt_tok_s": sum(map(len, prompts)) / prompt_s,
        "generation_tok_s": len(prompts) * (new_tokens - 1) / max(total_s - prompt_s, 1e-9),
    }


# What an AVX2 machine gets, measured on an AVX-512 one: torch's kernels, oneDNN, MKL and our C++ ops
# all held to AVX2 (they read these at start-up, hence the re-exec), llama.cpp built for x86-64-v3.
AVX2_ENV = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "PDSERVE_CPU_KERNELS": "avx2",
}


def one_run(
    binaries: Path, model: Path, gguf: Path, prompts: list[list[int]], args: argparse.Namespace, spinners: int = 0
) -> dict:
    """Both engines on the same prompts, llama.cpp first: their tok/s and phases, at batch len(prompts) and 1;
    with ``spinners`` busy processes beside each while it is timed (the phases only on a quiet machine)."""
    server = LlamaServer(binaries, gguf, args.requests, args.prompt_len + args.new_tokens + 16, args.threads)
    try:
        with spinning(spinners):
            llamacpp_tok_s = server.tokens_per_second(prompts, args.new_tokens)
            llamacpp_batch1 = server.tokens_per_second(prompts[:1], args.new_tokens)
    finally:
        server.close()
    phases = (
        None
        if spinners
        else batched_bench(binaries, gguf, args.prompt_len, args.new_tokens, args.requests, args.threads)
    )
    phase_text = (
        f"batched-bench prompt {phases['prompt_tok_s']:.1f} tok/s, generation {phases['generation_tok_s']:.1f} tok/s; "
        if phases is not None
        else ""
    )
    print(
        f"spinners {spinners}: llama.cpp f32 (llama-server -np {args.requests}): {llamacpp_tok_s:7.1f} output tok/s; "
        f"{phase_text}batch 1: {llamacpp_batch1:.1f} tok/s",
        flush=True,
    )
    # No prefix caching: every run computes its prompts (llama.cpp's runs have cache_prompt off).
    with (
        LLM(
            str(model),
            max_model_len=512,
            kv_cache_memory=2 << 30,
            max_num_batched_tokens=2048,
            enable_prefix_caching=False,
        ) as llm,
        spinning(spinners),
    ):
        ours = pdserve_figures(llm, prompts, args.new_tokens)
        ours_batch1 = pdserve_figures(llm, prompts[:1], args.new_tokens)["tok_s"]
    print(
        f"spinners {spinners}: pdserve LLM.generate:       {ours['tok_s']:7.1f} output tok/s; prompt "
        f"{ours['prompt_tok_s']:.1f} tok/s, generation {ours['generation_tok_s']:.1f} tok/s; "
        f"batch 1: {ours_batch1:.1f} tok/s",
        flush=True,
    )
    ratio, ratio_batch1 = ours["tok_s"] / llamacpp_tok_s, ours_batch1 / llamacpp_batch1
    print(f"ratio at batch {args.requests}: {ratio:.2f}x; batch 1: {ratio_batch1:.2f}x", flush=True)
    return {
        "spinners": spinners,
        "pdserve_tok_s": round(ours["tok_s"], 1),
        "llamacpp_tok_s": round(llamacpp_tok_s, 1),
        "ratio": round(ratio, 3),
        "pdserve_batch1_tok_s": round(ours_batch1, 1),
        "llamacpp_batch1_tok_s": round(llamacpp_batch1, 1),
        "batch1_ratio": round(ratio_batch1, 3),
    }


def plot_runs(folder: Path, runs: list[dict], isa: str, batch: int) -> None:
    groups = {}
    for index, run in enumerate(runs, 1):
        groups[f"batch {batch}, run {index}"] = {
            "llama.cpp f32": run["llamacpp_tok_s"],
            "pdserve": run["pdserve_tok_s"],
        }
    for index, run in enumerate(runs, 1):
        groups[f"batch 1, run {index}"] = {
            "llama.cpp f32": run["llamacpp_batch1_tok_s"],
            "pdserve": run["pdserve_batch1_tok_s"],
        }
    bar_chart(
        folder,
        "vs_llamacpp" if isa == "native" else f"vs_llamacpp-{isa}",
        f"Output tok/s on the same weights ({cpu_name()}, {isa})",
        "output tokens / s",
        groups,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--runs", type=int, default=1, help="rounds of both engines, one after the other")
    parser.add_argument(
        "--spinners",
        type=int,
        nargs="+",
        default=[0],
        help="each run once per count of single-threaded busy processes beside the engine being timed",
    )
    parser.add_argument(
        "--isa",
        choices=["native", "avx2"],
        default="native",
        help="avx2: both engines held to AVX2 (llama.cpp built for x86-64-v3), to measure an AVX2 CPU's "
        "figures on an AVX-512 one",
    )
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "pdserve" / "llamacpp")
    add_plot_argument(parser)
    args = parser.parse_args()
    if args.isa == "avx2" and any(os.environ.get(name) != value for name, value in AVX2_ENV.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **AVX2_ENV})
    march = None if args.isa == "native" else "x86-64-v3"
    source = llamacpp_source(args.cache)
    binaries = build_llamacpp(source, args.cache / f"build-{march or 'native'}", march)
    rng = random.Random(0)
    vocab_size = MODEL["vocab_size"]
    # Token ids the stand-in tokenizer maps to plain pieces (no control or byte tokens).
    prompts = [[rng.randrange(259, vocab_size) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    cpu = cpu_name()
    print(f"cpu: {cpu} ({args.isa}), {args.threads} threads; llama.cpp from llama-cpp-python {LLAMA_CPP_PYTHON}")
    print(
        f"workload: {args.requests} requests x {args.prompt_len} prompt + {args.new_tokens} new tokens, greedy, "
        "EOS ignored",
        flush=True,
    )
    import torch

    torch.set_num_threads(args.threads)
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        model = Path(scratch) / "model"
        build_model(str(model))
        write_stand_in_tokenizer(model, vocab_size)
        gguf = Path(scratch) / "model-f32.gguf"
        convert_to_gguf(source, model, gguf)
        for index in range(args.runs):
            print(f"--- run {index + 1} of {args.runs}", flush=True)
            for spinners in args.spinners:
                runs.append(one_run(binaries, model, gguf, prompts, args, spinners))
    first = [run for run in runs if run["spinners"] == args.spinners[0]]
    if args.plot is not None:
        plot_runs(args.plot, first, args.isa, args.requests)
    middle = sorted(first, key=lambda run: run["ratio"])[len(first) // 2]
    summary = {"bench": "vs_llamacpp", **middle, "cpu": cpu, "isa": args.isa}
    summary["ratios"] = [run["ratio"] for run in first]
    summary["batch1_ratios"] = [run["batch1_ratio"] for run in first]
    summary["contended"] = [run for run in runs if run["spinners"] != args.spinners[0]]
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
