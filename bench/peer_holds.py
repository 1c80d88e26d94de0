"""Decode throughput with finished turns held for peer reads, against the same engine holding nothing.

Two `pdserve decode` engines of one model on 127.0.0.1, started once each and run one at a time: `hold` with the
default --kv-peer-hold-seconds (300) and --kv-peer-hold-fraction (0.25), `none` with --kv-peer-hold-seconds 0.
Each round sends the same batch to one engine: --requests requests at once, each a distinct --prompt-tokens random
prompt and --output-tokens greedy tokens (EOS ignored), over /v1/completions; on `hold` every request carries a
new `kv_peer_hold` handle, as the router's decode legs do, so every finished request is held. The KV pool
(--kv-cache-memory, default 1.05 batches' worth) is sized so that a batch's requests fill nearly all of it: the holds
of one batch (up to a quarter of the pool) must give their blocks back to the next batch's requests
(pdserve_kv_peer_holds_dropped_total{reason="room"}), which is the cost this measures. Rounds alternate none, hold,
none, hold... (--rounds each, after one warm-up round each); the figure is each engine's median output tokens/s
(completion tokens over the round's wall time) and their ratio.

Model (--model): bench, the ~85M Llama of bench/pd_vs_colocated.py (default); demo, the built-in demo model.
Takes about 3 minutes on 2 cores with the defaults. Last line JSON {"bench": "peer_holds", ...}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import secrets
import statistics
import tempfile
import time
from pathlib import Path

import pdserve  # noqa: F401  (before torch loads: how its OpenMP threads wait, pdserve.OPENMP_ENV)

# isort: split
import aiohttp
import torch
from pd_vs_colocated import build_model

from pdserve.launcher import free_port
from pdserve.models.config import ModelConfig
from pdserve.models.demo import ensure_demo_model
from pdserve.models.dtype import resolve_dtype
from pdserve.testing.metrics import scrape
from pdserve.testing.processes import Process, engine_argv, server_env


async def run_batch(url: str, args: argparse.Namespace, seed: int, hold: bool) -> tuple[int, float]:
    """(completion tokens, seconds) of one batch."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, 1000) for _ in range(args.prompt_tokens)] for _ in range(args.requests)]

    async def one(session: aiohttp.ClientSession, prompt: list[int]) -> int:
        body: dict = {
            "model": "m",
            "prompt": prompt,
            "max_tokens": args.output_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        if hold:
            body["kv_transfer_params"] = {"kv_peer_hold": secrets.token_hex(16)}
        async with session.post(url + "/v1/completions", json=body) as response:
            answer = await response.json()
            assert response.status == 200, answer
            return int(answer["usage"]["completion_tokens"])

    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        started = time.perf_counter()
        tokens = await asyncio.gather(*(one(session, prompt) for prompt in prompts))
        return sum(tokens), time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("bench", "demo"), default="bench")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=240)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--kv-cache-memory", default=None, help="default: 1.05 batches' worth of the model's KV")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="pdserve-peer-holds-") as scratch:
        folder = Path(scratch) / "model"
        if args.model == "bench":
            build_model(folder)
        else:
            folder = ensure_demo_model()
        kv_per_token = ModelConfig.from_folder(folder).kv_bytes_per_token(resolve_dtype("auto", torch.device("cpu")))
        batch_bytes = args.requests * (args.prompt_tokens + args.output_tokens + 16) * kv_per_token
        memory = args.kv_cache_memory or f"{int(batch_bytes * 1.05) >> 20}MiB"
        engines: dict[str, Process] = {}
        try:
            for name, seconds in (("none", "0"), ("hold", "300")):
                port = free_port()
                argv = engine_argv("decode", port, str(folder), "--device", "cpu", "--kv-cache-memory", memory)
                argv += ["--served-model-name", "m", "--log-level", "warning", "--kv-peer-hold-seconds", seconds]
                engines[name] = Process(name, argv, server_env(), port, str(Path(scratch) / f"{name}.log"))
                engines[name].start()
            for process in engines.values():
                process.wait_healthy(300)
            rates: dict[str, list[float]] = {"none": [], "hold": []}
            for round_ in range(args.rounds + 1):
                for name, process in engines.items():
                    tokens, seconds = asyncio.run(run_batch(process.url, args, 1000 * round_, name == "hold"))
                    if round_:  # the first round warms each engine up
                        rates[name].append(tokens / seconds)
                        print(f"round {round_} {name}: {tokens / seconds:.1f} output tok/s", flush=True)
            held = scrape(engines["hold"].url)
        finally:
            for process in engines.values():
                process.stop()
    medians = {name: statistics.median(values) for name, values in rates.items()}
    dropped = {key: value for key, value in held.items() if key.startswith("pdserve_kv_peer_holds_dropped_total")}
    result = {
        "bench": "peer_holds",
        "model": args.model,
        "kv_cache_memory": memory,
        "none_tok_s": round(medians["none"], 1),
        "hold_tok_s": round(medians["hold"], 1),
        "ratio": round(medians["hold"] / medians["none"], 3),
        "rounds": {name: [round(v, 1) for v in values] for name, values in rates.items()},
        "held_blocks_at_end": held.get("pdserve_kv_blocks_held_for_peers", 0),
        "dropped": dropped,
        "preemptions": held.get("pdserve_preemptions_total", 0),
    }
    print(f"hold/none output tok/s: {result['ratio']:.3f} ({medians['hold']:.1f} / {medians['none']:.1f})")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
