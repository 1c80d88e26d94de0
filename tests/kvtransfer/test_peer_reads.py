"""Peer reads between real transfer agents (TCP on 127.0.0.1, the deployment's keys): a holder serves a finished
turn's blocks under the router's handle to the one engine a router capability names, and to nobody else.

Refused, each with the holder's reason and nothing read: a capability for another engine (presented by an engine
that has the side-channel key, under either name), one signed with another deployment's router key, an expired
one, another handle, a prompt whose hash differs, blocks past the hold, another model's reader, a hold dropped by
the scheduler, and blocks freed meanwhile (generations). A stranger without the key gets no answer at all. A hold
ends when its time is up (reported to the scheduler, as a prefill hold's lease is)."""

from __future__ import annotations

import hashlib
import logging
import time

import msgspec
import pytest

from pdserve.api.auth import RouterSigner
from pdserve.api.keys import load_router_signing
from pdserve.api.peer_kv import PrefixSource
from pdserve.kvtransfer import messages
from pdserve.kvtransfer.work import PeerHold, PeerLoad, TransferWork
from tests.kvtransfer.agents import COMPAT, Engine, assert_untouched, engines
from tests.kvtransfer.test_agent_auth import Stranger

HANDLE = "ab" * 16
HASHES = [hashlib.sha256(bytes([i])).digest() for i in range(4)]  # the held blocks' chained hashes


def _hold(holder: Engine, request_id: str = "turn-1", handle: str = HANDLE) -> None:
    """The holder's scheduler keeps blocks 1, 2, 3 of a finished turn for peers."""
    blocks = [1, 2, 3]
    hold = PeerHold(request_id, handle, blocks, HASHES[:3], holder.generations[blocks].tolist())
    holder.agent.submit(TransferWork(peer_holds=[hold]))
    if holder.config.peer_hold_seconds > 0:
        # Taken by the agent's thread (in an engine, a step after the request ended: long before a next turn).
        deadline = time.monotonic() + 5.0
        while request_id not in holder.agent.holds.served:
            assert time.monotonic() < deadline, "the hold was not taken"
            time.sleep(0.005)


def _source(
    holder: Engine, reader_id: str, router_keys: str, *, handle: str = HANDLE, expires_in: float = 60.0
) -> PrefixSource:
    expires_at = time.time() + expires_in
    capability = RouterSigner(load_router_signing(router_keys)).capability(
        reader_id, holder.config.engine_id, handle, expires_at
    )
    return PrefixSource(
        holder.config.engine_id, "127.0.0.1", (holder.agent.port,), handle, 48, reader_id, expires_at, capability
    )


def _unsigned_source(holder: Engine, reader: Engine) -> PrefixSource:
    """A source for a deployment without keys (only a capability's times are checked)."""
    return PrefixSource(
        holder.config.engine_id,
        "127.0.0.1",
        (holder.agent.port,),
        HANDLE,
        48,
        reader.config.engine_id,
        time.time() + 60,
    )


def _read(reader: Engine, source: PrefixSource, request_id: str = "r", first: int = 0, count: int = 3) -> None:
    local = list(range(4, 4 + count))
    load = PeerLoad(request_id, source, first, local, HASHES[first + count - 1])
    reader.agent.submit(TransferWork(peer_loads=[load]))
    reader.wait_for(lambda seen: request_id in seen.finished_recving | seen.failed_recving, "the peer read")


def test_the_reader_the_router_named_reads_the_held_blocks(keys):
    import torch

    with engines(
        {"filled": True, "keys_dir": keys, "peer_hold_seconds": 30.0}, {"filled": False, "keys_dir": keys}
    ) as (holder, reader):
        _hold(holder)
        _read(reader, _source(holder, reader.config.engine_id, keys))
        assert reader.seen.finished_recving == {"r"}
        for local, held in zip([4, 5, 6], [1, 2, 3], strict=True):
            assert torch.equal(reader.block(local), holder.block(held))
        assert_untouched(reader, 4, 5, 6)
        # Read again (another turn's prefill): a read renews, never ends, the hold.
        _read(reader, _source(holder, reader.config.engine_id, keys), "r2", first=1, count=2)
        assert "r2" in reader.seen.finished_recving
        assert torch.equal(reader.block(4), holder.block(2))
        served = holder.poll()
        assert not served.finished_sending and not served.rejected_messages


@pytest.fixture
def refusals(caplog):
    """The holder's reasons for the reads it refused (it logs each)."""
    caplog.set_level(logging.INFO, logger="pdserve.kvtransfer.served")

    def reasons() -> list[str]:
        return [r.getMessage().split("refused: ", 1)[1] for r in caplog.records if "refused: " in r.getMessage()]

    return reasons


def _refused(reader: Engine, source: PrefixSource, first: int = 0, count: int = 3, last_hash: bytes = b"") -> None:
    import torch

    before = reader.kv_cache.clone()
    request_id = f"r{time.monotonic_ns()}"
    local = list(range(4, 4 + count))
    load = PeerLoad(request_id, source, first, local, last_hash or HASHES[min(first + count, len(HASHES)) - 1])
    reader.agent.submit(TransferWork(peer_loads=[load]))
    reader.wait_for(lambda seen: request_id in seen.finished_recving | seen.failed_recving, "the peer read")
    assert request_id in reader.seen.failed_recving
    assert torch.equal(reader.kv_cache, before), "a refused read wrote into the reader's cache"


def test_every_read_the_capability_does_not_cover_is_refused(keys, wrong_keys, refusals):
    with engines(
        {"filled": True, "keys_dir": keys, "peer_hold_seconds": 30.0},
        {"filled": False, "keys_dir": keys},
        {"filled": False, "keys_dir": keys},
        {"filled": False, "keys_dir": keys, "compat": "another-model"},
    ) as (holder, reader, other, foreign):
        _hold(holder)
        mine = reader.config.engine_id
        # The capability names the reader; another keyed engine presenting it is refused.
        _refused(other, _source(holder, mine, keys))
        # Its own name on it, signed by another deployment's router.
        _refused(other, _source(holder, other.config.engine_id, wrong_keys))
        _refused(reader, _source(holder, mine, keys, expires_in=-120.0))
        _refused(reader, _source(holder, mine, keys, expires_in=3600.0))
        _refused(reader, _source(holder, mine, keys, handle="cd" * 16))
        tampered = _source(holder, mine, keys)
        _refused(reader, msgspec.structs.replace(tampered, expires_at=tampered.expires_at + 100.0))
        _refused(reader, _source(holder, mine, keys), first=1, count=3)  # past the hold's three blocks
        _refused(reader, _source(holder, mine, keys), count=2, last_hash=HASHES[3])  # another prompt
        _refused(foreign, _source(holder, foreign.config.engine_id, keys))
        assert refusals() == [
            "the capability is for another engine",
            "capability refused: bad signature",
            "capability refused: expired",
            "capability refused: valid for too long",
            "nothing is held under this handle (expired, dropped, or never held)",
            "capability refused: bad signature",
            "the hold does not have these blocks",
            "the held tokens differ from the reader's prompt",
            "incompatible KV cache (model, dtype, block size or layout differ)",
        ]
        # Every refusal was answered (the reader did not wait for its timeout) and nothing was counted as junk.
        assert not holder.poll().rejected_messages


def test_dropped_or_freed_blocks_are_never_served(keys, refusals):
    with engines(
        {"filled": True, "keys_dir": keys, "peer_hold_seconds": 30.0}, {"filled": False, "keys_dir": keys}
    ) as (holder, reader):
        _hold(holder)
        holder.generations[2] += 1  # the scheduler freed block 2 (and may have reused it)
        _refused(reader, _source(holder, reader.config.engine_id, keys))
        _hold(holder, "turn-2", "ef" * 16)
        holder.agent.submit(TransferWork(peer_unholds=["turn-2"]))  # dropped for room
        _refused(reader, _source(holder, reader.config.engine_id, keys, handle="ef" * 16))
        assert refusals() == [
            "the held blocks were freed",
            "nothing is held under this handle (expired, dropped, or never held)",
        ]


def test_a_stranger_gets_no_answer(keys, wrong_keys):
    from pdserve.api.keys import ENGINE_KEY, load_secret

    with engines({"filled": True, "keys_dir": keys, "peer_hold_seconds": 30.0}) as (holder,):
        _hold(holder)
        source = _source(holder, "stranger", keys)
        stranger = Stranger(holder.agent.port)
        try:
            for seal in (
                messages.Seal("stranger", None),
                messages.Seal("stranger", load_secret(wrong_keys, ENGINE_KEY)),
            ):
                read = messages.ReadPrefix(
                    "r", HANDLE, "stranger", source.expires_at, source.capability, COMPAT, 0, 3, HASHES[2]
                )
                stranger.send(seal.seal(read, holder.agent.agent_id))
            assert stranger.answers(1.0) == []
        finally:
            stranger.close()
        holder.wait_for(lambda seen: seen.rejected_messages.get("unauthenticated", 0) >= 2, "the refusals")


def test_a_hold_ends_when_its_time_is_up():
    with engines({"filled": True, "peer_hold_seconds": 0.3}, {"filled": False}) as (holder, reader):
        _hold(holder)
        holder.wait_for(lambda seen: seen.finished_sending == {"turn-1"}, "the hold's end", timeout=3.0)
        _refused(reader, _unsigned_source(holder, reader))


def test_an_engine_that_serves_no_peers_refuses_and_releases_at_once():
    with engines({"filled": True, "peer_hold_seconds": 0.0}, {"filled": False}) as (holder, reader):
        _hold(holder)
        holder.wait_for(lambda seen: seen.finished_sending == {"turn-1"}, "the hold given back")
        _refused(reader, _unsigned_source(holder, reader))


def test_an_unanswered_read_times_out():
    import zmq

    context = zmq.Context()
    silent = context.socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        with engines({"filled": False, "transfer_timeout": 0.5}) as (reader,):
            source = PrefixSource("gone", "127.0.0.1", (port,), HANDLE, 48, reader.config.engine_id, time.time() + 60)
            started = time.monotonic()
            _refused(reader, source)
            assert time.monotonic() - started < 3.0
    finally:
        context.destroy(linger=0)
