"""A pull's states (pdserve/kvtransfer/pulls.py): a pull ends once, so its load never counts it twice."""

from __future__ import annotations

import pytest

from pdserve.kvtransfer.params import RemotePrefill
from pdserve.kvtransfer.pulls import Load, Pull, PullState
from tests.kvtransfer.agents import load, token_of


def _pull() -> Pull:
    remote = RemotePrefill("e", "p", "127.0.0.1", 1, [0], [0], 4, "", "c", 30.0, hold_token=token_of("p"))
    spec = load("d", remote, [0])
    return Pull(spec, 256, Load(spec))


def test_a_pull_ends_once():
    pull = _pull()
    for state in (PullState.HANDSHAKING, PullState.TRANSFERRING, PullState.DRAINING, PullState.FAILED):
        pull.move(state)
    for state in PullState:
        with pytest.raises(RuntimeError, match="cannot go from FAILED"):
            pull.move(state)


def test_only_a_pull_whose_transport_ran_lands_or_drains():
    pull = _pull()
    pull.move(PullState.HANDSHAKING)
    for state in (PullState.DONE, PullState.DRAINING):
        with pytest.raises(RuntimeError):
            pull.move(state)
