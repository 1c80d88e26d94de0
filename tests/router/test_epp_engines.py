"""``pdserve epp`` over real engines behind a real Envoy: 2 `pdserve decode` processes on the demo model, the picker
as its own process (prefix-load over the engines' KV events, with the tokenizer), Envoy in front. Requests sharing a
prefix land on the engine that caches it, and the tokens are the engines' own (the same as asking one directly)."""

from __future__ import annotations

import random

import pytest

from pdserve.models.demo import ensure_demo_model
from pdserve.testing.envoy import Envoy
from pdserve.testing.processes import Process
from tests.pd.cluster import Cluster, free_port, post

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

BLOCK = 16
PREFIX_TOKENS = 13 * BLOCK


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    path = tmp_path_factory.mktemp("epp")
    engines = Cluster.start(path, "tcp", 0, 2, with_router=False)
    picker = envoy = None
    try:
        http_port, grpc_port = free_port(), free_port()
        argv = ["epp", "--port", str(http_port), "--grpc-port", str(grpc_port), "--log-level", "warning"]
        argv += ["--tokenizer", str(ensure_demo_model()), "--decode", *(d.url for d in engines.decodes)]
        picker = Process("epp", argv, engines.decodes[0].env, http_port, str(path / "epp.log"))
        picker.start()
        picker.wait_healthy(60)
        envoy = Envoy(path, free_port(), grpc_port, free_port())
        envoy.wait_ready()
        yield engines, envoy
    finally:
        if envoy is not None:
            envoy.stop()
        if picker is not None:
            picker.stop()
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
