"""What a decode pod's death costs a stream the router continues elsewhere: the pause the client sees, and whether
the text after it is the text it would have got.

A router and two `pdserve decode` engines of one model on 127.0.0.1 (decode-only: no prefill pool), in two
variants started one after the other: `recompute` (no KV tier: the continuing engine computes prompt and output)
and `tier` (both engines write and read one shared KV-tier folder, --kv-tier-always-load: the continuing engine
loads the history's whole blocks the dead one wrote, and computes only the last partial block). Each trial streams
one request (a distinct --prompt-tokens prompt, --output-tokens tokens, EOS ignored; greedy and seeded in turn)
through the router, kills (SIGKILL) the engine serving it once a random share (25-75%) of the tokens arrived,
reads the stream to its end and restarts the killed engine. Figures per variant: the pause (time from the kill
to the next event the client gets) against the stream's median gap between events before the kill, and how many
texts equal an uninterrupted run of the same request (run first, on the same engines).

Model (--model): bench, the ~85M Llama of bench/pd_vs_colocated.py (default); demo, the built-in demo model.
Takes about 4 minutes on 2 cores with the defaults. Last line JSON {"bench": "migration", ...}.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import signal
import statistics
import tempfile
import time
from pathlib import Path

import pdserve  # noqa: F401  (before torch loads: how its OpenMP threads wait, pdserve.OPENMP_ENV)

# isort: split
from pd_vs_colocated import build_model

from pdserve.launcher import free_port
from pdserve.models.demo import ensure_demo_model
from pdserve.testing.metrics import metric, scrape
from pdserve.testing.processes import Process, engine_argv, router_argv, server_env


class Stream:
    """One streamed completion through the router, read event by event with the time each arrived."""

    def __init__(self, port: int, body: dict) -> None:
        self.connection = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        self.connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        self.response = self.connection.getresponse()
        assert self.response.status == 200, self.response.read()
        self.texts: list[str] = []
        self.times: list[float] = []

    def next_event(self) -> bool:
        """Read one data event; False at [DONE]."""
        lines = []
        while (line := self.response.readline()) != b"\n":
            assert line, "the stream ended before [DONE]"
            lines.append(line.strip())
        event = b"".join(lines)
        if event == b"data: [DONE]":
            self.connection.close()
            return False
        chunk = json.loads(event[6:])
        assert "error" not in chunk, chunk
        self.texts.append("".join(c["text"] for c in chunk["choices"]))
        self.times.append(time.perf_counter())
        return True

    @property
    def text(self) -> str:
        return "".join(self.texts)


def body_of(trial: int, args: argparse.Namespace) -> dict:
    rng = random.Random(trial)
    sampling = {"temperature": 0.0} if trial % 2 == 0 else {"temperature": 0.8, "seed": trial}
    return {
        "model": "m",
        "prompt": [rng.randrange(10, 1000) for _ in range(args.prompt_tokens)],
        "max_tokens": args.output_tokens,
        "ignore_eos": True,
        "stream": True,
        **sampling,
    }


def run_variant(name: str, folder: Path, scratch: Path, args: argparse.Namespace) -> dict:
    flags = ["--device", "cpu", "--kv-cache-memory", args.kv_cache_memory, "--served-model-name", "m"]
    flags += ["--log-level", "warning", "--kv-peer-hold-seconds", "0"]
    if name == "tier":
        flags += ["--kv-tier-shared", str(scratch / f"shared-{name}"), "--kv-tier-always-load"]
    engines = []
    for index in range(2):
        port = free_port()
        argv = engine_argv("decode", port, str(folder), *flags, transport="tcp")
        engines.append(Process(f"{name}-{index}", argv, server_env(), port, str(scratch / f"{name}-{index}.log")))
    router_port = free_port()
    router = Process(
        "router",
        router_argv(router_port, [], [e.url for e in engines], "--routing", "least-load"),
        server_env(),
        router_port,
        str(scratch / f"router-{name}.log"),
    )
    pauses, gaps, same = [], [], 0
    try:
        for process in engines:
            process.start()
        for process in engines:
            process.wait_healthy(300)
        router.start()
        router.wait_healthy()
        for trial in range(args.trials):
            body = body_of(trial, args)
            reference = Stream(router_port, body)
            while reference.next_event():
                pass
            stream = Stream(router_port, body)
            kill_at = random.Random(trial).randrange(args.output_tokens // 4, 3 * args.output_tokens // 4)
            while len(stream.times) < kill_at:
                assert stream.next_event()
            victim = max(engines, key=lambda e: metric(scrape(e.url), "pdserve_num_requests_running"))
            assert victim.process is not None
            killed = time.perf_counter()
            victim.process.send_signal(signal.SIGKILL)
            victim.process.wait(10)
            before = len(stream.times)
            while stream.next_event():
                pass
            pause = stream.times[before] - killed
            gap = statistics.median(b - a for a, b in zip(stream.times[1:before], stream.times[2:before], strict=False))
            pauses.append(pause)
            gaps.append(gap)
            same += stream.text == reference.text
            print(
                f"{name} trial {trial}: killed after {before} events, pause {pause * 1e3:.0f} ms "
                f"(gap before {gap * 1e3:.1f} ms), {'same' if stream.text == reference.text else 'DIFFERENT'} text",
                flush=True,
            )
            victim.start()
            victim.wait_healthy(300)
    finally:
        router.stop()
        for process in engines:
            process.stop()
    return {
        "pause_ms_p50": round(statistics.median(pauses) * 1e3, 1),
        "pause_ms_max": round(max(pauses) * 1e3, 1),
        "gap_ms_p50": round(statistics.median(gaps) * 1e3, 2),
        "same_text": f"{same}/{args.trials}",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("bench", "demo"), default="bench")
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--kv-cache-memory", default="256MiB")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pdserve-migration-") as folder_name:
        scratch = Path(folder_name)
        folder = scratch / "model"
        if args.model == "bench":
            build_model(folder)
        else:
            folder = ensure_demo_model()
        results = {name: run_variant(name, folder, scratch, args) for name in ("recompute", "tier")}
    for name, result in results.items():
        print(
            f"{name}: pause p50 {result['pause_ms_p50']} ms (max {result['pause_ms_max']}), "
            f"gap between events {result['gap_ms_p50']} ms, same text {result['same_text']}"
        )
    ratio = results["recompute"]["pause_ms_p50"] / results["tier"]["pause_ms_p50"]
    print(f"pause recompute/tier: {ratio:.2f}x")
    print(json.dumps({"bench": "migration", "model": args.model, **results, "pause_ratio": round(ratio, 2)}))


if __name__ == "__main__":
    main()
