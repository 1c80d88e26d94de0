"""KV from another checkpoint is never used: engines pair by a compatibility hash that covers the
weights (a fingerprint of every tensor), not only the architecture and shapes. Two checkpoints of
the same shape from different seeds (a rolling upgrade's old and new revisions, an A/B pair of
fine-tunes) get different hashes; the router never pairs them, and a decode engine refuses both
their params and their handshake, computing the prompt itself instead of generating from the
other model's KV with HTTP 200."""

from __future__ import annotations

import json
import shutil
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest

from pdserve.launcher import free_port
from pdserve.models.demo import SEED, ensure_demo_model, write_demo_model
from pdserve.models.fingerprint import weights_fingerprint
from pdserve.testing.metrics import metric, scrape
from pdserve.testing.processes import Process, engine_argv, router_argv, server_env
from tests.pd.cluster import ENGINE_FLAGS, post

pytestmark = pytest.mark.timeout(600)

PROMPT = "the compatibility of two engines is a matter of their weights " * 6


def test_the_fingerprint_tells_same_shaped_checkpoints_apart(tmp_path):
    demo = ensure_demo_model()
    copy = tmp_path / "copy"
    shutil.copytree(demo, copy)
    other = write_demo_model(tmp_path / "other", seed=SEED + 1)
    assert weights_fingerprint(copy) == weights_fingerprint(demo)
    assert weights_fingerprint(other) != weights_fingerprint(demo)
    # The last bytes of the last tensor alone change it too.
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01
    weights.write_bytes(bytes(data))
    assert weights_fingerprint(copy) != weights_fingerprint(demo)


@contextmanager
def _engines_behind_a_router(tmp_path, engines: dict[str, tuple[str, str, tuple[str, ...]]], decodes: list[str]):
    """Start ``engines`` (name -> (role, model folder, extra flags)) on the demo model's settings and
    a router over them (the ``decodes`` names as its decode pods, the other engines as prefills,
    in the given order); yields every process by name, the router as "router"."""
    env = server_env()
    processes = {}
    for name, (role, folder, flags) in engines.items():
        port = free_port()
        argv = engine_argv(role, port, folder, *ENGINE_FLAGS, *flags, transport="tcp")
        processes[name] = Process(name, argv, env, port, str(tmp_path / f"{name}.log"))
    try:
        for process in processes.values():
            process.start()
        for process in processes.values():
            process.wait_healthy()
        prefills = [processes[name].url for name in engines if name not in decodes]
        port = free_port()
        argv = router_argv(port, prefills, [processes[name].url for name in decodes], "--pd-min-prefill-tokens", "1")
        processes["router"] = Process("router", argv, env, port, str(tmp_path / "router.log"))
        processes["router"].start()
        processes["router"].wait_healthy()
        yield processes
    finally:
        for process in processes.values():
            process.stop()


@pytest.fixture(scope="module")
def pair_of_models(tmp_path_factory):
    """decode + prefill on the demo model, a second prefill on a same-shaped other checkpoint
    (served under the same name, as in a rollout), and a router over all of them."""
    tmp_path = tmp_path_factory.mktemp("compat")
    model = str(ensure_demo_model())
    other = str(write_demo_model(tmp_path / "pdserve-demo-qwen3-v2", seed=SEED + 1))
    # A short lease: the forged read below leaves a hold nobody releases (draining waits for it).
    lease = ("--kv-lease-seconds", "5")
    engines = {
        "decode": ("decode", model, lease),
        "other": ("prefill", other, lease),
        "same": ("prefill", model, lease),
    }
    with _engines_behind_a_router(tmp_path, engines, decodes=["decode"]) as processes:
        yield processes


def _post_with_headers(url: str, prompt: str, params: dict) -> tuple[int, dict, dict[str, str]]:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "kv_transfer_params": params}
    request = urllib.request.Request(
        f"{url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as answer:
        return answer.status, json.loads(answer.read()), dict(answer.headers)


def _completion(url: str, prompt: str, **extra) -> dict:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **extra}
    status, body = post(f"{url}/v1/completions", body)
    assert status == 200, body
    return body


@pytest.mark.slow
def test_engines_advertise_their_hash_and_it_covers_the_weights(pair_of_models):
    def compat(name: str) -> str:
        with urllib.request.urlopen(f"{pair_of_models[name].url}/health", timeout=5) as answer:
            return json.loads(answer.read())["kv_compat_hash"]

    assert compat("decode") == compat("same") != compat("other")


def _prefill_choices(values: dict[str, float], url: str) -> float:
    return sum(
        value
        for series, value in values.items()
        if series.startswith("pdserve_router_choices_total{") and 'role="prefill"' in series and f'"{url}"' in series
    )


@pytest.mark.slow
def test_the_router_pairs_only_engines_of_one_hash(pair_of_models):
    router = pair_of_models["router"]
    expected = _completion(pair_of_models["decode"].url, PROMPT)["choices"][0]["text"]  # computed locally
    for number in range(6):
        answer = _completion(router.url, PROMPT + str(number))
        assert answer["choices"][0]["text"]
    assert _completion(router.url, PROMPT)["choices"][0]["text"] == expected
    values = scrape(router.url)
    assert _prefill_choices(values, pair_of_models["same"].url) == 7
    assert _prefill_choices(values, pair_of_models["other"].url) == 0
    assert metric(values, "pdserve_router_requests_total", path="disagg") == 7


@pytest.mark.slow
def test_a_decode_engine_never_pulls_another_checkpoints_kv(pair_of_models):
    decode = pair_of_models["decode"]
    expected = _completion(decode.url, PROMPT)["choices"][0]["text"]
    # A prefill leg on the other checkpoint, its params handed to decode directly.
    leg = _completion(pair_of_models["other"].url, PROMPT, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    params = leg["kv_transfer_params"]
    before = scrape(decode.url)
    status, answer, headers = _post_with_headers(decode.url, PROMPT, params)
    assert status == 200 and answer["choices"][0]["text"] == expected
    assert headers["X-PDServe-KV-Params-Rejected"] == "kv_compat_hash"  # the router counts it as no P/D
    assert metric(scrape(decode.url), "pdserve_kv_params_rejected_total", reason="kv_compat_hash") == 1
    # Params of the same checkpoint pointing at the other engine's side channel: refused at the handshake.
    same_leg = _completion(
        pair_of_models["same"].url, PROMPT, max_tokens=1, kv_transfer_params={"do_remote_decode": True}
    )
    forged = dict(
        same_leg["kv_transfer_params"],
        remote_port=params["remote_port"],
        remote_ports=params["remote_ports"],
        remote_host=params["remote_host"],
    )
    assert _completion(decode.url, PROMPT, kv_transfer_params=forged)["choices"][0]["text"] == expected
    after = scrape(decode.url)
    assert metric(after, "pdserve_kv_transfer_bytes_total") == metric(before, "pdserve_kv_transfer_bytes_total")
    assert (
        metric(after, "pdserve_kv_transfer_failures_total") == metric(before, "pdserve_kv_transfer_failures_total") + 1
    )


@pytest.fixture(scope="module")
def two_versions(tmp_path_factory):
    """A rollout half done: prefill + decode on the demo model (old) and on a same-shaped other
    checkpoint (new), all served under one name, behind one router."""
    tmp_path = tmp_path_factory.mktemp("rollout")
    old = str(ensure_demo_model())
    new = str(write_demo_model(tmp_path / "pdserve-demo-qwen3-v2", seed=SEED + 1))
    engines = {
        f"{version}-{role}": (role, folder, ())
        for version, folder in (("old", old), ("new", new))
        for role in ("prefill", "decode")
    }
    with _engines_behind_a_router(tmp_path, engines, decodes=["old-decode", "new-decode"]) as processes:
        yield processes


@pytest.mark.slow
def test_during_a_rollout_every_request_stays_within_one_version(two_versions):
    router = two_versions["router"]
    # Concurrent requests, so that both decode engines take some (the router spreads by load).
    with ThreadPoolExecutor(max_workers=4) as pool:
        answers = list(pool.map(lambda n: _completion(router.url, f"{PROMPT} request {n}"), range(16)))
    assert all(answer["choices"][0]["text"] for answer in answers)
    values = scrape(router.url)
    for version in ("old", "new"):
        decode_url, prefill_url = two_versions[f"{version}-decode"].url, two_versions[f"{version}-prefill"].url
        decoded = sum(
            value
            for series, value in values.items()
            if series.startswith("pdserve_router_choices_total{")
            and 'role="decode"' in series
            and f'"{decode_url}"' in series
        )
        # Each request's prefill leg went to the prefill engine of its decode engine's version ...
        assert decoded > 0 and _prefill_choices(values, prefill_url) == decoded, version
        # ... so no decode engine was handed another version's KV.
        decode_values = scrape(decode_url)
        assert metric(decode_values, "pdserve_kv_params_rejected_total", reason="kv_compat_hash") == 0
        assert metric(decode_values, "pdserve_kv_transfer_failures_total") == 0
    assert metric(values, "pdserve_router_requests_total", path="disagg") == 16
