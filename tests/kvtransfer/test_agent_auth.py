"""The side channel with a cluster secret: real agents over TCP on 127.0.0.1, and peers played by hand.

A peer that cannot seal with the secret gets no answer at all (not even an error), cannot release or read a hold,
and cannot replay what an engine sent; a decode-role engine tells no peer where its memory is; a message from an
older incarnation of an engine is refused, and a reply from another incarnation than the one that hand-shook fails
its pull at once. Each refusal is counted by reason."""

from __future__ import annotations

import time
from unittest import mock

import zmq

from pdserve.kvtransfer import messages
from pdserve.kvtransfer.work import TransferWork
from tests.kvtransfer.agents import BLOCK_BYTES, NUM_BLOCKS, assert_untouched, engines, load

SECRET = b"the-cluster-secret-for-tests"
WRONG = b"a-secret-of-another-cluster"


class _HourSlowClock:
    """A sender whose clock is an hour behind (or a frame captured an hour ago)."""

    @staticmethod
    def time() -> float:
        return time.time() - 3600.0


class Stranger:
    """A DEALER on an engine's side channel that sends what it is told and listens for answers."""

    def __init__(self, port: int) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(f"tcp://127.0.0.1:{port}")

    def send(self, *frames: bytes) -> None:
        self.socket.send_multipart(list(frames))

    def answers(self, seconds: float) -> list[list[bytes]]:
        end, answers = time.monotonic() + seconds, []
        while time.monotonic() < end:
            if self.socket.poll(20):
                answers.append(self.socket.recv_multipart())
        return answers

    def close(self) -> None:
        self.context.destroy(linger=0)


def test_engines_sharing_the_secret_pull_as_without_it():
    import torch

    with engines({"filled": True, "secret": SECRET}, {"filled": False, "secret": SECRET}) as (prefill, decode):
        prefill.agent.submit(TransferWork(holds=[("p", [1, 2])]))
        remote = prefill.remote("p", [1, 2])
        decode.agent.submit(TransferWork(loads=[load("d", remote, [5, 6])]))
        decode.wait_for(lambda seen: seen.finished_recving or seen.failed_recving, "the pull")
        assert decode.seen.finished_recving == {"d"}
        assert torch.equal(decode.block(5), prefill.block(1)) and torch.equal(decode.block(6), prefill.block(2))
        prefill.wait_for(lambda seen: seen.finished_sending == {"p"}, "the release")
        assert not prefill.seen.rejected_messages and not decode.seen.rejected_messages


def test_a_stranger_gets_no_answer_and_cannot_release_or_read_a_hold():
    with engines({"filled": True, "secret": SECRET}) as (prefill,):
        prefill.agent.submit(TransferWork(holds=[("p", [1, 2])]))
        remote = prefill.remote("p", [1, 2])
        stranger = Stranger(prefill.agent.port)
        try:
            unsealed = messages.Seal("stranger", time.time_ns(), None)
            wrong_key = messages.Seal("stranger", time.time_ns(), WRONG)
            for seal in (unsealed, wrong_key):
                stranger.send(seal.seal(messages.Handshake("stranger")))
                stranger.send(seal.seal(messages.ReleaseBlocks(["p"])))
                stranger.send(seal.seal(messages.ReadBlocks("p", [1, 2], remote.generations, release=True)))
            stranger.send(messages.encode(messages.Handshake("stranger")))  # the bare message, no envelope
            for _ in range(2000):  # a flood
                stranger.send(unsealed.seal(messages.RenewLeases(["p"])))
            assert stranger.answers(1.0) == []  # nothing: no metadata, no error, not even "refused"
        finally:
            stranger.close()
        seen = prefill.wait_for(lambda seen: sum(seen.rejected_messages.values()) >= 2007, "the refusals")
        assert prefill.seen.rejected_messages == {"unauthenticated": 2006, "malformed": 1}, seen
        # The hold is intact and its lease was not renewed by the flood: a real decode still pulls it.
        assert not prefill.seen.finished_sending
        with engines({"filled": False, "secret": SECRET}) as (decode,):
            decode.agent.submit(TransferWork(loads=[load("d", remote, [3, 4])]))
            decode.wait_for(lambda seen: seen.finished_recving or seen.failed_recving, "the pull")
            assert decode.seen.finished_recving == {"d"}


def test_a_replayed_message_is_refused():
    with engines({"filled": True, "secret": SECRET}) as (prefill,):
        prefill.agent.submit(TransferWork(holds=[("p", [1])]))
        peer = messages.Seal("decode-x", time.time_ns(), SECRET)
        renew = peer.seal(messages.RenewLeases(["p"]))
        stranger = Stranger(prefill.agent.port)
        try:
            stranger.send(renew)
            stranger.send(renew)  # the same frame, captured and sent again
            prefill.wait_for(lambda seen: seen.rejected_messages.get("replayed") == 1, "the refusal")
            with mock.patch.object(messages, "time", _HourSlowClock):  # sealed properly, an hour ago
                stale = peer.seal(messages.RenewLeases(["p"]))
            stranger.send(stale)
            prefill.wait_for(lambda seen: seen.rejected_messages.get("replayed") == 2, "the refusal")
            assert prefill.quiet_for(0.2).rejected_messages == {"replayed": 2}
        finally:
            stranger.close()


def test_a_decode_role_engine_tells_no_peer_where_its_memory_is():
    with engines({"filled": False, "secret": SECRET, "serves_blocks": False}) as (decode,):
        stranger = Stranger(decode.agent.port)
        try:
            peer = messages.Seal("prefill-x", time.time_ns(), SECRET)  # even a peer with the secret
            stranger.send(peer.seal(messages.Handshake("prefill-x")))
            [[frame]] = stranger.answers(1.0)
        finally:
            stranger.close()
        opened = peer.open(frame)
        assert isinstance(opened, messages.Opened) and isinstance(opened.message, messages.HandshakeReply)
        assert opened.message.error and "no peer" in opened.message.error
        assert opened.message.transport_info == {}


def test_a_pull_from_a_decode_role_engine_fails_without_touching_the_cache():
    with engines({"filled": True, "secret": SECRET, "serves_blocks": False}, {"filled": False, "secret": SECRET}) as (
        other_decode,
        decode,
    ):
        other_decode.agent.submit(TransferWork(holds=[("p", [1])]))
        decode.agent.submit(TransferWork(loads=[load("d", other_decode.remote("p", [1]), [2])]))
        decode.wait_for(lambda seen: seen.failed_recving == {"d"}, "the failed pull")
        assert_untouched(decode)


def test_a_decode_without_the_secret_cannot_pull():
    with engines({"filled": True, "secret": SECRET}, {"filled": False, "transfer_timeout": 1.0}) as (prefill, decode):
        prefill.agent.submit(TransferWork(holds=[("p", [1])]))
        decode.agent.submit(TransferWork(loads=[load("d", prefill.remote("p", [1]), [2])]))
        decode.wait_for(lambda seen: seen.failed_recving == {"d"}, "the failed pull (handshake unanswered)")
        assert_untouched(decode)
        prefill.wait_for(lambda seen: seen.rejected_messages.get("unauthenticated"), "the refusal")
        assert not prefill.seen.finished_sending  # its release was refused too: the lease frees


def test_messages_from_an_older_incarnation_are_refused():
    with engines({"filled": True}) as (prefill,):
        prefill.agent.submit(TransferWork(holds=[("p", [1]), ("q", [2])]))
        restarted = messages.Seal("decode-x", time.time_ns(), None)
        old = messages.Seal("decode-x", restarted.incarnation - 1, None)
        stranger = Stranger(prefill.agent.port)
        try:
            stranger.send(restarted.seal(messages.ReleaseBlocks(["q"])))
            prefill.wait_for(lambda seen: seen.finished_sending == {"q"}, "the new incarnation's release")
            stranger.send(old.seal(messages.ReleaseBlocks(["p"])))  # the old process, still sending
            prefill.wait_for(lambda seen: seen.rejected_messages.get("old_incarnation") == 1, "the refusal")
            assert prefill.quiet_for(0.3).finished_sending == {"q"}
        finally:
            stranger.close()


def test_a_reply_from_another_incarnation_fails_its_pull_at_once():
    # The prefill restarted behind the same address and ZMQ reconnected the decode's socket under it: the answer
    # to a read sent to the old process comes from the new one. It must fail that pull now (the old blocks are
    # gone), not be taken as data and not wait for the transfer timeout.
    context = zmq.Context()
    server = context.socket(zmq.ROUTER)
    server.setsockopt(zmq.LINGER, 0)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    try:
        with engines({"filled": False, "transfer_timeout": 20.0}) as (decode,):
            from tests.kvtransfer.test_agent_faults import _remote

            first = messages.Seal("stand-in", time.time_ns(), None)
            decode.agent.submit(TransferWork(loads=[load("d", _remote(port, "r", [1]), [2])]))
            assert server.poll(5000)
            identity, frame = server.recv_multipart()
            assert isinstance(first.open(frame), messages.Opened)
            reply = messages.HandshakeReply("stand-in", "compat-a", "tcp", BLOCK_BYTES, NUM_BLOCKS, {})
            server.send_multipart([identity, first.seal(reply)])
            assert server.poll(5000)
            identity, frame = server.recv_multipart()  # the read
            restarted = messages.Seal("stand-in", first.incarnation + 1, None)
            data = bytes(BLOCK_BYTES)
            import zlib

            blocks = messages.BlocksReply("r", checksum=zlib.crc32(data))
            server.send_multipart([identity, restarted.seal(blocks), data])
            took = decode.wait_for(lambda seen: seen.failed_recving == {"d"}, "the failed pull")
            assert took < 5.0
            assert decode.seen.rejected_messages == {"old_incarnation": 1}
            assert_untouched(decode)
    finally:
        context.destroy(linger=0)
