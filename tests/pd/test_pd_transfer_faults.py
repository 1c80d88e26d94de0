"""Faults in the transfer path itself, on real processes over the TCP transport: a handshake the
prefill refuses, block bytes that arrive corrupted or cut short, and a side channel that accepts
the connection but never answers. Each must end in a recomputed answer (the default policy)
within a bound — never a hang, never tokens computed from bad bytes — and leave nothing held.

One decode engine; one prefill engine per fault (faults are fixed when a process starts)."""

from __future__ import annotations

import time

import pytest
import zmq

from pdserve.models.demo import ensure_demo_model
from pdserve.testing.metrics import scrape
from pdserve.testing.processes import Process, engine_argv, server_env
from tests.pd.cluster import ENGINE_FLAGS, free_port, post, wait_for

pytestmark = pytest.mark.timeout(600)

FAULTS = ("fail_handshake", "corrupt_blocks", "truncate_blocks")


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    folder = tmp_path_factory.mktemp("transfer-faults")
    model = str(ensure_demo_model())
    env = server_env()
    processes = {}
    for name in ("decode", *FAULTS):
        role = "decode" if name == "decode" else "prefill"
        port = free_port()
        # A short lease: the silent-peer test leaves a hold nobody releases, and stopping a prefill
        # engine waits for its holds to end.
        flags = ("--kv-transfer-timeout", "3", "--kv-lease-seconds", "6")
        argv = engine_argv(role, port, model, *flags, *ENGINE_FLAGS, transport="tcp")
        process_env = env if name == "decode" else dict(env, PDSERVE_KV_FAULTS=name)
        processes[name] = Process(name, argv, process_env, port, str(folder / f"{name}.log"))
    try:
        for process in processes.values():
            process.start()
        for process in processes.values():
            process.wait_healthy()
            wait_for(
                lambda url=process.url: "pdserve_kv_transfer_failures_total" in scrape(url),
                10,
                "the engine published no stats",
            )
        yield processes
    finally:
        for process in processes.values():
            process.stop()


def _body(prompt: str, **extra) -> dict:
    return {"model": "demo", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True} | extra


def _prefill_leg(url: str, prompt: str) -> dict:
    status, answer = post(url + "/v1/completions", _body(prompt, kv_transfer_params={"do_remote_decode": True}))
    assert status == 200, answer
    return answer["kv_transfer_params"]


def _decode_with(engines, prompt: str, params: dict) -> tuple[str, float]:
    decode = engines["decode"].url
    failures = scrape(decode)["pdserve_kv_transfer_failures_total"]
    started = time.monotonic()
    status, answer = post(decode + "/v1/completions", _body(prompt, kv_transfer_params=params), timeout=60)
    elapsed = time.monotonic() - started
    assert status == 200, answer
    wait_for(
        lambda: scrape(decode)["pdserve_kv_transfer_failures_total"] == failures + 1,
        5,
        "the fault was not counted as a failed transfer",
    )
    return answer["choices"][0]["text"], elapsed


@pytest.mark.parametrize("fault", FAULTS)
def test_a_fault_in_the_transfer_ends_in_a_recompute(engines, fault):
    prefill = engines[fault].url
    prompt = f"{fault}: " + " ".join(f"piece{i}" for i in range(60))
    reference = post(prefill + "/v1/completions", _body(prompt))[1]["choices"][0]["text"]  # colocated answer
    text, elapsed = _decode_with(engines, prompt, _prefill_leg(prefill, prompt))
    assert text == reference and elapsed < 30
    # The decode told the prefill to free (or the read itself released the blocks).
    wait_for(lambda: scrape(prefill)["pdserve_kv_blocks_held_for_remote"] == 0, 10, "prefill kept the blocks")
    assert scrape(prefill)["pdserve_kv_lease_expirations_total"] == 0  # freed by the decode, not the lease
    assert scrape(engines["decode"].url)["pdserve_kv_cache_usage_ratio"] == 0 or wait_for(
        lambda: scrape(engines["decode"].url)["pdserve_kv_cache_usage_ratio"] == 0, 10, "decode kept blocks"
    )


def test_a_side_channel_that_never_answers_times_out_and_recomputes(engines):
    prefill = engines["corrupt_blocks"].url
    prompt = "silent peer: " + " ".join(f"bit{i}" for i in range(60))
    reference = post(prefill + "/v1/completions", _body(prompt))[1]["choices"][0]["text"]
    context = zmq.Context()
    silent = context.socket(zmq.ROUTER)  # accepts connections and messages, answers nothing
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        params = _prefill_leg(prefill, prompt) | {"remote_port": port, "remote_ports": [port]}
        text, elapsed = _decode_with(engines, prompt, params)
        assert text == reference and elapsed < 30  # bounded by --kv-transfer-timeout 3
    finally:
        silent.close(linger=0)
        context.term()
