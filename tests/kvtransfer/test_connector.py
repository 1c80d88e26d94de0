"""The P/D connector's scheduler side with no engine and no agent: every hook of
``PDConnectorScheduler`` on real engine ``Request`` objects, and the work order each one leaves
for the transfer agent (``build_connector_meta``).

The prefill role: a prefill leg that ends by length holds exactly its prompt's blocks and says
where they are; any other ending holds nothing. The decode role: requests come as the API process's
P/D gate hands them on (params parsed, unusable ones already dropped: ``unusable_reason``), the load
covers only the blocks past the local prefix-cache hit, and every tracked remote ends in exactly one
load or one release (a cancel only follows a load). A stateful property test drives random sequences
of the scheduler's calls to check the last point.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvtransfer.config import KVFaults, KVTransferConfig
from pdserve.kvtransfer.connector import PDConnectorScheduler
from pdserve.kvtransfer.decode_side import unusable_reason
from pdserve.kvtransfer.params import parse_remote_prefill, prompt_hash, wants_remote_decode
from pdserve.kvtransfer.work import LoadSpec, TransferWork

COMPAT = "compat-ours"
BLOCK_SIZE = 16
PORT = 5601
NUM_BLOCKS = 64


def _config(**overrides: Any) -> KVTransferConfig:
    return KVTransferConfig(transport="tcp", faults=KVFaults(), **overrides)


def _connector(generations: np.ndarray | None = None, block_size: int = BLOCK_SIZE, **config: Any):
    if generations is None:
        generations = np.zeros(NUM_BLOCKS, dtype=np.int64)
    return PDConnectorScheduler(_config(**config), COMPAT, block_size, [PORT], generations)


def _request(request_id: str, prompt: list[int], params: dict[str, Any] | None = None) -> Request:
    """A request with these ``kv_transfer_params``, as the P/D gate hands it to the core (parsed)."""
    return Request(
        request_id,
        prompt,
        SamplingParams(),
        None,
        remote_prefill=parse_remote_prefill(params),
        remote_decode=wants_remote_decode(params),
    )


def _remote_params(prompt: list[int], block_size: int = BLOCK_SIZE, **overrides: Any) -> dict[str, Any]:
    """What a matching prefill engine would have returned for ``prompt`` (blocks 100, 101, ...;
    generations 7, 8, ...), with ``overrides`` applied."""
    num_blocks = -(-len(prompt) // block_size)
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "prefill-engine",
        "remote_request_id": "prefill-request",
        "remote_host": "10.0.0.7",
        "remote_port": 7000,
        "remote_block_ids": [100 + i for i in range(num_blocks)],
        "remote_block_generations": [7 + i for i in range(num_blocks)],
        "remote_num_tokens": len(prompt),
        "remote_prompt_hash": prompt_hash(prompt),
        "kv_compat_hash": COMPAT,
        "remote_lease_seconds": 30,
        "remote_hold_token": "hold-token",
    }
    return params | overrides


def _take(connector: PDConnectorScheduler) -> TransferWork:
    """This step's work order, checking the drain: pending before, nothing pending after."""
    assert connector.has_pending_work()
    work = connector.build_connector_meta()
    assert isinstance(work, TransferWork) and work
    assert not connector.has_pending_work()
    assert connector.build_connector_meta() is None
    return work


def _assert_empty(connector: PDConnectorScheduler) -> None:
    assert not connector.has_pending_work()
    assert connector.build_connector_meta() is None


# ----- the prefill role -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt_len", "block_ids", "held"),
    [
        (40, [9, 3, 12, 5], [9, 3, 12]),  # 2.5 blocks of prompt: 3 blocks; the output token's 4th is not held
        (32, [9, 3, 12], [9, 3]),  # exactly 2 blocks: the block opened for the sampled token is not held
        (1, [4], [4]),
        (16, [8], [8]),
    ],
)
def test_a_prefill_leg_ending_by_length_holds_exactly_its_prompt_blocks(prompt_len, block_ids, held):
    generations = np.arange(NUM_BLOCKS, dtype=np.int64) * 10 + 1
    config = _config(host="10.1.2.3", lease_seconds=12.5)
    connector = PDConnectorScheduler(config, COMPAT, BLOCK_SIZE, [PORT], generations)
    prompt = list(range(1000, 1000 + prompt_len))
    request = _request("leg", prompt, {"do_remote_decode": True})

    hold, params = connector.request_finished(request, block_ids, "length")

    assert hold is True
    token = params["remote_hold_token"]
    assert isinstance(token, str) and len(token) == 32  # 128 random bits: a capability, not an id
    assert params == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": config.engine_id,
        "remote_request_id": "leg",
        "remote_block_ids": held,
        "remote_host": "10.1.2.3",
        "remote_port": PORT,
        "remote_ports": [PORT],
        "remote_block_generations": [int(generations[b]) for b in held],
        "remote_num_tokens": prompt_len,
        "remote_prompt_hash": prompt_hash(prompt),
        "kv_compat_hash": COMPAT,
        "remote_lease_seconds": 12.5,
        "remote_hold_token": token,
    }
    work = _take(connector)
    assert work.holds == [("leg", held, token)]
    assert not (work.tracks or work.loads or work.releases or work.cancels or work.unholds)
    # The params are a snapshot: freeing (and bumping) the blocks later does not rewrite them.
    generations[held] += 1
    assert params["remote_block_generations"] == [int(generations[b]) - 1 for b in held]
    # The hold's block list is not the caller's list.
    block_ids.clear()
    assert work.holds == [("leg", held, token)]


def test_the_params_a_prefill_leg_returns_are_accepted_by_a_matching_decode_engine():
    prefill = _connector(generations=np.arange(NUM_BLOCKS, dtype=np.int64) + 3)
    decode = _connector()
    prompt = list(range(50))
    _, params = prefill.request_finished(_request("leg", prompt, {"do_remote_decode": True}), [1, 2, 3, 4], "length")
    request = _request("dec", prompt, params)

    decode.request_added(request)

    [(request_id, remote)] = _take(decode).tracks
    assert request_id == "dec"
    assert remote == parse_remote_prefill(params)
    assert remote.block_ids == [1, 2, 3, 4] and remote.generations == [4, 5, 6, 7]
    assert decode.get_num_new_matched_tokens(request, 0) == (50, True)


@pytest.mark.parametrize("finish_reason", ["abort", "error", "stop"])
def test_a_prefill_leg_ending_any_other_way_holds_nothing(finish_reason):
    connector = _connector()
    request = _request("leg", list(range(40)), {"do_remote_decode": True})
    assert connector.request_finished(request, [1, 2, 3], finish_reason) == (False, None)
    _assert_empty(connector)


@pytest.mark.parametrize(
    "params",
    [None, {}, {"do_remote_decode": False}, {"do_remote_decode": "true"}, {"do_remote_decode": 1}],
    ids=["none", "empty", "false", "string", "int"],
)
def test_a_request_that_is_not_a_prefill_leg_holds_nothing(params):
    connector = _connector()
    assert connector.request_finished(_request("r", list(range(40)), params), [1, 2, 3], "length") == (False, None)
    _assert_empty(connector)


def test_a_prefill_leg_without_blocks_holds_nothing():
    connector = _connector()
    request = _request("leg", list(range(40)), {"do_remote_decode": True})
    assert connector.request_finished(request, [], "length") == (False, None)
    _assert_empty(connector)


def test_a_cancelled_hold_is_unheld():
    connector = _connector()
    connector.request_finished(_request("leg", list(range(20)), {"do_remote_decode": True}), [5, 6], "length")
    connector.hold_cancelled("leg")
    work = _take(connector)
    # Both in one order: the agent applies the holds first, then the unholds.
    assert [hold[:2] for hold in work.holds] == [("leg", [5, 6])] and work.unholds == ["leg"]
    connector.hold_cancelled("other")
    assert _take(connector).unholds == ["other"]


@pytest.mark.parametrize(("policy", "recompute"), [("recompute", True), ("fail", False)])
def test_the_load_failure_policy_comes_from_the_config(policy, recompute):
    assert _connector(load_failure=policy).recompute_failed_loads is recompute


# ----- the decode role: queued ------------------------------------------------------------------


def test_a_request_with_matching_params_is_tracked():
    connector = _connector()
    prompt = list(range(40))
    params = _remote_params(prompt)
    connector.request_added(_request("dec", prompt, params))
    work = _take(connector)
    assert work.tracks == [("dec", parse_remote_prefill(params))]
    assert not (work.holds or work.loads or work.releases or work.cancels or work.unholds)
    [(_, remote)] = work.tracks
    assert remote.address == ("10.0.0.7", 7000) and remote.request_id == "prefill-request"
    assert remote.lease_seconds == 30.0


@pytest.mark.parametrize(
    "overrides",
    [
        {"kv_compat_hash": "compat-theirs"},
        {"remote_prompt_hash": prompt_hash(list(range(1, 41)))},
        {"remote_num_tokens": 39},
        {"remote_num_tokens": 41},
    ],
    ids=["compat", "prompt-hash", "shorter", "longer"],
)
def test_mismatched_params_are_unusable(overrides):
    # The P/D gate (pdserve/server/pd_gate.py) computes such a request's prompt and releases the blocks.
    prompt = list(range(40))
    remote = parse_remote_prefill(_remote_params(prompt, **overrides))
    assert remote is not None
    expected = "kv_compat_hash" if "kv_compat_hash" in overrides else "prompt"
    assert unusable_reason(remote, prompt, COMPAT, wants_prompt_logprobs=False) == expected
    assert unusable_reason(parse_remote_prefill(_remote_params(prompt)), prompt, COMPAT, False) is None


def test_params_for_a_request_asking_for_prompt_logprobs_are_unusable():
    # Prompt logprobs need the prompt's logits: pulled KV has none (a decode leg with echo and
    # logprobs answered 500 before).
    prompt = list(range(40))
    remote = parse_remote_prefill(_remote_params(prompt))
    assert remote is not None
    assert unusable_reason(remote, prompt, COMPAT, wants_prompt_logprobs=True) == "prompt_logprobs"


@pytest.mark.parametrize(
    "params",
    [
        {"do_remote_prefill": True},  # every other field missing
        _remote_params(list(range(40)), remote_port=0),
        _remote_params(list(range(40)), remote_block_ids=[1, 2]),  # three generations for two blocks
        _remote_params(list(range(40)), remote_block_ids=[1, -2, 3]),
        _remote_params(list(range(40)), remote_lease_seconds=0),
        _remote_params(list(range(40)), remote_num_tokens=True),
        _remote_params(list(range(40)), remote_port=70000),
        _remote_params(list(range(40)), remote_block_generations=[0]),
        _remote_params(list(range(40)), remote_host=None),
    ],
    ids=["bare", "port", "lengths", "negative", "lease", "bool", "port-range", "generations", "host"],
)
def test_malformed_params_do_not_parse(params):
    # The P/D gate answers them 400, naming the field: they never reach the core.
    with pytest.raises(ValueError, match="kv_transfer_params"):
        parse_remote_prefill(params)


@pytest.mark.parametrize(
    "params",
    [None, {}, {"do_remote_prefill": False}, {"do_remote_prefill": "yes"}, {"do_remote_decode": True}],
    ids=["none", "empty", "false", "string", "prefill-leg"],
)
def test_requests_without_a_decode_leg_neither_track_nor_release(params):
    connector = _connector()
    request = _request("dec", list(range(40)), params)
    connector.request_added(request)
    _assert_empty(connector)
    assert connector.get_num_new_matched_tokens(request, 0) == (0, False)
    connector.update_state_after_alloc(request, [1, 2, 3], 0)
    connector.request_finished(request, [1, 2, 3], "abort")
    _assert_empty(connector)


# ----- the decode role: admitted ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt_len", "num_local", "expected"),
    [
        (40, 0, (40, True)),
        (40, 16, (24, True)),
        (40, 32, (8, True)),
        (33, 32, (0, False)),  # only the last token is missing: it is computed here anyway
        (32, 16, (16, True)),
        (17, 16, (0, False)),
        (1, 0, (0, False)),  # a one-token prompt: nothing worth a transfer
        (2, 0, (2, True)),
    ],
)
def test_matched_tokens_are_everything_past_the_local_hit(prompt_len, num_local, expected):
    connector = _connector()
    prompt = list(range(prompt_len))
    request = _request("dec", prompt, _remote_params(prompt))
    connector.request_added(request)
    assert connector.get_num_new_matched_tokens(request, num_local) == expected
    # Asking again (the allocation failed and the request waits) gives the same answer.
    assert connector.get_num_new_matched_tokens(request, num_local) == expected


def test_requests_the_connector_does_not_track_match_nothing():
    connector = _connector()
    assert connector.get_num_new_matched_tokens(_request("plain", list(range(40))), 0) == (0, False)


@pytest.mark.parametrize(
    ("prompt_len", "num_local", "first"),
    [(40, 0, 0), (40, 16, 1), (40, 32, 2), (48, 16, 1), (64, 32, 2)],
)
def test_a_load_pulls_only_the_blocks_past_the_local_hit(prompt_len, num_local, first):
    connector = _connector()
    prompt = list(range(prompt_len))
    params = _remote_params(prompt)
    request = _request("dec", prompt, params)
    connector.request_added(request)
    _take(connector)
    num_external, load_async = connector.get_num_new_matched_tokens(request, num_local)
    assert load_async and num_external == prompt_len - num_local
    num_blocks = -(-prompt_len // BLOCK_SIZE)
    local_blocks = [50 + 3 * i for i in range(num_blocks)]

    connector.update_state_after_alloc(request, local_blocks, num_external)

    work = _take(connector)
    assert work.loads == [
        LoadSpec(
            "dec",
            parse_remote_prefill(params),
            local_blocks[first:],
            params["remote_block_ids"][first:],
            params["remote_block_generations"][first:],
        )
    ]
    assert not (work.tracks or work.releases or work.cancels or work.holds or work.unholds)
    # The remote reference is consumed: a preempted request asks again and recomputes instead.
    assert connector.get_num_new_matched_tokens(request, 0) == (0, False)
    connector.update_state_after_alloc(request, local_blocks, 0)
    _assert_empty(connector)


def test_a_full_local_hit_releases_and_loads_nothing():
    connector = _connector()
    prompt = list(range(33))
    params = _remote_params(prompt)
    request = _request("dec", prompt, params)
    connector.request_added(request)
    _take(connector)
    assert connector.get_num_new_matched_tokens(request, 32) == (0, False)

    connector.update_state_after_alloc(request, [1, 2, 3], 0)

    work = _take(connector)
    assert work.releases == [("dec", parse_remote_prefill(params))] and not work.loads
    for reason in ("abort", "stop"):  # released once, whatever happens next
        connector.request_finished(request, [1, 2, 3], reason)
        _assert_empty(connector)


@pytest.mark.parametrize("finish_reason", ["abort", "stop", "length", "error"])
def test_a_request_ending_before_its_blocks_are_allocated_releases(finish_reason):
    connector = _connector()
    prompt = list(range(40))
    params = _remote_params(prompt)
    request = _request("dec", prompt, params)
    connector.request_added(request)
    _take(connector)
    connector.get_num_new_matched_tokens(request, 0)  # asked, but the allocation failed

    assert connector.request_finished(request, [], finish_reason) == (False, None)

    work = _take(connector)
    assert work.releases == [("dec", parse_remote_prefill(params))]
    assert not (work.cancels or work.loads)
    connector.update_state_after_alloc(request, [1, 2, 3], 40)  # nothing left to load from
    _assert_empty(connector)


def _pulling(connector: PDConnectorScheduler, request_id: str = "dec") -> Request:
    prompt = list(range(40))
    request = _request(request_id, prompt, _remote_params(prompt))
    connector.request_added(request)
    num_external, _ = connector.get_num_new_matched_tokens(request, 0)
    connector.update_state_after_alloc(request, [1, 2, 3], num_external)
    work = _take(connector)
    assert [spec.request_id for spec in work.loads] == [request_id]
    return request


def test_an_abort_while_pulling_cancels_the_pull():
    connector = _connector()
    request = _pulling(connector)
    assert connector.request_finished(request, [1, 2, 3], "abort") == (False, None)
    work = _take(connector)
    assert work.cancels == ["dec"] and not (work.releases or work.loads)
    # Only once: a second end (the scheduler ignores it, but a direct caller might) does nothing.
    connector.request_finished(request, [1, 2, 3], "abort")
    _assert_empty(connector)


@pytest.mark.parametrize("finish_reason", ["stop", "length", "error"])
def test_a_request_ending_normally_after_its_pull_does_nothing(finish_reason):
    connector = _connector()
    request = _pulling(connector)
    assert connector.request_finished(request, [1, 2, 3], finish_reason) == (False, None)
    _assert_empty(connector)


def test_many_requests_share_one_work_order_in_call_order():
    connector = _connector()
    prompts = {f"dec-{i}": list(range(i, i + 20 + i)) for i in range(4)}
    requests = {rid: _request(rid, p, _remote_params(p, remote_request_id=f"p-{rid}")) for rid, p in prompts.items()}
    for request in requests.values():
        connector.request_added(request)
    connector.request_finished(_request("leg", list(range(5)), {"do_remote_decode": True}), [9], "length")
    work = _take(connector)
    assert [rid for rid, _ in work.tracks] == list(prompts)
    assert [remote.request_id for _, remote in work.tracks] == [f"p-{rid}" for rid in prompts]
    assert [hold[:2] for hold in work.holds] == [("leg", [9])]


# ----- refused at the door ----------------------------------------------------------------------


def test_releasing_nothing_does_nothing():
    connector = _connector()
    connector.release_remote(None)
    _assert_empty(connector)


def test_releasing_remote_blocks_tells_their_engine_to_free():
    connector = _connector()
    remote = parse_remote_prefill(_remote_params(list(range(40)), kv_compat_hash="another-model"))
    connector.release_remote(remote)  # released whatever the model
    assert _take(connector).releases == [("prefill-request", remote)]


def test_an_empty_outbox_builds_no_work_order():
    connector = _connector()
    _assert_empty(connector)
    # Hooks that produce nothing leave nothing pending.
    plain = _request("plain", list(range(40)))
    connector.request_added(plain)
    assert connector.get_num_new_matched_tokens(plain, 0) == (0, False)
    connector.update_state_after_alloc(plain, [1, 2, 3], 0)
    connector.request_finished(plain, [1, 2, 3], "stop")
    _assert_empty(connector)


# ----- random sequences of the scheduler's calls ------------------------------------------------

SMALL_BLOCK = 4


class DecodeLifecycle(RuleBasedStateMachine):
    """The scheduler's calls on the decode side in any order it can make them. Between two steps
    requests arrive, end, and see their loads land or fail; each step admits some waiting requests
    and then drains the outbox (as ``Scheduler.schedule`` does), so an order never holds a load
    and its cancel together.

    The record of every order taken must show: a tracked remote ends in exactly one load or one
    release, never both; a request without remote blocks produces nothing; a cancel follows its
    request's own load, once, and only for an abort."""

    def __init__(self) -> None:
        super().__init__()
        self.connector = _connector(block_size=SMALL_BLOCK)
        self.ids = itertools.count()
        self.requests: dict[str, Request] = {}
        self.kind: dict[str, str] = {}
        self.phase: dict[str, str] = {}  # waiting | loading | running | finished
        self.finish_reason: dict[str, str] = {}
        self.works: list[TransferWork] = []

    def _in(self, phase: str) -> list[str]:
        return [rid for rid, p in self.phase.items() if p == phase]

    # -- between two steps

    @rule(
        kind=st.sampled_from(["good", "good", "plain"]),
        prompt_len=st.integers(1, 4 * SMALL_BLOCK + 3),
    )
    def add(self, kind, prompt_len):
        number = next(self.ids)
        request_id = f"r{number}"
        prompt = [number * 100 + i for i in range(prompt_len)]
        remote_id = f"p-{request_id}"
        params = _remote_params(prompt, SMALL_BLOCK, remote_request_id=remote_id) if kind == "good" else None
        request = _request(request_id, prompt, params)
        self.requests[request_id] = request
        self.kind[request_id] = kind
        self.phase[request_id] = "waiting"
        self.connector.request_added(request)

    @precondition(lambda self: any(p != "finished" for p in self.phase.values()))
    @rule(data=st.data(), reason=st.sampled_from(["abort", "abort", "stop", "length", "error"]))
    def finish(self, data, reason):
        request_id = data.draw(st.sampled_from([rid for rid, p in self.phase.items() if p != "finished"]))
        hold, params = self.connector.request_finished(self.requests[request_id], [], reason)
        assert (hold, params) == (False, None)  # no decode request is a prefill leg
        self.phase[request_id] = "finished"
        self.finish_reason[request_id] = reason

    @precondition(lambda self: "loading" in self.phase.values())
    @rule(data=st.data(), landed=st.booleans())
    def load_ends(self, data, landed):
        """A load lands (the request runs) or fails (recomputed: it waits again, as a new one)."""
        request_id = data.draw(st.sampled_from(self._in("loading")))
        self.phase[request_id] = "running" if landed else "waiting"

    # -- one scheduler step

    @rule(data=st.data())
    def step(self, data):
        waiting = self._in("waiting")
        admitted = data.draw(st.lists(st.sampled_from(waiting), unique=True) if waiting else st.just([]))
        for request_id in admitted:
            self._admit(request_id, data)
        pending = self.connector.has_pending_work()
        work = self.connector.build_connector_meta()
        assert (work is not None) == pending
        assert not self.connector.has_pending_work() and self.connector.build_connector_meta() is None
        if work is not None:
            assert not {spec.request_id for spec in work.loads} & set(work.cancels)
            self.works.append(work)

    def _admit(self, request_id: str, data) -> None:
        request = self.requests[request_id]
        # Prefix-cache hits are whole blocks and never include the last prompt token.
        num_local = data.draw(st.integers(0, (request.num_tokens - 1) // SMALL_BLOCK)) * SMALL_BLOCK
        num_external, load_async = self.connector.get_num_new_matched_tokens(request, num_local)
        if load_async:
            assert num_external == request.num_tokens - num_local
            assert self.kind[request_id] == "good" and not self._loads(request_id)
            assert not self._count("releases", request_id)
        else:
            assert num_external == 0
        if data.draw(st.booleans()):
            return  # the allocation failed: it stays waiting and is asked again later
        num_blocks = -(-request.num_tokens // SMALL_BLOCK)
        block_ids = [1000 * int(request_id[1:]) + b for b in range(num_blocks)]
        self.connector.update_state_after_alloc(request, block_ids, num_external)
        loads = [spec for spec in self.connector.outbox.pending.loads if spec.request_id == request_id]
        if load_async:
            [spec] = loads
            first = num_local // SMALL_BLOCK
            assert spec.local_block_ids == block_ids[first:]
            assert spec.remote_block_ids == spec.remote.block_ids[first:]
            assert spec.generations == spec.remote.generations[first:]
            assert spec.remote.request_id == f"p-{request_id}"
            self.phase[request_id] = "loading"
        else:
            assert not loads
            self.phase[request_id] = "running"

    # -- the record

    def _all(self) -> list[TransferWork]:
        return [*self.works, self.connector.outbox.pending]

    def _loads(self, request_id: str) -> list[LoadSpec]:
        return [spec for work in self._all() for spec in work.loads if spec.request_id == request_id]

    def _count(self, field: str, request_id: str) -> int:
        return sum(1 for work in self._all() for rid, _ in getattr(work, field) if rid == request_id)

    @invariant()
    def each_remote_ends_in_one_load_or_one_release(self):
        works = self._all()
        assert not any(work.holds or work.unholds for work in works)
        for request_id, kind in self.kind.items():
            tracks = self._count("tracks", request_id)
            releases = self._count("releases", request_id)
            loads = len(self._loads(request_id))
            cancels = sum(work.cancels.count(request_id) for work in works)
            if kind == "good":
                assert tracks == 1 and loads + releases <= 1
                if self.phase[request_id] == "finished":
                    assert loads + releases == 1, "a tracked remote was neither loaded nor released"
            else:
                assert (tracks, loads, releases) == (0, 0, 0)
            assert cancels == (1 if loads and self.finish_reason.get(request_id) == "abort" else 0)
            if cancels:
                load_at = next(i for i, w in enumerate(works) if any(s.request_id == request_id for s in w.loads))
                cancel_at = next(i for i, w in enumerate(works) if request_id in w.cancels)
                assert load_at < cancel_at

    def teardown(self):
        # Everything ends and one more step drains: then the record is complete for every request.
        for request_id, phase in self.phase.items():
            if phase != "finished":
                self.connector.request_finished(self.requests[request_id], [], "abort")
                self.phase[request_id] = "finished"
                self.finish_reason[request_id] = "abort"
        work = self.connector.build_connector_meta()
        if work is not None:
            self.works.append(work)
        self.each_remote_ends_in_one_load_or_one_release()


DecodeLifecycle.TestCase.settings = settings(deadline=None, stateful_step_count=30)
TestDecodeLifecycle = DecodeLifecycle.TestCase


# ----- hybrid models: the state slot's rows follow the blocks -----------------------------------


def test_a_hybrid_prefill_leg_holds_its_state_rows_and_a_decode_pulls_them_into_its_own():
    generations = np.arange(NUM_BLOCKS, dtype=np.int64) + 1
    prefill = PDConnectorScheduler(_config(), COMPAT, BLOCK_SIZE, [PORT], generations, state_rows=2)
    prompt = list(range(1000, 1040))  # 2.5 blocks
    leg = _request("leg", prompt, {"do_remote_decode": True})
    assert prefill.hands_over(leg)
    # Its blocks (the 4th opened for the sampled token), then its slot's two rows.
    hold, params = prefill.request_finished(leg, [9, 3, 12, 5, 60, 61], "length")
    assert hold and params is not None
    assert params["remote_block_ids"] == [9, 3, 12, 60, 61]
    assert params["remote_block_generations"] == [10, 4, 13, 61, 62]
    assert [hold[:2] for hold in _take(prefill).holds] == [("leg", [9, 3, 12, 60, 61])]

    decode = PDConnectorScheduler(_config(), COMPAT, BLOCK_SIZE, [PORT], generations, state_rows=2)
    request = _request("d", prompt, params)
    decode.request_added(request)
    assert decode.get_num_new_matched_tokens(request, 0) == (40, True)
    decode.update_state_after_alloc(request, [20, 21, 22, 50, 51], 40)
    (load,) = _take(decode).loads
    assert (load.local_block_ids, load.remote_block_ids) == ([20, 21, 22, 50, 51], [9, 3, 12, 60, 61])
    assert load.generations == [10, 4, 13, 61, 62]


def test_hybrid_params_without_a_state_slot_are_not_pulled_from():
    decode = PDConnectorScheduler(_config(), COMPAT, BLOCK_SIZE, [PORT], np.zeros(NUM_BLOCKS, np.int64), state_rows=2)
    prompt = list(range(40))
    request = _request("d", prompt, _remote_params(prompt))  # the blocks only: no slot to read the state from
    decode.request_added(request)
    assert not decode.expects_remote_kv(request)
    assert [request_id for request_id, _ in _take(decode).releases] == ["d"]
