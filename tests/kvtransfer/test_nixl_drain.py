"""A NIXL read given up at its timeout while NIXL still runs it: its blocks stay quarantined until the read ends.

Two real agents in this process over real NIXL (UCX over shared memory). NIXL cannot be made to hang a read on cue
here (reads of a few blocks end in microseconds), so one stand-in remains: the decode agent's view of its
transfers' state says "PROC" (still running) while the test holds it so; everything else is NIXL's."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from pdserve.kvtransfer.work import TransferWork
from tests.kvtransfer.agents import engines, load, token_of

pytest.importorskip("nixl._api")


class _StillRunning:
    """Delegates to a real NIXL agent; transfer states read "PROC" while ``hold`` is set."""

    def __init__(self, agent: Any) -> None:
        self._agent = agent
        self.hold = threading.Event()
        self.released: list[Any] = []

    def check_xfer_state(self, handle: Any) -> str:
        state = self._agent.check_xfer_state(handle)
        return "PROC" if self.hold.is_set() else state

    def release_xfer_handle(self, handle: Any) -> None:
        self.released.append(handle)
        self._agent.release_xfer_handle(handle)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent, name)


def _stalled_pull(prefill, decode, running: _StillRunning) -> None:
    running.hold.set()
    prefill.agent.submit(TransferWork(holds=[("p", [1, 2], token_of("p"))]))
    decode.agent.submit(TransferWork(loads=[load("d", prefill.remote("p", [1, 2]), [5, 6])]))
    decode.wait_for(lambda seen: seen.failed_recving_in_flight, "the timeout")
    assert decode.seen.failed_recving_in_flight == {"d"}


def test_a_timed_out_read_still_running_is_reported_drained_only_when_it_ends():
    nixl = {"transport": "nixl", "transfer_timeout": 1.0}
    with engines({"filled": True, **nixl}, {"filled": False, **nixl}) as (prefill, decode):
        running = _StillRunning(decode.agent.transport.agent)
        decode.agent.transport.agent = running
        # A first pull, so the second's handshake is done and its timeout is the transfer's alone.
        prefill.agent.submit(TransferWork(holds=[("o", [0], token_of("o"))]))
        decode.agent.submit(TransferWork(loads=[load("c", prefill.remote("o", [0]), [4])]))
        decode.wait_for(lambda seen: seen.finished_recving == {"c"}, "the first pull")
        running.hold.set()
        prefill.agent.submit(TransferWork(holds=[("p", [1, 2], token_of("p")), ("q", [3], token_of("q"))]))
        decode.agent.submit(TransferWork(loads=[load("d", prefill.remote("p", [1, 2]), [5, 6])]))
        time.sleep(0.5)
        # Another read on the same connection, still within its own deadline when the first times out: the
        # connection stays (one slow read must not fail the others), so only the end of the read can drain it.
        decode.agent.submit(TransferWork(loads=[load("e", prefill.remote("q", [3]), [7])]))
        decode.wait_for(lambda seen: seen.failed_recving_in_flight == {"d"}, "the timeout")
        assert not decode.seen.failed_recving and not decode.seen.finished_recving - {"c"}
        released = len(running.released)
        assert not decode.quiet_for(0.2).failed_recving  # still running: still quarantined
        assert len(running.released) == released  # its handle kept, not released under the running read
        running.hold.clear()  # the reads end
        decode.wait_for(lambda seen: seen.failed_recving == {"d"} and "e" in seen.finished_recving, "the drain")


def test_dropping_the_peer_keeps_the_quarantine_of_its_reads_until_they_end():
    # Before, dropping the (suspect) connection removed the peer's NIXL agent after releasing the read's handle, and
    # that counted as "nothing can land any more". It was not: UCX closes the endpoint asynchronously, and over its
    # tcp transport a given-up read's data landed in a later progress call, in blocks already given to another
    # request (tests/chaos/test_late_read.py). Now the peer's agent waits for its reads, and only their end drains.
    nixl = {"transport": "nixl", "transfer_timeout": 1.0}
    with engines({"filled": True, **nixl}, {"filled": False, **nixl}) as (prefill, decode):
        running = _StillRunning(decode.agent.transport.agent)
        decode.agent.transport.agent = running
        removed: list[str] = []
        remove = running._agent.remove_remote_agent
        running.remove_remote_agent = lambda name: removed.append(name) or remove(name)  # type: ignore[attr-defined]
        _stalled_pull(prefill, decode, running)
        # The timed-out pull was the only one on its connection: the agent drops that (suspect) connection ...
        deadline = time.monotonic() + 5
        while decode.agent.transport._peers and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not decode.agent.transport._peers
        # ... but the read still runs: its blocks stay quarantined, its handle kept, the peer's agent kept.
        assert not decode.quiet_for(1.0).failed_recving
        assert not running.released and not removed
        running.hold.clear()  # the read ends
        decode.wait_for(lambda seen: seen.failed_recving == {"d"}, "the drained report")
        deadline = time.monotonic() + 5
        while not removed and time.monotonic() < deadline:
            time.sleep(0.01)
        assert running.released and removed  # then, and only then, the handle and the agent go
