"""A pull's states (pdserve/kvtransfer/pulls.py) and the agent factory's contract with the engine's generation
array (pdserve/kvtransfer/agent.py): both refuse what would make a load count twice or read the wrong bytes."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.kvtransfer.agent import make_transfer_agent
from pdserve.kvtransfer.config import KVTransferConfig
from pdserve.kvtransfer.params import RemotePrefill
from pdserve.kvtransfer.pulls import Load, Pull, PullState
from tests.kvtransfer.agents import NUM_BLOCKS, _kv_cache, load, token_of


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


def test_the_factory_takes_one_int64_generation_per_row_of_the_cache():
    config = KVTransferConfig(transport="tcp")
    with pytest.raises(ValueError, match="int64"):
        make_transfer_agent(config, _kv_cache(False), lambda rows: np.zeros(rows, np.int32), "compat")
    with pytest.raises(ValueError, match="int64"):
        make_transfer_agent(config, _kv_cache(False), lambda rows: np.zeros(rows + 1, np.int64), "compat")
    asked: list[int] = []

    def generations(rows: int) -> np.ndarray:
        asked.append(rows)
        return np.zeros(rows, np.int64)

    agent = make_transfer_agent(config, _kv_cache(False), generations, "compat")
    try:
        assert asked == [NUM_BLOCKS] and agent.generations.shape == (NUM_BLOCKS,)
    finally:
        agent.close()
