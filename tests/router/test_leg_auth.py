"""The router's credential on the legs it sends engines with keys (pdserve/api/auth.py), against stub engines that
check it as engines do: a leg MAC for an engine whose /health gave a leg key, and, when the engine restarted since
(a new id and leg key), one refused leg and the same leg made again for the new run."""

from __future__ import annotations

from pdserve.api.auth import ROUTER_AUTH_HEADER
from pdserve.api.keys import load_router_public, new_bundle, write_bundle
from tests.router.helpers import post, settles


def _forms(stub) -> list[int]:
    """The field count of each credential a stub took: 5 for a leg MAC, 4 for an Ed25519 signature."""
    return [len(seen.headers[ROUTER_AUTH_HEADER].split(" ")) for seen in stub.seen]


def test_the_router_macs_each_leg_for_its_engine_and_follows_a_restart(loop, cluster, tmp_path):
    write_bundle(tmp_path, new_bundle())
    prefill = cluster.stub("prefill", router_public=load_router_public(tmp_path))
    decode = cluster.stub("decode", router_public=load_router_public(tmp_path))
    # A health interval longer than the test: the router learns a restart only from the engine's refusal.
    router = cluster.router([prefill.url], [decode.url], keys_dir=str(tmp_path), health_interval=3600)
    pods = [*router.router.prefill.pods, *router.router.decode.pods]
    assert settles(lambda: all(pod.leg_key for pod in pods)), [(pod.url, pod.leg_key) for pod in pods]
    body = {"model": "demo", "prompt": "hello", "max_tokens": 4, "stream": True}
    status, _, payload = loop.run(post(router.url + "/v1/completions", body))
    assert status == 200, payload
    assert _forms(prefill) == [5] and _forms(decode) == [5]  # MACs, not signatures

    prefill.restart()
    decode.restart()
    status, _, payload = loop.run(post(router.url + "/v1/completions", body))
    assert status == 200, payload
    # Each leg was refused once as made for the previous run, then made for the new one (a MAC again).
    assert _forms(prefill) == [5, 5] and _forms(decode) == [5, 5]
    assert {(pod.engine_id, pod.leg_key) for pod in pods} == {
        (stub.engine_id, stub.verifier.leg_key) for stub in (prefill, decode)
    }
