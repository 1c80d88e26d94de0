"""The side channel with the deployment's keys: real agents over TCP on 127.0.0.1, and peers played by hand.

A peer that cannot seal with engine.key gets no answer at all (not even an error), cannot release or read a hold,
and cannot replay what an engine sent. Every message names its receiver: a sealed handshake captured on one link
gets no answer from another engine, nor from a restart of the same one (a new engine id), nor from its own
receiver a second time; a reply that does not echo the handshake's challenge is not taken for an answer. A peer
with the key still reads, renews and releases only the holds whose token it names. A decode-role engine tells
no peer where its memory is. Nothing a peer claims about its name changes how the real engine of that name is
served (there is no incarnation to poison). Each refusal is counted by reason."""

from __future__ import annotations

import time
from unittest import mock

import pytest
import zmq

from pdserve.kvtransfer import messages
from pdserve.kvtransfer.layout import rank_agent_id
from pdserve.kvtransfer.work import TransferWork
from tests.kvtransfer.agents import BLOCK_BYTES, NUM_BLOCKS, assert_untouched, engines, load, token_of
from tests.kvtransfer.test_agent_faults import _remote


def _ring(folder: str):
    from pdserve.api.keys import ENGINE_KEY, load_secret

    return load_secret(folder, ENGINE_KEY)


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


class Listener:
    """A ROUTER standing where a decode engine was told a prefill engine is: it records what the decode sends."""

    def __init__(self) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.port = self.socket.bind_to_random_port("tcp://127.0.0.1")

    def capture(self, seconds: float = 5.0) -> tuple[bytes, bytes]:
        """(the sender's connection identity, the frame) of the next frame that comes."""
        assert self.socket.poll(int(seconds * 1000)), "nothing came"
        identity, frame = self.socket.recv_multipart()
        return identity, frame

    def close(self) -> None:
        self.context.destroy(linger=0)


def test_engines_sharing_the_keys_pull_as_without_them(keys):
    import torch

    with engines({"filled": True, "keys_dir": keys}, {"filled": False, "keys_dir": keys}) as (prefill, decode):
        prefill.agent.submit(TransferWork(holds=[("p", [1, 2], token_of("p"))]))
        remote = prefill.remote("p", [1, 2])
        decode.agent.submit(TransferWork(loads=[load("d", remote, [5, 6])]))
        decode.wait_for(lambda seen: seen.finished_recving or seen.failed_recving, "the pull")
        assert decode.seen.finished_recving == {"d"}
        assert torch.equal(decode.block(5), prefill.block(1)) and torch.equal(decode.block(6), prefill.block(2))
        prefill.wait_for(lambda seen: seen.finished_sending == {"p"}, "the release")
        assert not prefill.seen.rejected_messages and not decode.seen.rejected_messages


def test_a_stranger_gets_no_answer_and_cannot_release_or_read_a_hold(keys, wrong_keys):
    with engines({"filled": True, "keys_dir": keys}) as (prefill,):
        prefill.agent.submit(TransferWork(holds=[("p", [1, 2], token_of("p"))]))
        remote = prefill.remote("p", [1, 2])
        receiver = prefill.agent.agent_id
        hold = [("p", token_of("p"))]
        stranger = Stranger(prefill.agent.port)
        try:
            unsealed = messages.Seal("stranger", None)
            wrong_key = messages.Seal("stranger", _ring(wrong_keys))
            for seal in (unsealed, wrong_key):
                stranger.send(seal.seal(messages.Handshake("stranger", messages.new_challenge()), receiver))
                stranger.send(seal.seal(messages.ReleaseBlocks(hold), receiver))
                read = messages.ReadBlocks("p", token_of("p"), [1, 2], remote.generations, release=True)
                stranger.send(seal.seal(read, receiver))
            stranger.send(messages.encode(messages.Handshake("stranger")))  # the bare message, no envelope
            for _ in range(2000):  # a flood
                stranger.send(unsealed.seal(messages.RenewLeases(hold), receiver))
            assert stranger.answers(1.0) == []  # nothing: no metadata, no error, not even "refused"
        finally:
            stranger.close()
        seen = prefill.wait_for(lambda seen: sum(seen.rejected_messages.values()) >= 2007, "the refusals")
        assert prefill.seen.rejected_messages == {"unauthenticated": 2006, "malformed": 1}, seen
        # The hold is intact and its lease was not renewed by the flood: a real decode still pulls it.
        assert not prefill.seen.finished_sending
        with engines({"filled": False, "keys_dir": keys}) as (decode,):
            decode.agent.submit(TransferWork(loads=[load("d", remote, [3, 4])]))
            decode.wait_for(lambda seen: seen.finished_recving or seen.failed_recving, "the pull")
            assert decode.seen.finished_recving == {"d"}


def test_a_replayed_or_stale_message_is_refused(keys):
    with engines({"filled": True, "keys_dir": keys}) as (prefill,):
        prefill.agent.submit(TransferWork(holds=[("p", [1], token_of("p"))]))
        peer = messages.Seal("decode-x", _ring(keys))
        renew = peer.seal(messages.RenewLeases([("p", token_of("p"))]), prefill.agent.agent_id)
        stranger = Stranger(prefill.agent.port)
        try:
            stranger.send(renew)
            stranger.send(renew)  # the same frame, captured and sent again
            prefill.wait_for(lambda seen: seen.rejected_messages.get("replayed") == 1, "the refusal")
            with mock.patch.object(messages, "time", _HourSlowClock):  # sealed properly, an hour ago
                stale = peer.seal(messages.RenewLeases([("p", token_of("p"))]), prefill.agent.agent_id)
            stranger.send(stale)
            prefill.wait_for(lambda seen: seen.rejected_messages.get("stale") == 1, "the refusal")
            assert prefill.quiet_for(0.2).rejected_messages == {"replayed": 1, "stale": 1}
        finally:
            stranger.close()


def test_a_captured_handshake_gets_no_answer_from_another_prefill_or_a_restarted_one(keys):
    # Before (dbd1dc4): a sealed Handshake named no receiver, so every other prefill of the deployment (and a
    # restarted one, within the 30 s window) answered it with its NIXL metadata and kv_base.
    listener = Listener()
    try:
        with engines({"filled": True, "keys_dir": keys}, {"filled": False, "keys_dir": keys}) as (prefill, decode):
            # The decode engine is sent to hand-shake with `prefill` at the listener's address: the listener
            # captures a real, sealed handshake addressed to `prefill`, as an eavesdropper on that link would.
            remote = _remote(listener.port, "r", [1], engine_id=prefill.config.engine_id)
            decode.agent.submit(TransferWork(loads=[load("d", remote, [2])]))
            _, captured = listener.capture()
            # Delivered once to its receiver, it is answered (that is the real exchange) ...
            stranger = Stranger(prefill.agent.port)
            try:
                stranger.send(captured)
                [[answer]] = stranger.answers(1.0)
                assert isinstance(messages.Seal("x", None)._open_envelope(answer), messages.Envelope)
                # ... and never again.
                stranger.send(captured)
                assert stranger.answers(1.0) == []
                prefill.wait_for(lambda seen: seen.rejected_messages.get("replayed") == 1, "the refusal")
            finally:
                stranger.close()
            with engines({"filled": True, "keys_dir": keys}, {"filled": True, "keys_dir": keys}) as (other, restarted):
                for target in (other, restarted):  # another prefill; a restart (another engine id, same keys)
                    stranger = Stranger(target.agent.port)
                    try:
                        stranger.send(captured)
                        assert stranger.answers(1.0) == []  # no answer: not addressed to it
                    finally:
                        stranger.close()
                    target.wait_for(lambda seen: seen.rejected_messages == {"misaddressed": 1}, "the refusal")
    finally:
        listener.close()


def test_a_reply_that_does_not_echo_the_challenge_is_not_an_answer(keys):
    # A HandshakeReply captured from an earlier handshake (with the memory whereabouts of an engine that may be long
    # gone) must not complete a new one.
    listener = Listener()
    try:
        with engines({"filled": False, "keys_dir": keys, "transfer_timeout": 1.0}) as (decode,):
            prefill_seal = messages.Seal("stand-in", _ring(keys))
            decode.agent.submit(TransferWork(loads=[load("d", _remote(listener.port, "r", [1]), [2])]))
            identity, _ = listener.capture()
            old = messages.HandshakeReply(
                "stand-in", "compat-a", "tcp", BLOCK_BYTES, NUM_BLOCKS, {}, answer=messages.new_challenge()
            )
            listener.socket.send_multipart([identity, prefill_seal.seal(old, decode.agent.agent_id)])
            decode.wait_for(lambda seen: seen.failed_recving == {"d"}, "the handshake's timeout")
            assert decode.seen.rejected_messages == {"replayed": 1}
            assert not decode.seen.finished_recving
            assert_untouched(decode)
    finally:
        listener.close()


def test_a_peer_with_the_keys_reads_renews_and_releases_only_the_holds_it_names(keys):
    # Request ids are no secret (clients choose some): the hold's token is what lets a peer touch it.
    with engines({"filled": True, "keys_dir": keys}) as (prefill,):
        prefill.agent.submit(TransferWork(holds=[("p", [1, 2], token_of("p"))]))
        remote = prefill.remote("p", [1, 2])
        peer = messages.Seal("decode-x", _ring(keys))
        stranger = Stranger(prefill.agent.port)
        try:
            wrong = "not-the-token"
            read = messages.ReadBlocks("p", wrong, [1, 2], remote.generations, release=True)
            stranger.send(peer.seal(read, prefill.agent.agent_id))
            [[frame]] = stranger.answers(1.5)  # early-read grace, then the refusal
            opened = peer.open(frame)
            assert isinstance(opened, messages.Opened) and isinstance(opened.message, messages.BlocksReply)
            assert opened.message.error is not None and "not held" in opened.message.error
            stranger.send(peer.seal(messages.ReleaseBlocks([("p", wrong)]), prefill.agent.agent_id))
            assert prefill.quiet_for(0.3).finished_sending == set()  # not released
            stranger.send(peer.seal(messages.ReleaseBlocks([("p", token_of("p"))]), prefill.agent.agent_id))
            prefill.wait_for(lambda seen: seen.finished_sending == {"p"}, "the release naming the token")
        finally:
            stranger.close()


def test_a_decode_role_engine_tells_no_peer_where_its_memory_is(keys):
    with engines({"filled": False, "keys_dir": keys, "serves_blocks": False}) as (decode,):
        stranger = Stranger(decode.agent.port)
        try:
            peer = messages.Seal("prefill-x", _ring(keys))  # even a peer with the keys
            stranger.send(peer.seal(messages.Handshake("prefill-x", b"c"), decode.agent.agent_id))
            [[frame]] = stranger.answers(1.0)
        finally:
            stranger.close()
        opened = peer.open(frame)
        assert isinstance(opened, messages.Opened) and isinstance(opened.message, messages.HandshakeReply)
        assert opened.message.error and "no peer" in opened.message.error
        assert opened.message.transport_info == {}


def test_a_pull_from_a_decode_role_engine_fails_without_touching_the_cache(keys):
    with engines({"filled": True, "keys_dir": keys, "serves_blocks": False}, {"filled": False, "keys_dir": keys}) as (
        other_decode,
        decode,
    ):
        other_decode.agent.submit(TransferWork(holds=[("p", [1], token_of("p"))]))
        decode.agent.submit(TransferWork(loads=[load("d", other_decode.remote("p", [1]), [2])]))
        decode.wait_for(lambda seen: seen.failed_recving == {"d"}, "the failed pull")
        assert_untouched(decode)


def test_a_decode_without_the_keys_cannot_pull(keys):
    with engines({"filled": True, "keys_dir": keys}, {"filled": False, "transfer_timeout": 1.0}) as (prefill, decode):
        prefill.agent.submit(TransferWork(holds=[("p", [1], token_of("p"))]))
        decode.agent.submit(TransferWork(loads=[load("d", prefill.remote("p", [1]), [2])]))
        decode.wait_for(lambda seen: seen.failed_recving == {"d"}, "the failed pull (handshake unanswered)")
        assert_untouched(decode)
        prefill.wait_for(lambda seen: seen.rejected_messages.get("unauthenticated"), "the refusal")
        assert not prefill.seen.finished_sending  # its release was refused too: the lease frees


@pytest.mark.parametrize("keyed", [False, True], ids=["no-keys", "keys"])
def test_nothing_said_in_an_engines_name_locks_that_engine_out(keys, keyed):
    # Before (dbd1dc4): one message claiming decode D's id with a huge incarnation made every later message of the
    # real D "old_incarnation" on that prefill until it restarted. Now nothing is recorded from a claimed name.
    folder = keys if keyed else None
    with engines({"filled": True, "keys_dir": folder}, {"filled": False, "keys_dir": folder}) as (prefill, decode):
        prefill.agent.submit(TransferWork(holds=[("p", [1], token_of("p"))]))
        impostor = messages.Seal(decode.agent.agent_id, _ring(keys) if keyed else None)
        stranger = Stranger(prefill.agent.port)
        try:
            for message in (messages.Handshake(decode.agent.agent_id, b"c"), messages.RenewLeases([])):
                stranger.send(impostor.seal(message, prefill.agent.agent_id))
            stranger.answers(0.3)
        finally:
            stranger.close()
        decode.agent.submit(TransferWork(loads=[load("d", prefill.remote("p", [1]), [2])]))
        decode.wait_for(lambda seen: seen.finished_recving or seen.failed_recving, "the real decode's pull")
        assert decode.seen.finished_recving == {"d"}
        assert not prefill.seen.rejected_messages


def test_a_reply_from_another_engine_on_the_connection_is_never_data():
    # The prefill restarted behind the same address (a new engine id) and ZMQ reconnected the decode's socket under
    # it: whatever the new process says is not about what was asked of the old one. The read's bytes are never
    # used; the pull fails at its timeout (the new engine would not even answer a read addressed to the old one).
    context = zmq.Context()
    server = context.socket(zmq.ROUTER)
    server.setsockopt(zmq.LINGER, 0)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    try:
        with engines({"filled": False, "transfer_timeout": 1.5}) as (decode,):
            first = messages.Seal(rank_agent_id("stand-in", 0), None)
            decode.agent.submit(TransferWork(loads=[load("d", _remote(port, "r", [1]), [2])]))
            assert server.poll(5000)
            identity, frame = server.recv_multipart()
            opened = first.open(frame)
            assert isinstance(opened, messages.Opened) and isinstance(opened.message, messages.Handshake)
            reply = messages.HandshakeReply(
                "stand-in", "compat-a", "tcp", BLOCK_BYTES, NUM_BLOCKS, {}, answer=opened.message.challenge
            )
            server.send_multipart([identity, first.seal(reply, opened.sender)])
            assert server.poll(5000)
            identity, frame = server.recv_multipart()  # the read
            restarted = messages.Seal("stand-in-restarted", None)
            import blake3

            data = bytes([9]) * BLOCK_BYTES
            blocks = messages.BlocksReply("r", digest=blake3.blake3(data).digest())
            server.send_multipart([identity, restarted.seal(blocks, opened.sender), data])
            decode.wait_for(lambda seen: seen.failed_recving == {"d"}, "the failed pull")
            assert decode.seen.rejected_messages == {"unexpected": 1}
            assert_untouched(decode)
    finally:
        context.destroy(linger=0)
