"""The router over real sockets on 127.0.0.1. Stubs stand in for the prefill and decode engines here
(tests/router/helpers.py); real engines behind the router are covered by the end-to-end P/D tests."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from typing import Any

import aiohttp
import msgspec
import openai
import pytest

from pdserve.testing.metrics import metric
from tests.router.helpers import KV_PARAMS, free_port_url, get, metrics_text, post, settles, stream_bytes


def assert_openai_error(payload: bytes, status: int) -> dict[str, Any]:
    error = msgspec.json.decode(payload)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    return error


@pytest.fixture
def pd(cluster):
    prefill, decode = cluster.stub("prefill"), cluster.stub("decode")
    return prefill, decode, cluster.router([prefill.url], [decode.url])


@pytest.mark.parametrize("stream", [False, True])
def test_a_decode_that_did_not_use_the_params_is_counted_as_a_fallback_not_disaggregated(loop, pd, stream):
    _, decode, router = pd
    decode.answer_headers = {"X-PDServe-KV-Params-Rejected": "kv_compat_hash"}
    body = {"model": "demo", "prompt": "hi", "max_tokens": 4, "stream": stream}
    status, _, _ = loop.run(post(router.url + "/v1/completions", body))
    assert status == 200 and decode.seen[0].body["kv_transfer_params"] == KV_PARAMS
    text = metrics_text(loop, router)
    assert metric(text, "pdserve_router_requests_total", path="disagg") == 0
    assert metric(text, "pdserve_router_requests_total", path="fallback") == 1
    assert metric(text, "pdserve_router_errors_total", kind="decode_rejected_params") == 1


def test_completions_legs_rewritten_and_params_passed_unchanged(loop, pd):
    prefill, decode, router = pd
    body = {
        "model": "demo",
        "prompt": "hi",
        "max_tokens": 20,
        "n": 1,
        "min_tokens": 3,
        "temperature": 0,
        "stream_options": {"include_usage": True},
        "seed": None,
        "x_custom": {"keep": [1, 2]},
    }
    status, headers, payload = loop.run(post(router.url + "/v1/completions", body, {"X-Request-Id": "req-42"}))
    assert status == 200 and headers["Content-Type"].startswith("application/json")
    assert msgspec.json.decode(payload)["choices"][0]["text"] == "t0 t1 t2 t3 t4 t5 t6 t7 "
    assert prefill.seen[0].path == "/v1/completions"
    assert prefill.seen[0].body == {
        "model": "demo",
        "prompt": "hi",
        "max_tokens": 1,
        "temperature": 0,
        "seed": None,
        "x_custom": {"keep": [1, 2]},
        "stream": False,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    assert decode.seen[0].body == {**body, "kv_transfer_params": KV_PARAMS}  # the extra field included
    assert prefill.seen[0].headers["X-Request-Id"] == decode.seen[0].headers["X-Request-Id"] == "req-42"
    assert headers["X-Request-ID"] == "req-42"
    text = metrics_text(loop, router)
    assert metric(text, "pdserve_router_requests_total", path="disagg") == 1
    assert metric(text, "pdserve_router_request_latency_seconds_count") == 1


def test_the_prefill_leg_drops_what_the_prefill_engine_would_drop(loop, pd):
    # The prefill-leg field contract (pdserve/api/prefill_leg.py): the fields that could end a leg before its one
    # token by length leave the leg at the router too, so a prefill engine of any kind hands the prompt over.
    from pdserve.api.prefill_leg import ENDING_FIELDS
    from pdserve.engine.sampling_params import SamplingParams

    prefill, decode, router = pd
    ending = {"stop": ["."], "stop_token_ids": [7], "min_tokens": 2}
    assert set(ending) == set(ENDING_FIELDS) <= set(SamplingParams.__dataclass_fields__)
    body = {"prompt": "hi", "max_tokens": 5, **ending}
    status, _, _ = loop.run(post(router.url + "/v1/completions", body))
    assert status == 200
    assert prefill.seen[0].body == {
        "prompt": "hi",
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    assert decode.seen[0].body == {**body, "kv_transfer_params": KV_PARAMS}


def test_chat_legs_and_generated_request_id(loop, pd):
    prefill, decode, router = pd
    body = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9, "stream": False}
    status, headers, payload = loop.run(post(router.url + "/v1/chat/completions", body))
    assert status == 200
    assert msgspec.json.decode(payload)["choices"][0]["message"]["content"].startswith("t0 ")
    assert prefill.seen[0].body == {
        "messages": body["messages"],
        "max_tokens": 1,
        "max_completion_tokens": 1,
        "stream": False,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    assert decode.seen[0].body == {**body, "kv_transfer_params": KV_PARAMS}
    request_id = headers["X-Request-ID"]
    assert re.fullmatch("[0-9a-f]{32}", request_id)
    assert prefill.seen[0].headers["X-Request-Id"] == decode.seen[0].headers["X-Request-Id"] == request_id


def test_streaming_passes_bytes_through(loop, pd):
    prefill, decode, router = pd
    body = {"prompt": [1, 2, 3], "stream": True, "stream_options": {"include_usage": True}}
    status, headers, payload = loop.run(post(router.url + "/v1/completions", body))
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    assert payload == stream_bytes("/v1/completions", 8)  # byte for byte, [DONE] included
    assert prefill.seen[0].body["stream"] is False and "stream_options" not in prefill.seen[0].body
    assert decode.seen[0].body == {**body, "kv_transfer_params": KV_PARAMS}


def test_openai_client_streams_chat_through_the_router(loop, cluster):
    prefill, decode = cluster.stub("prefill"), cluster.stub("decode")
    router = cluster.router([prefill.url], [decode.url], api_key="sk-test")
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="sk-test", max_retries=0, timeout=10)
    chunks = list(
        client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "".join(f"t{i} " for i in range(8))
    assert chunks[-1].choices[0].finish_reason == "length"
    assert prefill.seen[0].headers["Authorization"] == decode.seen[0].headers["Authorization"] == "Bearer sk-test"
    assert decode.seen[0].body["kv_transfer_params"] == KV_PARAMS
    assert [m.id for m in client.models.list().data] == ["demo"]


def test_decode_only_when_one_prefill_leg_cannot_serve(loop, cluster):
    prefill, decode = cluster.stub("prefill"), cluster.stub("decode")
    router = cluster.router([prefill.url], [decode.url])
    local = [
        {"prompt": "hi", "n": 2},
        {"prompt": "hi", "echo": True, "logprobs": 1},
        {"prompt": ["a", "b"]},
        {"prompt": [[1, 2], [3]]},
    ]
    for body in local:
        raw = msgspec.json.encode(body)
        assert loop.run(post(router.url + "/v1/completions", raw))[0] == 200
    assert prefill.seen == []
    assert [seen.body for seen in decode.seen] == local  # the client's bodies, untouched
    loop.run(post(router.url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 3}))
    assert prefill.seen == []
    prefill.kv_params = None  # prefill finished without holding blocks (say, it sampled EOS): decode prefills
    loop.run(post(router.url + "/v1/completions", {"prompt": "hi"}))
    assert len(prefill.seen) == 1 and "kv_transfer_params" not in decode.seen[-1].body
    text = metrics_text(loop, router)
    assert metric(text, "pdserve_router_requests_total", path="decode_only") == 6
    assert metric(text, "pdserve_router_requests_total", path="disagg") == 0

    no_prefill = cluster.router([], [decode.url])
    assert loop.run(post(no_prefill.url + "/v1/completions", {"prompt": "hi", "stream": True}))[2] == stream_bytes(
        "/v1/completions", 8
    )
    assert metric(metrics_text(loop, no_prefill), "pdserve_router_requests_total", path="decode_only") == 1


def test_pods_of_different_kv_cache_dtypes_do_not_pair_and_the_log_says_why_once(loop, cluster, caplog):
    """--kv-cache-dtype differs between the pools: the compatibility hashes differ, so the decode pod prefills
    (no_compatible_prefill), and the router names both dtypes in one warning, not one per request."""
    prefill, decode = cluster.stub("prefill"), cluster.stub("decode")
    prefill.compat_hash, prefill.kv_cache_dtype = "bf16-cache", "bfloat16"
    decode.compat_hash, decode.kv_cache_dtype = "fp32-cache", "float32"
    router = cluster.router([prefill.url], [decode.url], health_interval=0.2)

    async def dtypes_seen() -> None:
        while not all(pod.kv_cache_dtype for pod in (*router.router.prefill.pods, *router.router.decode.pods)):
            await asyncio.sleep(0.05)

    loop.run(asyncio.wait_for(dtypes_seen(), 10))
    for _ in range(3):
        assert loop.run(post(router.url + "/v1/completions", {"prompt": "hi"}))[0] == 200
    assert prefill.seen == [] and len(decode.seen) == 3
    assert metric(metrics_text(loop, router), "pdserve_router_errors_total", kind="no_compatible_prefill") == 3
    warnings = [r.getMessage() for r in caplog.records if "--kv-cache-dtype" in r.getMessage()]
    assert len(warnings) == 1 and "stores KV as float32 but the prefill pods as bfloat16" in warnings[0], warnings


def test_a_hung_prefill_costs_its_timeout_then_decode_prefills_and_the_pod_leaves_rotation(loop, cluster):
    prefill, decode = cluster.stub("prefill"), cluster.stub("decode")
    prefill.delay = 30.0  # answers nothing in time: a stopped or wedged pod
    router = cluster.router([prefill.url], [decode.url], prefill_timeout=0.5, health_interval=60.0)
    body = {"prompt": "hi", "max_tokens": 4}
    started = time.monotonic()
    assert loop.run(post(router.url + "/v1/completions", body))[0] == 200
    assert time.monotonic() - started < 5
    assert decode.seen[-1].body == body  # decode-only: its own prompt, no params
    text = metrics_text(loop, router)
    assert metric(text, "pdserve_router_requests_total", path="fallback") == 1
    assert metric(text, "pdserve_router_errors_total", kind="prefill_timeout") == 1
    assert metric(text, "pdserve_router_pod_ejections_total") == 1
    # Out of rotation until a health probe passes: the next request does not wait on it again.
    started = time.monotonic()
    assert loop.run(post(router.url + "/v1/completions", body))[0] == 200
    assert time.monotonic() - started < 0.4 and len(prefill.seen) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_decode_pod_hung_before_its_first_byte_loses_the_request_to_another_once_its_probe_fails(
    loop, cluster, stream
):
    hung, live = cluster.stub("decode"), cluster.stub("decode")
    router = cluster.router([], [hung.url, live.url], routing="round-robin", health_interval=0.3)
    hung.wait_before_answer, hung.hung = 60.0, True  # stopped after the router saw it: accepts, answers nothing
    body = {"prompt": "hi", "max_tokens": 4, "stream": stream}
    started = time.monotonic()
    status, _, payload = loop.run(post(router.url + "/v1/completions", body))
    # The probe times out (0.5 s) at the next check: the leg goes to the live pod then, not after 600 s.
    assert status == 200 and time.monotonic() - started < 5, payload
    assert len(hung.seen) == 1 and len(live.seen) == 1 and live.seen[0].body == body
    text = metrics_text(loop, router)
    assert metric(text, "pdserve_router_errors_total", kind="decode_hung") == 1
    assert metric(text, "pdserve_router_retries_total") == 1


def test_the_default_prefill_timeout_follows_the_prompt_and_the_pods_measured_speed():
    from pdserve.router.config import RouterConfig
    from pdserve.router.pods import Pod
    from pdserve.router.prefill_leg import prefill_timeout

    config = RouterConfig([], ["http://d"])
    pod = Pod("http://p", "prefill")
    short, long = prefill_timeout(config, pod, 100), prefill_timeout(config, pod, 4000)
    assert 2 <= short <= 3 < long  # a few seconds at most for a short prompt on an unmeasured pod
    pod.prefill_speed = 10_000.0
    assert prefill_timeout(config, pod, 4000) < long
    assert prefill_timeout(RouterConfig([], ["http://d"], prefill_timeout=7.0), pod, 100) == 7.0


def test_a_client_leaving_between_the_legs_makes_the_router_free_the_prefill_blocks(loop, pd):
    # Decode never answers before the client leaves, so it may never have had the params: only the
    # router can tell prefill to free (before, the blocks waited for the lease).
    prefill, decode, router = pd
    decode.wait_before_answer = 5.0

    async def leave() -> None:
        async with aiohttp.ClientSession() as session:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.5):
                    await session.post(router.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4})

    loop.run(leave())
    assert settles(lambda: prefill.released == [KV_PARAMS["remote_request_id"]])
    assert metric(metrics_text(loop, router), "pdserve_router_prefill_releases_total", outcome="sent") == 1


def test_fallback_when_prefill_fails_or_is_down(loop, cluster):
    prefill, decode = cluster.stub("prefill"), cluster.stub("decode")
    prefill.status = 500
    router = cluster.router([prefill.url], [decode.url])
    body = {"prompt": "hi", "max_tokens": 4}
    assert loop.run(post(router.url + "/v1/completions", body))[0] == 200
    assert decode.seen[-1].body == body
    text = metrics_text(loop, router)
    assert metric(text, "pdserve_router_requests_total", path="fallback") == 1
    assert metric(text, "pdserve_router_errors_total", kind="prefill_5xx") == 1

    late = cluster.stub("prefill")
    dies = cluster.router([late.url], [decode.url], health_interval=60)  # no health check in between
    loop.run(late.stop())
    for _ in range(2):  # refused (and taken out), then not tried at all
        assert loop.run(post(dies.url + "/v1/completions", body))[0] == 200
        assert decode.seen[-1].body == body
    text = metrics_text(loop, dies)
    assert metric(text, "pdserve_router_requests_total", path="fallback") == 2
    assert metric(text, "pdserve_router_requests_total", path="disagg") == 0
    assert metric(text, "pdserve_router_errors_total", kind="prefill_unreachable") == 1
    assert metric(text, "pdserve_router_errors_total", kind="no_prefill") == 1
    assert metric(text, "pdserve_router_pod_ejections_total") == 1

    down = cluster.router([free_port_url()], [decode.url])  # down from the first health check on
    assert loop.run(post(down.url + "/v1/completions", body))[0] == 200
    text = metrics_text(loop, down)
    assert metric(text, "pdserve_router_requests_total", path="fallback") == 1
    assert metric(text, "pdserve_router_pod_ejections_total") == 1


def test_4xx_answers_pass_through(loop, pd):
    prefill, decode, router = pd
    prefill.status = 400
    status, _, payload = loop.run(post(router.url + "/v1/completions", {"prompt": "hi"}, {"X-Request-Id": "a"}))
    assert status == 400 and assert_openai_error(payload, 400)["message"] == "stub says 400"
    assert decode.seen == []  # an invalid request: decode would say the same
    prefill.status, decode.status = 200, 404
    status, headers, payload = loop.run(post(router.url + "/v1/completions", {"prompt": "hi", "stream": True}))
    assert status == 404 and assert_openai_error(payload, 404)["message"] == "stub says 404"
    assert "X-Request-ID" in headers


def test_router_refuses_malformed_bodies_itself(loop, pd):
    prefill, decode, router = pd
    url = router.url + "/v1/completions"
    for body, param, words in [
        (b"{not json", None, "not valid JSON"),
        (b"[1]", None, "Expected `object`"),
        (b"{}", None, "missing required field `prompt`"),
        (b'{"prompt": "x", "max_tokens": "ten"}', "max_tokens", "max_tokens"),
        (b'{"prompt": []}', "prompt", "prompt"),
    ]:
        status, _, payload = loop.run(post(url, body))
        assert status == 400, body
        error = assert_openai_error(payload, 400)
        assert error["type"] == "invalid_request_error" and error["param"] == param and words in error["message"]
    status, _, payload = loop.run(post(router.url + "/v1/chat/completions", {"messages": "hi"}))
    assert status == 400 and assert_openai_error(payload, 400)["param"] == "messages"
    status, _, payload = loop.run(post(url, b'{"prompt": "' + b"a" * (5 << 20) + b'"}'))
    assert status == 413 and assert_openai_error(payload, 413)
    status, payload = loop.run(get(router.url + "/v1/nothing"))
    assert status == 404 and assert_openai_error(payload, 404)
    assert prefill.seen == decode.seen == []


def test_api_key(loop, cluster):
    prefill, decode = cluster.stub("prefill"), cluster.stub("decode")
    router = cluster.router([prefill.url], [decode.url], api_key="sk-1")
    for headers in [None, {"Authorization": "Bearer sk-2"}, {"Authorization": "sk-1"}]:
        status, _, payload = loop.run(post(router.url + "/v1/completions", {"prompt": "hi"}, headers))
        assert status == 401 and assert_openai_error(payload, 401)["type"] == "authentication_error"
    assert loop.run(get(router.url + "/v1/models"))[0] == 401
    assert prefill.seen == decode.seen == []
    good = {"Authorization": "Bearer sk-1"}
    assert loop.run(post(router.url + "/v1/completions", {"prompt": "hi"}, good))[0] == 200
    assert prefill.seen[0].headers["Authorization"] == decode.seen[0].headers["Authorization"] == "Bearer sk-1"
    assert loop.run(get(router.url + "/health"))[0] == 200  # probes need no key
    assert loop.run(get(router.url + "/metrics"))[0] == 200


def test_models_health_openapi_metrics(loop, cluster):
    decode = cluster.stub("decode")
    router = cluster.router([], [decode.url])
    status, payload = loop.run(get(router.url + "/v1/models"))
    assert status == 200 and msgspec.json.decode(payload)["data"][0]["id"] == "demo"
    status, payload = loop.run(get(router.url + "/health"))
    assert status == 200 and msgspec.json.decode(payload) == {"status": "ok"}
    status, payload = loop.run(get(router.url + "/openapi.json"))
    assert status == 200 and "/v1/chat/completions" in msgspec.json.decode(payload)["paths"]
    text = metrics_text(loop, router)
    for path in ("disagg", "decode_only", "fallback"):  # pre-initialized: dashboards see 0, not nothing
        assert f'pdserve_router_requests_total{{path="{path}"}} 0.0' in text
    assert "pdserve_router_pod_ejections_total 0.0" in text

    dead = cluster.router([], [free_port_url()], connect_timeout=2, health_interval=2.5)
    assert loop.run(get(dead.url + "/health"))[0] == 503
    status, headers, payload = loop.run(post(dead.url + "/v1/completions", {"prompt": "hi"}))
    assert status == 503 and assert_openai_error(payload, 503)["type"] == "service_unavailable"
    assert headers["Retry-After"] == "3"  # one health probe away: a pod that left rotation may be back by then
    assert loop.run(get(dead.url + "/v1/models"))[0] == 503


def test_dead_decode_pod_is_skipped_for_a_live_one(loop, cluster):
    prefill, first, second = cluster.stub("prefill"), cluster.stub("decode"), cluster.stub("decode")
    router = cluster.router([prefill.url], [first.url, second.url], health_interval=60)  # no check in between
    loop.run(first.stop())  # dies after the router saw it healthy
    for stream in (False, True, False, True):
        assert loop.run(post(router.url + "/v1/completions", {"prompt": "hi", "stream": stream}))[0] == 200
    assert len(second.seen) == 4
    text = metrics_text(loop, router)
    assert metric(text, "pdserve_router_errors_total", kind="decode_unreachable") == 1
    assert metric(text, "pdserve_router_pod_ejections_total") == 1
    assert metric(text, "pdserve_router_requests_total", path="disagg") == 4


def test_an_overloaded_decode_pod_sends_the_request_to_another_or_its_503_on(loop, cluster):
    prefill, busy, free = cluster.stub("prefill"), cluster.stub("decode"), cluster.stub("decode")
    busy.status = 503  # overloaded or draining: it answers 503 + Retry-After before generating anything
    router = cluster.router([prefill.url], [busy.url, free.url], health_interval=60)
    for _ in range(3):
        assert loop.run(post(router.url + "/v1/completions", {"prompt": "hi", "stream": True}))[0] == 200
    assert len(free.seen) == 3
    alone = cluster.router([prefill.url], [busy.url], health_interval=60)
    status, headers, payload = loop.run(post(alone.url + "/v1/completions", {"prompt": "hi"}))
    assert status == 503 and headers["Retry-After"] == "2"
    assert_openai_error(payload, 503)
    assert metric(metrics_text(loop, router), "pdserve_router_errors_total", kind="decode_unavailable") >= 1


def test_client_disconnect_mid_stream_cancels_decode(loop, pd):
    _, decode, router = pd
    decode.tokens, decode.delay = 400, 0.02  # 8 s if nobody stops it

    async def read_a_little() -> None:
        async with aiohttp.ClientSession() as session:
            response = await session.post(router.url + "/v1/completions", json={"prompt": "hi", "stream": True})
            assert (await response.content.readany()).startswith(b"data: ")
            response.close()  # drops the connection mid-stream

    loop.run(read_a_little())
    assert decode.cancelled.wait(3), "the decode leg kept running after the client left"
    assert settles(lambda: router.router.decode.pods[0].in_flight == 0, 3.0)


def test_client_disconnect_during_prefill_cancels_it(loop, pd):
    prefill, decode, router = pd
    prefill.delay = 10

    async def give_up() -> None:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(post(router.url + "/v1/completions", {"prompt": "hi"}), 0.3)

    loop.run(give_up())
    assert prefill.cancelled.wait(3), "the prefill leg kept running after the client left"
    assert decode.seen == []
    assert settles(
        lambda: metric(metrics_text(loop, router), "pdserve_router_errors_total", kind="client_disconnect") == 1, 3.0
    )


def test_request_timeout_bounds_the_whole_request(loop, cluster):
    prefill, decode = cluster.stub("prefill"), cluster.stub("decode")
    prefill.delay = 10
    router = cluster.router([prefill.url], [decode.url], request_timeout=0.3)
    status, _, payload = loop.run(post(router.url + "/v1/completions", {"prompt": "hi"}))
    assert status == 504 and assert_openai_error(payload, 504)["type"] == "timeout"
    assert prefill.cancelled.wait(3) and decode.seen == []


def test_answers_cut_short_end_the_client_connection(loop, cluster):
    """A stream that cannot finish (deadline, decode pod gone) must not look finished to the client."""
    prefill, decode = cluster.stub("prefill"), cluster.stub("decode")
    router = cluster.router([prefill.url], [decode.url], request_timeout=0.5)

    async def read_stream() -> bytes:
        received = b""
        async with (
            aiohttp.ClientSession() as session,
            session.post(router.url + "/v1/completions", json={"prompt": "hi", "stream": True}) as response,
        ):
            assert response.status == 200
            with pytest.raises(aiohttp.ClientPayloadError):
                async for chunk in response.content.iter_any():
                    received += chunk
        return received

    decode.tokens, decode.delay = 100, 0.02  # 2 s, past the deadline
    received = loop.run(read_stream())
    assert received.startswith(b"data: ") and b"[DONE]" not in received
    assert decode.cancelled.wait(3)
    decode.cancelled.clear()
    decode.delay, decode.die_after = 0.0, 3
    received = loop.run(read_stream())
    assert received.count(b"data: ") <= 3 and b"[DONE]" not in received
    text = metrics_text(loop, router)
    assert metric(text, "pdserve_router_errors_total", kind="timeout") == 1
    assert metric(text, "pdserve_router_errors_total", kind="decode_broken") == 1
