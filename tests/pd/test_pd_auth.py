"""A P/D cluster with keys: real router, two prefill and one decode processes (NIXL) on 127.0.0.1.

Requests through the router go the disaggregated way, every leg signed for its engine. A client that is not the
router cannot use P/D params on an engine (403, and a forged decode leg frees nothing, nor makes the engine dial
the address it names); a leg signed for one engine is refused by another. A stranger on a prefill's side channel
(a handshake, a forged release, a flood) gets no answer and harms nobody: the blocks it tried to free are still
pulled by a real decode leg. The keys roll over, in three steps, under traffic, without a failed request.
Afterwards no engine owns, holds or waits for anything."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest
import zmq

from pdserve.api.auth import ROUTER_AUTH_HEADER
from pdserve.api.protocol import KV_PARAMS_REJECTED_HEADER
from pdserve.kvtransfer import messages
from pdserve.models.demo import ensure_demo_model
from pdserve.testing.metrics import idle, metric
from tests.fuzz.openapi_fuzz import completion_body, prefill_leg_body
from tests.pd.cluster import Cluster, metrics, wait_for

PROMPT = "The keys keep strangers out of the KV cache. " * 3


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # With the tokenizer the router follows the engines' KV events; every prompt is worth a prefill leg.
    router_flags = ("--tokenizer", str(ensure_demo_model()), "--pd-min-prefill-tokens", "0")
    cluster = Cluster.start(
        tmp_path_factory.mktemp("pd-auth"), "nixl", num_prefill=2, keys=True, router_flags=router_flags
    )
    yield cluster
    cluster.stop()


def _post(
    url: str, path: str, body: dict, cluster: Cluster | None = None, headers: dict[str, str] | None = None
) -> tuple[int, dict, dict[str, str]]:
    """POST ``body``; signed as the router signs it for the engine at ``url`` when ``cluster`` is given."""
    data = json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **(headers or {})}
    if cluster is not None:
        headers.update(cluster.router_header(url, path, data))
    request = urllib.request.Request(url + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read()), dict(response.headers)
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read()), dict(error.headers)


def _side_channel(process) -> str:
    return f"tcp://127.0.0.1:{process.argv[process.argv.index('--kv-side-channel-port') + 1]}"


def test_requests_through_the_router_go_disaggregated(cluster):
    status, answer, _ = _post(cluster.router.url, "/v1/completions", completion_body(PROMPT, max_tokens=4))
    assert status == 200, answer
    router = metrics(cluster.router.url)
    assert metric(router, "pdserve_router_requests_total", path="disagg") == 1, router
    assert metric(metrics(cluster.decodes[0].url), "pdserve_kv_transfer_bytes_total") > 0


def test_pd_params_from_anyone_but_the_router_are_refused(cluster):
    prefill, decode = cluster.prefills[0].url, cluster.decodes[0].url
    status, answer, _ = _post(prefill, "/v1/completions", prefill_leg_body(PROMPT))
    assert status == 403 and answer["error"]["param"] == "kv_transfer_params", answer
    assert ROUTER_AUTH_HEADER in answer["error"]["message"]
    # A real hold, then a forged decode leg naming it: refused before anything, and it frees nothing.
    status, leg, _ = _post(prefill, "/v1/completions", prefill_leg_body(PROMPT), cluster)
    assert status == 200, leg
    params = leg["kv_transfer_params"]
    forged = completion_body(PROMPT, max_tokens=2, kv_transfer_params=params)
    status, answer, _ = _post(decode, "/v1/completions", forged)
    assert status == 403, answer
    status, answer, _ = _post(decode, "/v1/completions", {**forged, "max_tokens": "two"})  # does not decode
    assert status == 403, answer
    status, answer, _ = _post(prefill, "/v1/kv_transfer/release", {"kv_transfer_params": params})
    assert status == 403, answer
    assert metrics(prefill)["pdserve_kv_blocks_held_for_remote"] > 0
    # A prefill leg on the decode engine: it hands its KV to no peer.
    status, answer, _ = _post(decode, "/v1/completions", prefill_leg_body(PROMPT), cluster)
    assert status == 400 and "decode role" in answer["error"]["message"], answer
    # The router's signed decode leg uses the params.
    status, answer, headers = _post(decode, "/v1/completions", forged, cluster)
    assert status == 200 and KV_PARAMS_REJECTED_HEADER not in headers, (answer, headers)
    wait_for(lambda: metrics(prefill)["pdserve_kv_blocks_held_for_remote"] == 0, 10, "the pull did not free")


@pytest.mark.parametrize("signed", [False, True], ids=["leg-mac", "ed25519"])
def test_a_signed_leg_replayed_to_another_engine_is_refused(cluster, signed):
    # Before (dbd1dc4): the router's signature named no engine, so a leg captured on its way to one prefill was
    # taken by every other (it held KV for nobody, or worse). Both forms the router sends: a leg MAC (an engine
    # that gives a leg key) and an Ed25519 signature.
    first, second = cluster.prefills[0].url, cluster.prefills[1].url
    body = prefill_leg_body(f"{PROMPT} replayed {signed}")
    data = json.dumps(body).encode()
    captured = cluster.router_header(first, "/v1/completions", data, signed=signed)
    assert len(captured[ROUTER_AUTH_HEADER].split(" ")) == (4 if signed else 5)
    status, answer, headers = _post(second, "/v1/completions", body, headers=captured)
    assert status == 403 and answer["error"]["type"] == "router_auth_target", answer
    assert headers.get("X-PDServe-Engine-Id") == _engine_id(second)  # so the router can make it afresh, once
    assert headers.get("X-PDServe-Engine-Leg-Key") == _health(second)["leg_key"]
    assert metrics(second)["pdserve_kv_blocks_held_for_remote"] == 0
    status, leg, _ = _post(first, "/v1/completions", body, headers=captured)  # where it was meant for: taken
    assert status == 200 and leg["kv_transfer_params"], leg
    status, answer, _ = _post(first, "/v1/completions", body, headers=captured)  # and only once
    assert status == 403 and "replayed" in answer["error"]["message"], answer
    status, _, _ = _post(first, "/v1/kv_transfer/release", {"kv_transfer_params": leg["kv_transfer_params"]}, cluster)
    assert status == 200


def test_a_clients_params_make_a_keyed_engine_dial_nobody(cluster):
    # dbd1dc4's oracle: `pdserve serve --kv-insecure` gave its children a secret and the flag, so its decode engine
    # took P/D params from any HTTP client and sealed a fresh handshake for the client's own socket, which the
    # client replayed to a prefill. An engine with keys takes params from the router only: it dials nothing.
    context = zmq.Context()
    try:
        listener = context.socket(zmq.ROUTER)
        listener.setsockopt(zmq.LINGER, 0)
        port = listener.bind_to_random_port("tcp://127.0.0.1")
        params = {
            "do_remote_prefill": True,
            "remote_engine_id": _engine_id(cluster.prefills[0].url),
            "remote_request_id": "r",
            "remote_host": "127.0.0.1",
            "remote_port": port,
            "remote_block_ids": [0],
            "remote_block_generations": [0],
            "remote_num_tokens": 1,
            "remote_prompt_hash": "h",
            "kv_compat_hash": "c",
            "remote_lease_seconds": 30,
            "remote_hold_token": "t",
        }
        body = completion_body(PROMPT, max_tokens=2, kv_transfer_params=params)
        status, answer, _ = _post(cluster.decodes[0].url, "/v1/completions", body)
        assert status == 403, answer
        assert not listener.poll(1500), "the engine dialled the address a client named"
    finally:
        context.destroy(linger=0)


def test_a_key_rollover_drops_no_request(cluster):
    from pdserve.api.keys import RELOAD_INTERVAL_S, read_bundle, rotate

    assert cluster.keys is not None
    answers: list[int] = []
    stop = threading.Event()

    def traffic() -> None:
        number = 0
        while not stop.is_set():
            body = completion_body(f"rollover {number}: " + PROMPT, max_tokens=2)
            answers.append(_post(cluster.router.url, "/v1/completions", body)[0])
            number += 1

    engines = (*cluster.prefills, *cluster.decodes)

    def refused() -> list[float]:
        return [
            metric(metrics(process.url), "pdserve_kv_side_channel_rejected_total", reason="unauthenticated")
            for process in engines
        ] + [metric(metrics(cluster.router.url), "pdserve_router_kv_events_malformed_total")]

    disagg = metric(metrics(cluster.router.url), "pdserve_router_requests_total", path="disagg")
    refused_before = refused()
    old = read_bundle(cluster.keys / "all")
    thread = threading.Thread(target=traffic)
    thread.start()
    try:
        for step in ("add", "promote", "retire"):
            # Each step waits until every process has re-read the files (and signed with what it read) before
            # the next: what Kubernetes' propagation of a Secret's update is for pods.
            time.sleep(RELOAD_INTERVAL_S + 1.5)
            cluster.write_keys(rotate(read_bundle(cluster.keys / "all"), step))
        time.sleep(RELOAD_INTERVAL_S + 1.5)
    finally:
        stop.set()
        thread.join(60)
    assert len(answers) >= 5 and set(answers) == {200}, answers
    router = metrics(cluster.router.url)
    # Every request went the disaggregated way: no leg, handshake or event was refused for its keys.
    assert metric(router, "pdserve_router_requests_total", path="disagg") - disagg == len(answers)
    assert refused() == refused_before
    assert all(len(text.split()) == 1 for text in read_bundle(cluster.keys / "all").values())
    # The retired router key signs nothing any more.
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from pdserve.api.auth import RouterSigner
    from pdserve.api.keys import KeyRing

    retired = RouterSigner(KeyRing([Ed25519PrivateKey.from_private_bytes(bytes.fromhex(old["router.key"].strip()))]))
    url, body = cluster.prefills[0].url, prefill_leg_body(PROMPT + " retired")
    header = {ROUTER_AUTH_HEADER: retired.header("POST", "/v1/completions", json.dumps(body).encode(), _engine_id(url))}
    status, answer, _ = _post(url, "/v1/completions", body, headers=header)
    assert status == 403 and "bad signature" in answer["error"]["message"], answer


def _health(url: str) -> dict:
    with urllib.request.urlopen(url + "/health", timeout=10) as response:
        return json.loads(response.read())


def _engine_id(url: str) -> str:
    return _health(url)["engine_id"]


def test_a_stranger_on_the_side_channel_gets_nothing_and_harms_nobody(cluster):
    prefill = cluster.prefills[0]
    status, leg, _ = _post(prefill.url, "/v1/completions", prefill_leg_body(PROMPT + " stranger"), cluster)
    assert status == 200, leg
    params = leg["kv_transfer_params"]
    hold = [(params["remote_request_id"], params["remote_hold_token"])]
    receiver = params["remote_engine_id"]
    before = metric(metrics(prefill.url), "pdserve_kv_side_channel_rejected_total", reason="unauthenticated")
    context = zmq.Context()
    try:
        stranger = context.socket(zmq.DEALER)
        stranger.setsockopt(zmq.LINGER, 0)
        stranger.connect(_side_channel(prefill))
        seal = messages.Seal("stranger", None)  # even knowing the hold's token: no key, nothing
        stranger.send(seal.seal(messages.Handshake("stranger", messages.new_challenge()), receiver))
        stranger.send(seal.seal(messages.ReleaseBlocks(hold), receiver))
        for _ in range(3000):  # a flood of forged lease renewals
            stranger.send(seal.seal(messages.RenewLeases(hold), receiver))
        assert not stranger.poll(1500), "the stranger got an answer"
    finally:
        context.destroy(linger=0)
    wait_for(
        lambda: (
            metric(metrics(prefill.url), "pdserve_kv_side_channel_rejected_total", reason="unauthenticated")
            >= before + 3002
        ),
        10,
        "the refusals were not counted",
    )
    # Nothing was released: the decode leg still pulls the blocks, and the router keeps serving meanwhile.
    assert metrics(prefill.url)["pdserve_kv_blocks_held_for_remote"] > 0
    body = completion_body(PROMPT + " stranger", max_tokens=2, kv_transfer_params=params)
    status, answer, headers = _post(cluster.decodes[0].url, "/v1/completions", body, cluster)
    assert status == 200 and KV_PARAMS_REJECTED_HEADER not in headers, (answer, headers)
    status, answer, _ = _post(cluster.router.url, "/v1/completions", completion_body(PROMPT, max_tokens=2))
    assert status == 200, answer


def test_the_router_takes_the_engines_signed_kv_events(cluster):
    wait_for(
        lambda: metric(metrics(cluster.router.url), "pdserve_router_kv_event_batches_total") > 0,
        10,
        "no KV-event batch was applied",
    )
    assert metric(metrics(cluster.router.url), "pdserve_router_kv_events_malformed_total") == 0


def test_nothing_is_left_owned_held_or_waiting(cluster):
    for process in (*cluster.prefills, *cluster.decodes):
        wait_for(lambda process=process: idle(metrics(process.url)), 15, f"{process.name} is not idle")
