"""Chaos: a NIXL read whose bytes land long after its load was given up never changes another request's tokens.

Real prefill and decode processes, NIXL over UCX's tcp transport (whose read data lands only when the reader's
UCX next makes progress). The decode engine's transfer agent is kept from running for 16 s right after it posts
a pull's read (fault ``stall_after_read``, as a flood or a wedged thread would keep it): the scheduler's watchdog
gives the load up (2 x 1 s timeout + 5 s) and the request computes its prompt itself. Another request then runs
with most of the decode engine's small cache, again and again, across the moment the agent wakes and the late
read lands.

Before (dbd1dc4), the quarantine of the given-up load's blocks ended 3 x timeout after the watchdog: the second
request got those blocks, the read landed in its KV, and it answered with HTTP 200 and other tokens than the
oracle's. Now the blocks stay quarantined until the agent reports the load: every answer equals the same prompt's
on the prefill engine (greedy), and nothing stays held afterwards."""

from __future__ import annotations

import threading
import time

import pytest

from pdserve.testing.metrics import idle, metric, scrape
from tests.fuzz.openapi_fuzz import completion_body, prefill_leg_body
from tests.pd.cluster import Cluster, post, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STALL_S = 16.0
# 16 blocks of 16 tokens. The pulled request takes 6 of them (quarantined when its load is given up); each later
# request 8, one at a time, so that even with the 6 held out none is ever preempted (a recomputed request may
# differ from the oracle by float rounding alone), while the pool's LRU order hands every block out in turn.
FLAGS = ("--kv-cache-memory", "1MiB", "--max-model-len", "256", "--no-enable-prefix-caching")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = Cluster.start(
        tmp_path_factory.mktemp("late-read"),
        "nixl",
        prefill_flags=FLAGS,
        decode_flags=(*FLAGS, "--kv-transfer-timeout", "1"),
        decode_faults=f"stall_after_read={STALL_S}",
        with_router=False,
        engine_env={"UCX_TLS": "tcp,self"},
    )
    yield cluster
    cluster.stop()


def test_a_read_landing_after_its_load_was_given_up_never_changes_another_requests_tokens(cluster):
    prefill, decode = cluster.prefills[0].url, cluster.decodes[0].url
    first = [(11 * i) % 700 + 20 for i in range(96)]  # 6 blocks, pulled
    status, leg = post(f"{prefill}/v1/completions", prefill_leg_body(first))
    assert status == 200 and leg["kv_transfer_params"], leg
    answers: dict[str, tuple[int, dict]] = {}

    def complete(name: str, body: dict) -> None:
        answers[name] = post(f"{decode}/v1/completions", body, timeout=120)

    started = time.monotonic()
    params = leg["kv_transfer_params"]
    pulled = threading.Thread(
        target=complete, args=("first", completion_body(first, max_tokens=2, kv_transfer_params=params))
    )
    pulled.start()
    # The watchdog gives the load up at ~7 s (its old quarantine would have ended at ~10 s); the agent wakes at 16 s.
    wait_for(
        lambda: metric(scrape(decode), "pdserve_kv_loads_abandoned_total") >= 1, 12, "the watchdog did not give up"
    )
    time.sleep(max(0.0, 10.5 - (time.monotonic() - started)))
    # Back to back, one at a time, until well after the wake-up: whichever runs when the late read lands holds some
    # of the given-up load's blocks, if anything gave them out.
    second = [(7 * i) % 700 + 20 for i in range(100)]
    body = completion_body(second, max_tokens=28, temperature=0, ignore_eos=True)  # 128 tokens: 8 blocks
    others = []
    while time.monotonic() - started < STALL_S + 4:
        others.append(post(f"{decode}/v1/completions", body, timeout=120))
    pulled.join(120)
    assert answers["first"][0] == 200, answers["first"]
    oracle_status, oracle = post(f"{prefill}/v1/completions", body, timeout=120)  # the same prompt, elsewhere
    assert oracle_status == 200, oracle
    texts = [answer["choices"][0]["text"] if status == 200 else (status, answer) for status, answer in others]
    assert len(texts) > 3 and texts == [oracle["choices"][0]["text"]] * len(texts)
    wait_for(lambda: idle(scrape(decode)), 30, "decode did not settle")
    assert metric(scrape(decode), "pdserve_kv_blocks_quarantined") == 0
