"""The transfer layer's own checks, on real agents in this process (TCP transport, real sockets):
a peer whose KV layout differs is refused at the handshake, params that do not match the prompt
or this engine are never pulled from, and frames from the network decode to None, never raise."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.api.kv_events import decode_batch
from pdserve.kvtransfer import messages
from pdserve.kvtransfer.agent import TransferAgent
from pdserve.kvtransfer.config import KVTransferConfig
from pdserve.kvtransfer.decode_side import unusable_reason
from pdserve.kvtransfer.params import RemotePrefill, parse_remote_prefill, prompt_hash
from pdserve.kvtransfer.work import LoadSpec, TransferWork


def _agent(compat_hash: str) -> TransferAgent:
    import torch  # after pdserve, which sets the OpenMP wait policy torch reads once

    return TransferAgent(
        KVTransferConfig(transport="tcp", transfer_timeout=5),
        torch.zeros((8, 64)),
        np.zeros(8, dtype=np.int64),
        compat_hash,
    )


def test_a_peer_with_another_kv_layout_is_refused_at_the_handshake():
    prefill, decode = _agent("layout-a"), _agent("layout-b")
    try:
        prefill.submit(TransferWork(holds=[("r", [1, 2], "token-r")]))
        remote = RemotePrefill(
            prefill.config.engine_id, "r", "127.0.0.1", prefill.port, [1, 2], [0, 0], 32, "", "", 30.0, (), "token-r"
        )
        decode.submit(TransferWork(loads=[LoadSpec("d", remote, [3, 4], [1, 2], [0, 0])]))
        deadline = time.monotonic() + 10
        while True:
            output = decode.collect()
            if output is not None and output.failed_recving:
                break
            assert time.monotonic() < deadline, "the pull neither failed nor finished"
            time.sleep(0.01)
        assert output.failed_recving == {"d"} and not output.finished_recving
        # The refused pull still told the prefill agent to free.
        deadline = time.monotonic() + 10
        while not ((sent := prefill.collect()) is not None and sent.finished_sending == {"r"}):
            assert time.monotonic() < deadline, "prefill was not told to free"
            time.sleep(0.01)
    finally:
        prefill.close()
        decode.close()


def _decode_leg(prompt: list[int]) -> dict:
    """A decode leg's params: three blocks of ``prompt`` held by engine "e" at 127.0.0.1:5000 (TP 1)."""
    return {
        "do_remote_prefill": True,
        "remote_engine_id": "e",
        "remote_request_id": "p",
        "remote_host": "127.0.0.1",
        "remote_port": 5000,
        "remote_block_ids": [0, 1, 2],
        "remote_block_generations": [0, 0, 0],
        "remote_num_tokens": 40,
        "remote_prompt_hash": prompt_hash(prompt),
        "kv_compat_hash": "ours",
        "remote_lease_seconds": 30,
        "remote_hold_token": "t",
    }


def test_params_for_another_prompt_or_engine_are_unusable():
    # The P/D gate (pdserve/server/pd_gate.py) never lets them reach the core: it computes the prompt and
    # tells prefill to free.
    prompt = list(range(40))
    base = _decode_leg(prompt)
    for params, reason in (
        (base | {"remote_prompt_hash": prompt_hash(prompt[::-1])}, "prompt"),
        (base | {"remote_num_tokens": 39}, "prompt"),
        (base | {"kv_compat_hash": "theirs"}, "kv_compat_hash"),
    ):
        remote = parse_remote_prefill(params)
        assert remote is not None and unusable_reason(remote, prompt, "ours", wants_prompt_logprobs=False) == reason


def test_every_prefill_rank_port_is_parsed_and_malformed_ones_are_refused():
    base = _decode_leg(list(range(40)))
    one = parse_remote_prefill(base)
    assert one.tp_size == 1 and one.rank_address(0) == ("127.0.0.1", 5000)  # vLLM's params: one rank
    two = parse_remote_prefill(base | {"remote_ports": [5000, 5007]})
    assert two.tp_size == 2 and two.rank_address(1) == ("127.0.0.1", 5007)
    for ports in ([], [5001, 5002], [5000, 0], [5000, 70000], [5000, "x"], [5000] * 65, "5000"):
        with pytest.raises(ValueError, match="remote_ports"):
            parse_remote_prefill(base | {"remote_ports": ports})


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2048))
def test_network_frames_decode_to_a_message_or_none(frame):
    for decode in (messages.decode, decode_batch):
        decode(frame)  # never raises


def test_oversized_and_deeply_nested_frames_decode_to_none():
    assert messages.decode(b"\x91" * (messages.MAX_MESSAGE_BYTES + 1)) is None
    assert messages.decode(b"\x81\xa1a" * 1000) is None
    assert decode_batch(b"\x81\xa1a" * 1000) is None
