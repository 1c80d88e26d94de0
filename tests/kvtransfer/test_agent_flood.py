"""Nothing a stranger sends stalls a transfer agent: real agents over TCP on 127.0.0.1 with keys, and a flood of
well-addressed, fresh, wrongly keyed frames of the largest size the side channel takes (each costs the agent an
HMAC, the most a junk frame can cost).

Before (dbd1dc4) the agent read its side channel until it was empty, so a flood kept it there: pulls neither
landed nor timed out, leases never expired; and ZMQ buffered up to 1000 frames of 1 MiB per connection before
any was authenticated (the victim grew from 245 MiB to 1.4 GiB RSS from two connections). Now one step serves at
most SERVE_FRAMES_PER_STEP frames, a connection queues at most SIDE_CHANNEL_RCVHWM frames of at most the side
channel's frame bound, and one address keeps at most ``per_peer`` connections. These are asserted by counting;
the one time asserted is the pull's own bound (its transfer timeout). The flooded/unflooded time ratio is in
bench/kv_transfer.py."""

from __future__ import annotations

import contextlib
import time

import numpy as np
import zmq

from pdserve.bench.flood import SideChannelFlood, junk_frame
from pdserve.kvtransfer import agent as agent_module
from pdserve.kvtransfer import holds, messages
from pdserve.kvtransfer.config import KVTransferConfig
from pdserve.kvtransfer.nixl_policy import TransportChoice
from pdserve.kvtransfer.transport.registry import make_transport
from pdserve.kvtransfer.work import TransferWork
from tests.kvtransfer.agents import _kv_cache, engines, load, token_of


def test_a_pull_lands_in_its_normal_time_under_a_strangers_flood(keys):
    timeout = 3.0
    with engines(
        {"filled": True, "keys_dir": keys, "transfer_timeout": timeout},
        {"filled": False, "keys_dir": keys, "transfer_timeout": timeout},
    ) as (prefill, decode):
        size = agent_module.max_request_bytes(prefill.agent.transport.num_blocks)
        target = (f"tcp://127.0.0.1:{prefill.agent.port}", prefill.agent.agent_id)
        with SideChannelFlood([target], size) as flood:
            # The flood reaches the agent, and is refused frame by frame, before the first pull starts. (Counting
            # refusals, not frames sent: what was sent may still sit in socket buffers.)
            prefill.wait_for(lambda seen: seen.rejected_messages.get("unauthenticated", 0) >= 50, "the flood", 10)
            refused_before = prefill.seen.rejected_messages["unauthenticated"]
            for number in range(3):  # a handshake, then pulls on a live connection
                request_id = f"p{number}"
                prefill.agent.submit(TransferWork(holds=[(request_id, [number + 1], token_of(request_id))]))
                remote = prefill.remote(request_id, [number + 1])
                decode.agent.submit(TransferWork(loads=[load(f"d{number}", remote, [number + 4])]))
                took = decode.wait_for(
                    lambda seen, n=number: seen.finished_recving | seen.failed_recving >= {f"d{n}"}, "the pull", 20
                )
                assert decode.seen.finished_recving >= {f"d{number}"}, decode.seen
                assert took < timeout, f"the pull took {took:.2f} s under the flood"
            refused = prefill.poll().rejected_messages["unauthenticated"]
        assert refused > refused_before, (refused_before, refused, flood.sent)  # the flood went on during the pulls
        prefill.wait_for(lambda seen: seen.finished_sending == {"p0", "p1", "p2"}, "the releases")


def test_one_step_serves_a_bounded_slice_of_what_waits():
    context = zmq.Context()
    try:
        server = context.socket(zmq.ROUTER)
        server.setsockopt(zmq.LINGER, 0)
        port = server.bind_to_random_port("tcp://127.0.0.1")
        client = context.socket(zmq.DEALER)
        client.setsockopt(zmq.LINGER, 0)
        client.connect(f"tcp://127.0.0.1:{port}")
        refusals: list[str] = []

        class Reports:
            def finished_sending(self, request_id: str) -> None: ...
            def expired(self, count: int) -> None: ...
            def rejected(self, reason: str, source: str) -> None:
                refusals.append(reason)

        seal = messages.Seal("prefill", None)
        transport = make_transport(TransportChoice("tcp", "test"), _kv_cache(True), np.zeros(8, np.int64), seal)
        held = holds.HeldBlocks(
            KVTransferConfig(transport="tcp"), transport, np.zeros(8, np.int64), seal, server, "compat", [], Reports()
        )
        for _ in range(500):
            client.send(b"junk")
        deadline = time.monotonic() + 5
        while not server.poll(10):
            assert time.monotonic() < deadline
        time.sleep(0.3)  # let them all arrive
        assert held.serve() is True  # more waits
        assert len(refusals) <= holds.SERVE_FRAMES_PER_STEP
        steps = 1
        while held.serve():
            steps += 1
        assert len(refusals) == 500 and steps >= 500 // holds.SERVE_FRAMES_PER_STEP
    finally:
        context.destroy(linger=0)


def test_what_a_stranger_can_make_an_agent_buffer_is_bounded(keys):
    # Counted, not timed: connections from one address beyond the cap are cut before any of their frames is
    # delivered; each admitted one queues at most SIDE_CHANNEL_RCVHWM frames of at most the frame bound; a frame
    # over the bound never reaches the agent (ZMQ drops its connection).
    with engines({"filled": True, "keys_dir": keys}) as (prefill,):
        agent = prefill.agent
        agent._caps.per_peer = 8  # the default (64) leaves room for every rank of many local decode engines
        server = agent._server
        assert server.getsockopt(zmq.RCVHWM) == agent_module.SIDE_CHANNEL_RCVHWM
        bound = server.getsockopt(zmq.MAXMSGSIZE)
        assert bound == agent_module.max_request_bytes(agent.transport.num_blocks) <= messages.MAX_MESSAGE_BYTES
        context = zmq.Context()
        try:
            sockets = []
            for _ in range(40):
                socket = context.socket(zmq.DEALER)
                socket.setsockopt(zmq.LINGER, 0)
                socket.connect(f"tcp://127.0.0.1:{agent.port}")
                sockets.append(socket)
            frame = junk_frame(agent.agent_id, bound)
            assert len(frame) <= bound
            for socket in sockets:
                for _ in range(3):
                    with contextlib.suppress(zmq.Again):
                        socket.send(frame, zmq.NOBLOCK)
            oversized = context.socket(zmq.DEALER)
            oversized.setsockopt(zmq.LINGER, 0)
            oversized.connect(f"tcp://127.0.0.1:{agent.port}")
            oversized.send(b"x" * (bound + 1))
            time.sleep(1.0)
            live = agent._caps.live("127.0.0.1")
            assert live <= 8, live  # of the 41 connections, at most the cap is ever let in
            assert agent._caps.refused >= 41 - 8
            seen = prefill.quiet_for(1.0).rejected_messages
            # Every frame the agent saw came from an admitted connection: at most 3 each, never the oversized one.
            assert seen.get("unauthenticated", 0) <= 3 * 8, seen
            assert "oversized" not in seen and "malformed" not in seen, seen
        finally:
            context.destroy(linger=0)
