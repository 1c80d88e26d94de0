"""The P/D gate (pdserve/server/pd_gate.py) on its own, with a stand-in core client: kv_transfer_params are
parsed once into the typed leg the core gets, refused with the status and field the client must fix, screened
once against the prompt, and a refused decode leg's remote blocks released exactly once (never for a 503)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
from aiohttp.test_utils import make_mocked_request

from pdserve.api.peer_kv import PeerKV, prefix_source_params
from pdserve.api.protocol import KV_PARAMS_REJECTED_HEADER, CompletionRequest, ProtocolError
from pdserve.kvtransfer.params import RemotePrefill, parse_remote_prefill, prompt_hash
from pdserve.server.input_processor import InputError
from pdserve.server.metrics import EngineMetrics
from pdserve.server.pd_gate import PDGate, PDLeg, leg_headers
from pdserve.testing.metrics import metric

COMPAT = "compat-ours"
PROMPT = list(range(40))


class _Client:
    """The core client as the gate sees it: the core's compatibility hash, and releases sent."""

    def __init__(self) -> None:
        self.ready = SimpleNamespace(kv_compat_hash=COMPAT)
        self.alive = True
        self.released: list[RemotePrefill] = []

    async def release_remote_blocks(self, remote: RemotePrefill) -> None:
        self.released.append(remote)


def _decode_leg(**overrides: Any) -> dict[str, Any]:
    return {
        "do_remote_prefill": True,
        "remote_engine_id": "prefill-engine",
        "remote_request_id": "prefill-request",
        "remote_host": "10.0.0.7",
        "remote_port": 7000,
        "remote_block_ids": [100, 101, 102],
        "remote_block_generations": [7, 8, 9],
        "remote_num_tokens": len(PROMPT),
        "remote_prompt_hash": prompt_hash(PROMPT),
        "kv_compat_hash": COMPAT,
        "remote_lease_seconds": 30,
        "remote_hold_token": "hold-token",
    } | overrides


def _gate(serves_blocks: bool = False, kv_transfer: bool = True) -> tuple[PDGate, _Client, EngineMetrics]:
    client, metrics = _Client(), EngineMetrics(lambda: None, {})
    return PDGate(client, metrics, kv_transfer, serves_blocks, None), client, metrics


def _body(**fields: Any) -> bytes:
    return msgspec.json.encode({"prompt": "hi", **fields})


def _open(gate: PDGate, raw: bytes) -> tuple[Any, PDLeg, Any]:
    request = make_mocked_request("POST", "/v1/completions")
    body, leg = asyncio.run(gate.open(request, raw, CompletionRequest))
    return body, leg, request


def test_a_decode_leg_is_parsed_once_into_the_typed_value_the_core_gets():
    gate, _, _ = _gate()
    params = _decode_leg()
    _, leg, _ = _open(gate, _body(kv_transfer_params=params))
    assert leg == PDLeg(remote_decode=False, remote_prefill=parse_remote_prefill(params))
    # The value crosses to the core as msgpack, and comes back equal.
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(leg.remote_prefill), type=RemotePrefill) == leg.remote_prefill


SOURCE = {
    "engine_id": "decode-engine",
    "host": "10.0.0.8",
    "ports": [7100],
    "handle": "ab" * 16,
    "num_tokens": 32,
    "reader": "this-engine",
    "expires_at": 1.5e9,
    "capability": "cd" * 64,
}


def test_peer_read_params_are_parsed_into_the_leg():
    gate, _, _ = _gate(serves_blocks=True)
    _, leg, _ = _open(gate, _body(kv_transfer_params={"kv_peer_hold": "ef" * 16}))
    assert leg == PDLeg(peer=PeerKV(hold="ef" * 16))
    _, leg, _ = _open(gate, _body(kv_transfer_params={"do_remote_decode": True, "kv_prefix_source": SOURCE}))
    assert leg.remote_decode and leg.peer is not None and leg.peer.source is not None
    assert prefix_source_params(leg.peer.source) == SOURCE  # what the router sent, read back
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(leg.peer), type=PeerKV) == leg.peer


@pytest.mark.parametrize(
    "params",
    [
        {"kv_peer_hold": "not-a-handle"},
        {"kv_peer_hold": "AB" * 16},
        {"do_remote_decode": True, "kv_peer_hold": "ab" * 16},  # a prefill leg's blocks are its decode's
        {"kv_prefix_source": "somewhere"},
        {"kv_prefix_source": SOURCE | {"ports": [70000]}},
        {"kv_prefix_source": SOURCE | {"num_tokens": 0}},
        {"kv_prefix_source": SOURCE | {"handle": "x"}},
        {"kv_prefix_source": SOURCE | {"capability": "a" * 1000}},
        {"kv_prefix_source": {k: v for k, v in SOURCE.items() if k != "reader"}},
    ],
    ids=[
        "handle",
        "upper-case",
        "on-prefill-leg",
        "not-object",
        "port",
        "no-tokens",
        "source-handle",
        "long",
        "reader",
    ],
)
def test_malformed_peer_read_params_are_a_400(params):
    gate, _, _ = _gate(serves_blocks=True)
    with pytest.raises(InputError) as refused:
        _open(gate, _body(kv_transfer_params=params))
    assert refused.value.param == "kv_transfer_params"


def test_a_prefill_leg_and_a_plain_request_and_an_engine_without_pd():
    gate, _, _ = _gate(serves_blocks=True)
    assert _open(gate, _body(kv_transfer_params={"do_remote_decode": True}))[1] == PDLeg(remote_decode=True)
    assert _open(gate, _body())[1] == PDLeg()
    colocated, _, _ = _gate(kv_transfer=False)  # ignores the params, as vLLM does without a KV connector
    assert _open(colocated, _body(kv_transfer_params=_decode_leg(remote_port=0), n=2))[1] == PDLeg()


@pytest.mark.parametrize(
    ("fields", "serves_blocks", "param"),
    [
        ({"kv_transfer_params": _decode_leg(remote_port=0)}, False, "kv_transfer_params"),
        ({"kv_transfer_params": {"do_remote_prefill": True}}, False, "kv_transfer_params"),
        ({"kv_transfer_params": {"do_remote_decode": True}}, False, "kv_transfer_params"),  # a decode engine
        ({"kv_transfer_params": {"do_remote_decode": True}, "stream": True}, True, "stream"),
        ({"kv_transfer_params": {"do_remote_decode": True}, "n": 2}, True, "n"),
        ({"kv_transfer_params": {"anything": 1}, "n": 2}, False, "n"),
    ],
    ids=["port", "bare", "prefill-leg-on-decode", "streamed-prefill-leg", "prefill-leg-n", "params-n"],
)
def test_params_this_engine_cannot_act_on_are_a_400_naming_the_field(fields, serves_blocks, param):
    gate, client, _ = _gate(serves_blocks)
    with pytest.raises(InputError) as refused:
        _open(gate, _body(**fields))
    assert refused.value.param == param
    assert not client.released


def test_a_decode_leg_refused_at_the_door_frees_its_blocks_once():
    gate, client, _ = _gate()
    params = _decode_leg()
    with pytest.raises(InputError):
        _open(gate, _body(kv_transfer_params=params, n=2))
    with pytest.raises(ProtocolError):  # a body that does not decode still names the hold
        _open(gate, msgspec.json.encode({"prompt": "hi", "max_tokens": "ten", "kv_transfer_params": params}))
    assert client.released == [parse_remote_prefill(params)] * 2


def _screen(gate: PDGate, prompts: list[list[int]], wants_prompt_logprobs: bool = False, **overrides: Any):
    _, leg, request = _open(gate, _body(kv_transfer_params=_decode_leg(**overrides)))
    return asyncio.run(gate.screen(request, leg, prompts, wants_prompt_logprobs)), request, leg


def test_usable_remote_blocks_pass_the_screen_unchanged():
    gate, client, _ = _gate()
    screened, request, leg = _screen(gate, [PROMPT])
    assert screened == leg and screened.remote_prefill is not None
    assert not client.released and leg_headers(request) is None


@pytest.mark.parametrize(
    ("prompts", "prompt_logprobs", "overrides", "reason"),
    [
        ([PROMPT], False, {"kv_compat_hash": "compat-theirs"}, "kv_compat_hash"),
        ([PROMPT], False, {"remote_prompt_hash": prompt_hash(PROMPT[::-1])}, "prompt"),
        ([PROMPT], False, {"remote_num_tokens": 39}, "prompt"),
        ([PROMPT], True, {}, "prompt_logprobs"),
        ([PROMPT, PROMPT], False, {}, "several_prompts"),
    ],
)
def test_unusable_remote_blocks_are_freed_counted_and_said_once(prompts, prompt_logprobs, overrides, reason):
    gate, client, metrics = _gate()
    screened, request, leg = _screen(gate, prompts, prompt_logprobs, **overrides)
    assert screened == PDLeg() and client.released == [leg.remote_prefill]
    assert leg_headers(request) == {KV_PARAMS_REJECTED_HEADER: reason}
    assert metric(metrics.render().decode(), "pdserve_kv_params_rejected_total", reason=reason) == 1

    async def refused_later() -> None:
        async with gate.releasing_refused(request):
            raise InputError("max_tokens", "too many")

    with pytest.raises(InputError):
        asyncio.run(refused_later())
    assert client.released == [leg.remote_prefill]  # already freed: not again


@pytest.mark.parametrize(("status", "released"), [(400, 1), (404, 1), (503, 0)])
def test_a_refusal_frees_the_blocks_unless_it_is_for_now(status, released):
    gate, client, _ = _gate()
    _, _, request = _open(gate, _body(kv_transfer_params=_decode_leg()))

    async def refused() -> None:
        async with gate.releasing_refused(request):
            raise ProtocolError("refused", status)

    with pytest.raises(ProtocolError):
        asyncio.run(refused())
    assert len(client.released) == released
