"""The router continuing a broken stream (pdserve/router/decode_leg.py), against decode stubs that send token
comments and answer continuations as engines do (tests/router/helpers.py; real engines: tests/pd/
test_pd_migration.py): what the next pod is sent, which pod it is, what the client gets, and where it stops."""

from __future__ import annotations

import asyncio
import json

import aiohttp

from pdserve.testing.metrics import metric
from tests.router.helpers import metrics_text

BODY = {"model": "demo", "prompt": "hello", "max_tokens": 8, "stream": True}


def _read(loop, router) -> bytes:
    async def read() -> bytes:
        received = b""
        async with (
            aiohttp.ClientSession() as session,
            session.post(router.url + "/v1/completions", json=BODY) as response,
        ):
            assert response.status == 200
            try:
                async for chunk in response.content.iter_any():
                    received += chunk
            except aiohttp.ClientPayloadError:  # a cut stream: what came before it is the answer
                pass
        return received

    return loop.run(read())


def _texts(received: bytes) -> list[str]:
    events = [json.loads(e[6:]) for e in received.split(b"\n\n") if e.startswith(b"data: {")]
    return [c["text"] for event in events for c in event.get("choices", [])]


def test_a_broken_stream_goes_on_from_another_pod_with_the_tokens_the_client_has(loop, cluster):
    first, second = cluster.stub("decode"), cluster.stub("decode")
    first.die_after = 3
    router = cluster.router([], [first.url, second.url], routing="round-robin")
    received = _read(loop, router)
    assert _texts(received) == [f"t{i} " for i in range(8)]  # each token once, in order
    assert b"pdserve-tokens" not in received and received.endswith(b"data: [DONE]\n\n")
    (continued,) = [seen for seen in second.seen if (seen.body.get("kv_transfer_params") or {}).get("continue")]
    assert continued.body["kv_transfer_params"]["continue"] == {
        "id": "c1",
        "created": 1,
        "choices": [{"index": 0, "token_ids": [100, 101, 102]}],
    }
    assert continued.body["prompt"] == "hello" and continued.headers["X-PDServe-Tokens"] == "1"
    text = metrics_text(loop, router)
    assert metric(text, "pdserve_router_migrations_total", cause="broken") == 1
    assert metric(text, "pdserve_router_errors_total", kind="stream_cut") == 0


def test_a_stream_continues_on_a_pod_of_its_revision_while_there_is_one(loop, cluster):
    old, new, old_too = cluster.stub("decode"), cluster.stub("decode"), cluster.stub("decode")
    old.compat_hash = old_too.compat_hash = "rev-1"
    new.compat_hash = "rev-2"
    old.die_after = 2
    router = cluster.router([], [old.url, new.url, old_too.url], routing="round-robin", health_interval=0.2)
    loop.run(_health_seen(router))
    assert _texts(_read(loop, router)) == [f"t{i} " for i in range(8)]
    assert [s for s in old_too.seen if s.body.get("kv_transfer_params")]
    assert not [s for s in new.seen if s.body.get("kv_transfer_params")]
    assert metric(metrics_text(loop, router), "pdserve_router_migrations_across_revisions_total") == 0


def test_with_none_of_its_revision_left_a_stream_continues_on_another_and_says_so(loop, cluster):
    last_old, new = cluster.stub("decode"), cluster.stub("decode")
    last_old.compat_hash, new.compat_hash = "rev-1", "rev-2"
    last_old.die_after = 5
    router = cluster.router([], [last_old.url, new.url], routing="round-robin", health_interval=0.2)
    loop.run(_health_seen(router))
    assert _texts(_read(loop, router)) == [f"t{i} " for i in range(8)]
    assert [s for s in new.seen if s.body.get("kv_transfer_params")]
    assert metric(metrics_text(loop, router), "pdserve_router_migrations_across_revisions_total") == 1


async def _health_seen(router) -> None:
    """Until the router's health probes have read every pod's compatibility hash."""
    for _ in range(100):
        if all(pod.compat_hash for pod in router.router.decode.pods):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the router never read the pods' compatibility hashes")


def test_a_continuation_refused_as_the_clients_error_ends_the_stream_with_it(loop, cluster):
    first, second = cluster.stub("decode"), cluster.stub("decode")
    first.die_after, second.continue_status = 4, 400
    router = cluster.router([], [first.url, second.url], routing="round-robin")
    received = _read(loop, router)
    assert _texts(received) == [f"t{i} " for i in range(4)]
    assert b'"code": 400' in received and received.endswith(b"data: [DONE]\n\n")


def test_continuations_stop_at_the_limit_and_the_client_sees_a_cut_stream(loop, cluster):
    stubs = [cluster.stub("decode") for _ in range(4)]
    for number, stub in enumerate(stubs):
        stub.die_after = 1 + number  # each pod breaks one token further on
    router = cluster.router([], [s.url for s in stubs], routing="round-robin", migration_limit=2)
    received = _read(loop, router)
    texts = _texts(received)  # three legs (the first and two continuations), each broken after its pod's limit
    assert texts == [f"t{i} " for i in range(len(texts))] and 3 <= len(texts) < 8
    assert b"[DONE]" not in received
    text = metrics_text(loop, router)
    assert metric(text, "pdserve_router_migrations_total", cause="broken") == 2
    assert metric(text, "pdserve_router_errors_total", kind="stream_cut") == 1


def test_without_migration_a_broken_stream_is_cut_and_no_tokens_are_asked_for(loop, cluster):
    first, second = cluster.stub("decode"), cluster.stub("decode")
    first.die_after = 3
    router = cluster.router([], [first.url, second.url], routing="round-robin", migration_limit=0)
    received = _read(loop, router)
    assert _texts(received) == ["t0 ", "t1 ", "t2 "] and b"[DONE]" not in received
    assert "X-PDServe-Tokens" not in first.seen[0].headers
    assert not second.seen


def test_an_engines_server_error_mid_stream_is_held_back_and_the_stream_continues(loop, cluster):
    first, second = cluster.stub("decode"), cluster.stub("decode")
    first.error_after = 5
    router = cluster.router([], [first.url, second.url], routing="round-robin")
    received = _read(loop, router)
    assert _texts(received) == [f"t{i} " for i in range(8)] and b"error" not in received
    assert metric(metrics_text(loop, router), "pdserve_router_migrations_total", cause="engine_error") == 1
