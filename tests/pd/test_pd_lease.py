"""Lease expiry on real processes: the prefill engine holds blocks for 1 s, the decode engine
neither renews nor pulls before 4 s. By then the blocks are freed and reused by other requests,
so the late pull must fail (block generations changed; on TCP the prefill refuses outright) and
the request must be recomputed (or, under ``--kv-load-failure fail``, fail clearly) — never
answered from freed or reused blocks."""

from __future__ import annotations

import threading

import pytest

from pdserve.testing.metrics import scrape
from pdserve.testing.processes import Process
from tests.pd.cluster import Cluster, free_port, post, wait_for

pytestmark = pytest.mark.timeout(600)


# On real processes in make test-slow (make test's time budget), over both transports: make test checks leases
# expiring, renewed and released between two transfer agents in one process (tests/kvtransfer/test_agent.py).
@pytest.fixture(
    scope="module", params=[pytest.param("nixl", marks=pytest.mark.slow), pytest.param("tcp", marks=pytest.mark.slow)]
)
def cluster(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"lease-{request.param}")
    cluster = Cluster.start(
        folder,
        request.param,
        with_router=False,
        prefill_flags=("--kv-lease-seconds", "1"),
        decode_faults="delay_load=4,no_renew",
    )
    # A second decode engine with the other failure policy, same faults.
    template = cluster.decodes[0]
    argv = list(template.argv)
    argv[argv.index("--port") + 1] = str(port := free_port())
    argv[argv.index("--kv-side-channel-port") + 1] = str(free_port())
    failing = Process(
        "decode-fail", [*argv, "--kv-load-failure", "fail"], template.env, port, str(folder / "decode-fail.log")
    )
    failing.start()
    cluster.decodes.append(failing)
    try:
        failing.wait_healthy()
    except BaseException:
        cluster.stop()
        raise
    yield cluster
    cluster.stop()


def _body(prompt: str, **extra) -> dict:
    return {"model": "demo", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, **extra}


def _late_pull(cluster: Cluster, decode_url: str, prompt: str) -> tuple[int, dict]:
    prefill = cluster.prefills[0].url
    status, leg = post(prefill + "/v1/completions", _body(prompt, kv_transfer_params={"do_remote_decode": True}))
    assert status == 200, leg
    answer: list = []
    thread = threading.Thread(
        target=lambda: answer.append(
            post(
                decode_url + "/v1/completions", _body(prompt, kv_transfer_params=leg["kv_transfer_params"]), timeout=60
            )
        )
    )
    thread.start()
    wait_for(lambda: scrape(prefill)["pdserve_kv_blocks_held_for_remote"] == 0, 5, "the lease did not expire")
    for index in range(10):  # other requests take the freed blocks (the cache holds 128 of 16 tokens)
        assert post(prefill + "/v1/completions", _body(f"filler {index} " + "x y z " * 80, max_tokens=1))[0] == 200
    thread.join(60)
    assert not thread.is_alive(), "the late pull hung"
    return answer[0]


def test_a_pull_after_the_lease_expired_recomputes(cluster):
    prompt = "lease expiry: " + " ".join(f"item{i}" for i in range(70))
    status, reference = post(cluster.prefills[0].url + "/v1/completions", _body(prompt))  # colocated answer
    assert status == 200
    decode = cluster.decodes[0].url
    failures = scrape(decode)["pdserve_kv_transfer_failures_total"]
    status, answer = _late_pull(cluster, decode, prompt)
    assert status == 200 and answer["choices"][0]["text"] == reference["choices"][0]["text"]
    assert scrape(decode)["pdserve_kv_transfer_failures_total"] == failures + 1
    assert scrape(cluster.prefills[0].url)["pdserve_kv_lease_expirations_total"] >= 1
    wait_for(lambda: scrape(decode)["pdserve_kv_cache_usage_ratio"] == 0, 10, "decode kept blocks")


def test_under_the_fail_policy_a_late_pull_is_a_clear_error(cluster):
    decode = cluster.decodes[1].url
    status, answer = _late_pull(cluster, decode, "fail policy: " + " ".join(f"thing{i}" for i in range(70)))
    assert status == 503, answer
    assert "KV" in answer["error"]["message"] or "remote" in answer["error"]["message"], answer
    wait_for(lambda: scrape(decode)["pdserve_kv_cache_usage_ratio"] == 0, 10, "decode kept blocks")
    assert scrape(decode)['pdserve_requests_total{finish_reason="error"}'] == 1
