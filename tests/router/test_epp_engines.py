"""``pdserve epp`` over real engines behind a real Envoy: the picker as its own process (prefix-load over the engines'
KV events, with the tokenizer), Envoy in front. Over 2 `pdserve decode` processes on the demo model, requests sharing
a prefix land on the engine that caches it, and the tokens are the engines' own (the same as asking one directly).
Over a prefill and a decode with keys, the decode pod sends the prefill leg the picker signed, pulls the prompt's KV,
and answers what the decode engine alone answers; a leg the picker did not sign is refused."""

from __future__ import annotations

import contextlib
import json
import random
import urllib.error
import urllib.request

import pytest

from pdserve.api.keys import KEYS_ENV
from pdserve.api.prefill_leg import PREFILL_AUTH_HEADER, PREFILL_VIA_HEADER
from pdserve.models.demo import ensure_demo_model
from pdserve.testing.envoy import Envoy
from pdserve.testing.metrics import scrape
from pdserve.testing.processes import Process
from tests.pd.cluster import Cluster, free_port, post

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

BLOCK = 16
PREFIX_TOKENS = 13 * BLOCK


@contextlib.contextmanager
def _behind_envoy(path, engines: Cluster, env: dict[str, str], *flags: str):
    """``pdserve epp`` over ``engines`` (its own process, with ``flags``) and Envoy in front; yields Envoy."""
    http_port, grpc_port = free_port(), free_port()
    argv = ["epp", "--port", str(http_port), "--grpc-port", str(grpc_port), "--log-level", "warning"]
    argv += ["--tokenizer", str(ensure_demo_model()), *flags]
    argv += [*(["--prefill", *(p.url for p in engines.prefills)] if engines.prefills else [])]
    argv += ["--decode", *(d.url for d in engines.decodes)]
    picker = Process("epp", argv, env, http_port, str(path / "epp.log"))
    envoy = None
    try:
        picker.start()
        picker.wait_healthy(60)
        envoy = Envoy(path, free_port(), grpc_port, free_port())
        envoy.wait_ready()
        yield envoy
    finally:
        if envoy is not None:
            envoy.stop()
        picker.stop()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    path = tmp_path_factory.mktemp("epp")
    engines = Cluster.start(path, "tcp", 0, 2, with_router=False)
    try:
        with _behind_envoy(path, engines, engines.decodes[0].env) as envoy:
            yield engines, envoy
    finally:
        engines.stop()


def _complete(url: str, prompt: list[int]) -> dict:
    body = {"model": "demo", "prompt": prompt, "max_tokens": 6, "temperature": 0}
    status, answer = post(url + "/v1/completions", body)
    assert status == 200, answer
    return answer


def test_same_prefix_lands_where_it_is_cached_and_tokens_are_the_engines(gateway):
    engines, envoy = gateway
    rng = random.Random(3)
    for _ in range(3):
        prefix = [rng.randrange(10, 1000) for _ in range(PREFIX_TOKENS)]
        prompts = [prefix + [rng.randrange(10, 1000) for _ in range(rng.randrange(20, 60))] for _ in range(4)]
        answers = [_complete(envoy.url, prompt) for prompt in prompts]
        # The first computes the prefix on one engine; the picker sends the others there.
        assert all(a["usage"]["prompt_tokens_details"]["cached_tokens"] == PREFIX_TOKENS for a in answers[1:])
        direct = _complete(engines.decodes[0].url, prompts[-1])
        assert answers[-1]["choices"][0]["text"] == direct["choices"][0]["text"]


@pytest.fixture(scope="module")
def pd_gateway(tmp_path_factory):
    """1 prefill + 1 decode with keys, the picker holding the router's (it signs the prefill legs), Envoy."""
    path = tmp_path_factory.mktemp("epp-pd")
    engines = Cluster.start(path, "tcp", 1, 1, with_router=False, keys=True)
    try:
        env = dict(engines.decodes[0].env, **{KEYS_ENV: str(engines.keys / "router")})
        with _behind_envoy(path, engines, env, "--pd-min-prefill-tokens", "0") as envoy:
            yield engines, envoy
    finally:
        engines.stop()


def test_pd_through_the_gateway_gives_the_tokens_of_one_engine_and_only_the_picker_can_start_a_leg(pd_gateway):
    engines, envoy = pd_gateway
    decode = engines.decodes[0]
    rng = random.Random(5)
    prompt = [rng.randrange(10, 1000) for _ in range(300)]
    through = _complete(envoy.url, prompt)
    values = scrape(decode.url)
    assert values['pdserve_gateway_prefill_total{outcome="disagg"}'] == 1  # the decode pod ran the prefill leg
    assert (
        scrape(engines.prefills[0].url)["pdserve_kv_transfer_bytes_total"] > 0
        or values.get("pdserve_kv_transfer_bytes_total", 0) > 0
    )  # and pulled the prompt's KV
    chat = {"model": "demo", "messages": [{"role": "user", "content": "word " * 300}], "max_tokens": 4}
    status, answer = post(envoy.url + "/v1/chat/completions", chat)
    assert status == 200, answer
    assert scrape(decode.url)['pdserve_gateway_prefill_total{outcome="disagg"}'] == 2
    # The same prompt decoded by the decode engine alone (its own prefill) gives the same tokens.
    alone = _complete(decode.url, prompt[:-1] + [prompt[-1]])
    assert through["choices"][0]["text"] == alone["choices"][0]["text"]
    # A client that reaches the decode pod itself cannot make it send a leg the picker did not sign.
    headers = {"Content-Type": "application/json", PREFILL_VIA_HEADER: engines.prefills[0].url}
    request = urllib.request.Request(
        decode.url + "/v1/completions",
        data=json.dumps({"model": "demo", "prompt": prompt, "max_tokens": 2}).encode(),
        headers={**headers, PREFILL_AUTH_HEADER: "1 2 3 00"},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 403
