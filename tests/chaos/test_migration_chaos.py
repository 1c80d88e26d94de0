"""Chaos for streams that survive their decode pod (docs/faults.md, "Streams that survive a decode pod"): real
router, one prefill and three decode processes; 32 concurrent streams (greedy, seeded, and sampled without a
seed), and at a random point mid-stream the decode pod running the most of them is killed (SIGKILL), drained
(SIGTERM, with --drain-handoff 0: handing its streams back at once) or stalled (SIGSTOP, past the router's 3 s
token deadline). The point is counted in events the client read, which trail what the engines generated, so the
fault waits, when it must, for a pod running at least two streams (CI once drained a pod with none left).

Every stream ends whole: [DONE], one id, one usage of all its tokens, no router-only comment, every token's
logprob once (none twice, none missing). Greedy and seeded streams are compared with an uninterrupted run of the
same requests: with the decode pods' shared KV tier on, a continuation loads the history's whole blocks the
first pod wrote, so its logits are the first pod's and every text is the same; without it (recompute), a
near-tie the recompute flips may change the rest of a text: the count is printed and at least 30 of 32 must
match (docs/benchmarks.md has the measured rates). After each round every surviving engine settles to idle.
"""

from __future__ import annotations

import random
import signal
import threading

import pytest

from pdserve.testing.metrics import idle, metric, scrape
from tests.pd.cluster import Cluster, wait_for
from tests.pd.streams import LiveStream

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

NUM_STREAMS = 32
MAX_TOKENS = 96
KINDS = ("greedy", "seeded", "unseeded")


@pytest.fixture(scope="module", params=["recompute", "shared-tier"])
def cluster(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"migration-chaos-{request.param}")
    flags: tuple[str, ...] = ("--drain-handoff", "0")
    if request.param == "shared-tier":
        flags += ("--kv-tier-shared", str(folder / "shared"), "--kv-tier-always-load")
    cluster = Cluster.start(folder, "tcp", num_decode=3, decode_flags=flags, router_flags=("--token-deadline", "3"))
    cluster.variant = request.param
    yield cluster
    for decode in cluster.decodes:
        if decode.process is not None and decode.process.poll() is None:
            decode.process.send_signal(signal.SIGCONT)
    cluster.stop()


def _body(number: int) -> dict:
    kind = KINDS[number % len(KINDS)]
    sampling = {"greedy": {"temperature": 0.0}, "seeded": {"temperature": 0.8, "seed": number}}.get(
        kind, {"temperature": 0.8}
    )
    return {
        "model": "demo",
        "prompt": f"Request {number} asks the engines a question that they answer at some length:",
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": True,
        "logprobs": 1,
        "stream_options": {"include_usage": True},
        **sampling,
    }


def _run_all(cluster: Cluster, on_progress=None) -> list[LiveStream]:
    """The 32 streams, read concurrently to their end; ``on_progress(events so far)`` after each event."""
    assert cluster.router is not None
    streams: list[LiveStream | None] = [None] * NUM_STREAMS
    errors: list[BaseException] = []
    count = [0]
    lock = threading.Lock()

    def read(number: int) -> None:
        try:
            stream = streams[number] = LiveStream(cluster.router.url, _body(number))
            while stream.read_event() is not None:
                with lock:
                    count[0] += 1
                    seen = count[0]
                if on_progress is not None:
                    on_progress(seen)
        except BaseException as error:  # reported below, with the stream's number
            errors.append(AssertionError(f"stream {number}: {error!r}"))

    threads = [threading.Thread(target=read, args=(n,)) for n in range(NUM_STREAMS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert not errors, errors[:3]
    return [s for s in streams if s is not None]


def _check_whole(stream: LiveStream) -> None:
    assert stream.done
    assert len({chunk["id"] for chunk in stream.chunks}) == 1
    assert stream.usage["completion_tokens"] == MAX_TOKENS
    tokens = [t for chunk in stream.chunks for c in chunk["choices"] if c["logprobs"] for t in c["logprobs"]["tokens"]]
    assert len(tokens) == MAX_TOKENS, "a token twice or missing"
    assert [c["finish_reason"] for chunk in stream.chunks for c in chunk["choices"] if c["finish_reason"]] == ["length"]


def _busiest(cluster: Cluster):
    """The live decode pod running the most requests, and how many it runs."""
    alive = [d for d in cluster.decodes if d.process is not None and d.process.poll() is None]
    running = {d.name: metric(scrape(d.url), "pdserve_num_requests_running") for d in alive}
    victim = max(alive, key=lambda d: running[d.name])
    return victim, running[victim.name]


def _settle(cluster: Cluster) -> None:
    for process in [*cluster.prefills, *cluster.decodes]:
        if process.process is not None and process.process.poll() is None:
            wait_for(lambda p=process: idle(scrape(p.url)), 60, f"{process.name} does not settle")


@pytest.mark.parametrize("fault", ["kill", "drain", "stall"])
def test_thirty_two_streams_survive_their_decode_pod(cluster, fault):
    reference = _run_all(cluster)
    migrations_before = _migrations(cluster)
    at = random.Random(fault).randrange(NUM_STREAMS * 2, NUM_STREAMS * MAX_TOKENS // 4)
    struck: list = []
    strike = threading.Lock()

    def fault_at(seen: int) -> None:
        with strike:
            if seen < at or struck:
                return
            victim, running = _busiest(cluster)
            if running < 2:  # the engines run ahead of the client's reading: strike where streams still run
                return
            struck.append((victim, running))
            assert victim.process is not None
            if fault == "kill":
                victim.kill()
            else:
                victim.process.send_signal(signal.SIGTERM if fault == "drain" else signal.SIGSTOP)

    streams = _run_all(cluster, fault_at)
    assert struck, "the fault never struck"
    victim, running = struck[0]
    assert victim.process is not None
    if fault == "stall":
        victim.process.send_signal(signal.SIGCONT)
    for stream in streams:
        _check_whole(stream)
    compared = [(s, r) for number, (s, r) in enumerate(zip(streams, reference, strict=True)) if number % 3 != 2]
    same = sum(s.text == r.text for s, r in compared)
    migrated = _migrations(cluster) - migrations_before
    print(
        f"{cluster.variant}/{fault}: struck a pod running {running:.0f} streams; {migrated:.0f} streams migrated, "
        f"{same}/{len(compared)} texts as uninterrupted"
    )
    assert migrated >= max(1, running // 2)  # (one may end between the count and the fault)
    if cluster.variant == "shared-tier":
        assert same == len(compared)
        loaded = sum(
            metric(scrape(d.url), "pdserve_kv_tier_hit_tokens_total", medium="shared")
            for d in cluster.decodes
            if d is not victim and d.process is not None and d.process.poll() is None  # (a drained one is closing)
        )
        assert loaded > 0, "no continuation loaded its history from the shared tier"
    else:
        assert same >= len(compared) - 2
    if fault == "drain":
        assert victim.process.wait(60) == 0
    _settle(cluster)
    if victim.process.poll() is not None:  # back for the next round, as its Deployment would bring it
        victim.start()
        victim.wait_healthy()


def _migrations(cluster: Cluster) -> float:
    assert cluster.router is not None
    values = scrape(cluster.router.url)
    return sum(v for k, v in values.items() if k.startswith("pdserve_router_migrations_total"))
