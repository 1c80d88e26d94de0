"""The router's choice of a prefill leg's peer source (``router.peer_holds``), over a KV index filled by hand: the
decode pod that held turn 1 is the source for turn 2 when it holds more of turn 2's prompt than the prefill pod,
with a capability the holder's check accepts for that prefill engine only; never a pod that is down, of another
model, restarted, past its hold time, or holding less than the reader."""

from __future__ import annotations

import time

from pdserve.api.auth import RouterSigner, capability_problem
from pdserve.api.keys import load_router_public, load_router_signing, new_bundle, write_bundle
from pdserve.router.kv_index import KVIndex, PodIndex
from pdserve.router.peer_holds import PeerHolds
from pdserve.router.pods import PeerSource, Pod
from pdserve.router.prompt import Prompt

BLOCK = 4
TURN_1 = list(range(100, 121))  # 21 tokens: 5 whole blocks the engine may serve (never the last token)
ANSWER = list(range(200, 209))
TURN_2 = TURN_1 + ANSWER + list(range(300, 313))


def _setup(reader_blocks: int = 0, holder_blocks: int | None = None):
    index = KVIndex()
    reader = Pod("http://prefill", "prefill", compat_hash="c", engine_id="prefill-engine")
    holder = Pod(
        "http://decode",
        "decode",
        compat_hash="c",
        engine_id="decode-engine",
        peer_source=PeerSource("10.0.0.2", [7000], 300.0),
    )
    hashes = Prompt(TURN_2).hashes(BLOCK)
    held = len(hashes) if holder_blocks is None else holder_blocks
    index.pods[holder.url] = PodIndex("decode-engine", BLOCK, set(hashes[:held]))
    index.pods[reader.url] = PodIndex("prefill-engine", BLOCK, set(hashes[:reader_blocks]))
    holds = PeerHolds(index)
    handle = holds.handle_for(holder)
    assert handle is not None and len(handle) == 32
    holds.record(holder, handle, Prompt(TURN_1))
    return holds, reader, holder, handle


def _unsigned(reader: str, holder: str, handle: str, expires_at: float) -> str:
    return ""


def test_the_decode_that_held_turn_1_is_turn_2s_source(tmp_path):
    write_bundle(tmp_path, new_bundle())
    holds, reader, holder, handle = _setup(reader_blocks=5)
    signer = RouterSigner(load_router_signing(tmp_path))
    source = holds.source_for(Prompt(TURN_2), reader, [holder], signer.capability)
    assert source is not None
    cached = (len(TURN_2) - 1) // BLOCK  # every whole block but the one with the last token
    assert source["num_tokens"] == cached * BLOCK
    assert (source["engine_id"], source["host"], source["ports"], source["handle"]) == (
        "decode-engine",
        "10.0.0.2",
        [7000],
        handle,
    )
    assert source["reader"] == "prefill-engine"
    assert 0 < source["expires_at"] - time.time() <= 120
    keys = load_router_public(tmp_path)
    args = (source["capability"], "prefill-engine", "decode-engine", handle, source["expires_at"])
    assert capability_problem(keys, *args) is None
    assert capability_problem(keys, source["capability"], "another", "decode-engine", handle, source["expires_at"])


def test_no_source_when_the_reader_has_as_much_or_the_holder_cannot_serve():
    holds, reader, holder, _ = _setup(reader_blocks=(len(TURN_2) - 1) // BLOCK)
    assert holds.source_for(Prompt(TURN_2), reader, [holder], _unsigned) is None  # the reader has it all
    holds, reader, holder, _ = _setup()
    prompt = Prompt(TURN_2)
    assert holds.source_for(prompt, reader, [holder], _unsigned) is not None
    holder.healthy = False
    assert holds.source_for(prompt, reader, [holder], _unsigned) is None
    holder.healthy, holder.compat_hash = True, "another-model"
    assert holds.source_for(prompt, reader, [holder], _unsigned) is None
    holder.compat_hash, holder.engine_id = "c", "restarted"  # its holds died with the old run
    assert holds.source_for(prompt, reader, [holder], _unsigned) is None
    holder.engine_id = "decode-engine"
    assert holds.source_for(Prompt(list(range(500, 540))), reader, [holder], _unsigned) is None  # another chat


def test_a_hold_is_forgotten_when_its_time_is_up(monkeypatch):
    holds, reader, holder, _ = _setup()
    later = time.monotonic() + 301
    monkeypatch.setattr("pdserve.router.peer_holds.time.monotonic", lambda: later)
    assert holds.source_for(Prompt(TURN_2), reader, [holder], _unsigned) is None


def test_a_pod_that_serves_no_peers_gets_no_hold():
    assert PeerHolds(KVIndex()).handle_for(Pod("http://decode", "decode", engine_id="e")) is None
