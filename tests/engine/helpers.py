"""Test helpers for the engine core: invariant checks, the output oracle, and a KV connector
double that loads and holds blocks asynchronously.

The connector double stands in for the NIXL/TCP connectors of the disaggregation work (not built
yet): its scheduler side is a real KVConnectorScheduler, and its worker side "loads" the true
prompt tokens into the fake runner's KV after a delay of some steps. So a scheduler that frees or
reuses blocks while a load into them is in flight produces wrong tokens, which the oracle catches.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from pdserve.api.peer_kv import PeerKV
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.scheduler_config import SchedulerConfig
from pdserve.kvtransfer.base import ConnectorRequest, KVConnectorOutput, KVConnectorScheduler
from pdserve.testing.deferred import DeferredExecutor
from pdserve.testing.fake_runner import FakeModelRunner, reference_generate

VOCAB = 50
EOS = 7


def make_engine(
    connector: KVConnectorScheduler | None = None, async_scheduling: bool = False, **config: Any
) -> EngineCore:
    """An engine over the fake runner; with ``async_scheduling``, the runner one step behind the core
    (``DeferredExecutor``), as a worker process is."""
    scheduler_config = SchedulerConfig(**config)
    worker = connector.worker if isinstance(connector, FakeRemoteConnector) else None
    runner = FakeModelRunner(
        scheduler_config.num_blocks, scheduler_config.block_size, VOCAB, worker, scheduler_config.num_state_slots
    )
    executor = DeferredExecutor(runner) if async_scheduling else runner
    return EngineCore(Scheduler(scheduler_config, connector), executor, async_scheduling)


def expected_output(request: Request) -> tuple[list[int], str]:
    """What a request must have produced when it finished normally, and its finish reason."""
    params = request.sampling_params
    tokens = reference_generate(request.prompt_token_ids, request.max_output_tokens, VOCAB)
    for index, token in enumerate(tokens):
        if index + 1 < params.min_tokens:
            continue
        if (token == request.eos_token_id and not params.ignore_eos) or token in params.stop_token_id_set:
            return tokens[: index + 1], "stop"
    return tokens, "length"


def run_to_completion(engine: EngineCore, max_steps: int = 10_000) -> dict[str, str]:
    """Step until no work is left; returns each finished request's finish reason."""
    reasons: dict[str, str] = {}
    for _ in range(max_steps):
        if not engine.has_work():
            return reasons
        for output in engine.step():
            if output.finish_reason is not None:
                reasons[output.request_id] = output.finish_reason
        check_invariants(engine.scheduler)
    raise AssertionError(f"engine still has work after {max_steps} steps")


def check_invariants(scheduler: Scheduler, max_placeholders: int = 0) -> None:
    """``max_placeholders``: sampled tokens a request may have on their way between steps (0 when
    each step's output is applied within it; with async scheduling, the tokens of the step in flight
    and of the one scheduled ahead of it)."""
    kv = scheduler.kv_cache_manager
    pool = kv.block_pool
    block_size = kv.block_size

    # Quarantined blocks (abandoned loads) are owned by their quarantine until released.
    owned = [*kv.req_to_blocks.values(), *kv.quarantined.values()]
    owners = Counter(block.block_id for blocks in owned for block in blocks)
    for block in pool.blocks:
        assert block.ref_cnt == owners[block.block_id], f"{block}: {owners[block.block_id]} owners"
        assert (block.ref_cnt == 0) == (block.block_id in pool.free_queue), block
    assert pool.num_free_blocks + sum(1 for b in pool.blocks if b.ref_cnt > 0) == pool.num_blocks
    for block_hash, block in pool.cached_blocks.items():
        assert block.block_hash == block_hash
    for request_id, blocks in kv.req_to_blocks.items():
        assert request_id in scheduler.requests, f"blocks owned by unknown request {request_id}"
        assert kv.req_to_block_ids[request_id] == [b.block_id for b in blocks]
        assert len(set(kv.req_to_block_ids[request_id])) == len(blocks), "a block appears twice in a table"

    slots = kv.state_slots
    if slots is not None:
        # A hybrid model's request owns one slot exactly while it owns blocks; no slot has two owners.
        assert set(slots.req_to_slot) == set(kv.req_to_blocks), (slots.req_to_slot, list(kv.req_to_blocks))
        taken = [*slots.req_to_slot.values(), *(slot for held in slots.quarantined.values() for slot in held)]
        assert len(set(taken)) == len(taken), f"a state slot has two owners: {slots.req_to_slot}"
        assert slots.num_free_slots + len(taken) == slots.num_slots

    remote_kv = scheduler.remote_kv
    held = sum(kv.num_owned_blocks(request_id) for request_id in remote_kv.held_for_remote)
    assert remote_kv._num_held_blocks == held <= remote_kv.max_held_blocks
    held = sum(kv.num_owned_blocks(request_id) for request_id in remote_kv.held_for_peers)
    assert remote_kv._num_peer_held_blocks == held <= remote_kv.max_peer_held_blocks
    assert len(scheduler.running) <= scheduler.config.max_num_seqs
    for request in scheduler.running:
        assert request.status == RequestStatus.RUNNING
    for request in scheduler.waiting:
        assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED, RequestStatus.WAITING_FOR_REMOTE_KVS)
    for request in scheduler.requests.values():
        assert 0 <= request.num_output_placeholders <= max_placeholders, request
        assert 0 <= request.num_computed_tokens <= request.num_tokens + request.num_output_placeholders, request
        owned_tokens = kv.num_owned_blocks(request.request_id) * block_size
        if request.status in (RequestStatus.RUNNING, RequestStatus.WAITING_FOR_REMOTE_KVS):
            # Computed tokens, those scheduled this step, and those being loaded all have slots.
            assert owned_tokens >= request.num_computed_tokens, request
        elif request.status == RequestStatus.PREEMPTED:
            assert owned_tokens == 0, request
        elif request.status == RequestStatus.WAITING:
            # Only a request whose remote KV has landed waits while owning blocks.
            loaded = "do_remote_prefill" in script_of(request)
            assert owned_tokens == 0 or (loaded and owned_tokens >= request.num_computed_tokens), request
        elif request.is_finished:
            assert (
                request.request_id in remote_kv.held_for_remote
                or request.request_id in remote_kv.held_for_peers
                or request.request_id in remote_kv.aborted_while_loading
            ), request


def assert_nothing_leaks(scheduler: Scheduler) -> None:
    kv = scheduler.kv_cache_manager
    assert not scheduler.requests, scheduler.requests
    assert not kv.req_to_blocks and not kv.quarantined
    assert kv.block_pool.num_free_blocks == kv.num_blocks
    assert all(block.ref_cnt == 0 for block in kv.block_pool.blocks)
    if kv.state_slots is not None:
        assert kv.state_slots.num_free_slots == kv.state_slots.num_slots


@dataclass
class _Transfer:
    kind: str  # "load" or "hold"
    request_id: str
    steps_left: int
    block_ids: list[int] | None = None
    start: int = 0
    token_ids: list[int] | None = None
    fail: bool = False
    late_write: int | None = None  # fails "in flight", then writes wrong KV this many steps later


class FakeRemoteWorker:
    """Worker side of the double: completes each transfer after its delay in steps."""

    def __init__(self) -> None:
        self.in_flight: list[_Transfer] = []

    def step(self, metadata: Any, runner: FakeModelRunner) -> KVConnectorOutput:
        self.in_flight.extend(metadata or ())
        output = KVConnectorOutput()
        still_in_flight = []
        for transfer in self.in_flight:
            if transfer.steps_left > 0:
                transfer.steps_left -= 1
                still_in_flight.append(transfer)
            elif transfer.kind == "load" and transfer.late_write is not None:
                # A read given up while still running (a NIXL timeout): failed now, written later.
                output.failed_recving_in_flight.add(transfer.request_id)
                transfer.kind, transfer.steps_left = "drain", transfer.late_write
                still_in_flight.append(transfer)
            elif transfer.kind == "drain":
                runner.write_tokens(transfer.block_ids, transfer.start, [(t + 1) % VOCAB for t in transfer.token_ids])
                output.failed_recving.add(transfer.request_id)
            elif transfer.kind == "load" and transfer.fail:
                # A transfer that broke half way: wrong KV in the blocks, reported as failed.
                runner.write_tokens(transfer.block_ids, transfer.start, [(t + 1) % VOCAB for t in transfer.token_ids])
                output.failed_recving.add(transfer.request_id)
            elif transfer.kind == "load":
                runner.write_tokens(transfer.block_ids, transfer.start, transfer.token_ids)
                output.finished_recving.add(transfer.request_id)
            else:
                output.finished_sending.add(transfer.request_id)
        self.in_flight = still_in_flight
        return output


class ScriptedRequest(Request):
    """A request with a script for FakeRemoteConnector: {"do_remote_prefill": True, "delay": k}: the prompt's
    uncached tokens are loaded asynchronously, landing k steps later (with "fail": True, the load writes wrong
    KV and fails; with "late_write": j, it fails while still in flight and writes wrong KV j steps later).
    {"do_remote_decode": True, "delay": k} (a prefill leg): on a length-capped finish the blocks are held for
    k steps, then released. {"peer_hold": True, "delay": k}: when it ends (stop or length) its blocks are held for
    peer reads for k steps, then released."""

    def __init__(self, *args: Any, script: dict[str, Any], **kwargs: Any) -> None:
        peer = PeerKV(hold="ab" * 16) if script.get("peer_hold") else None
        super().__init__(*args, remote_decode=bool(script.get("do_remote_decode")), peer=peer, **kwargs)
        self.script = dict(script)


def script_of(request: ConnectorRequest) -> dict[str, Any]:
    """A request's script (nothing for a plain request)."""
    return getattr(request, "script", {})


class FakeRemoteConnector(KVConnectorScheduler):
    """Plays each request's script (``ScriptedRequest``)."""

    def __init__(self, recompute_failed_loads: bool = True) -> None:
        self.recompute_failed_loads = recompute_failed_loads
        self.worker = FakeRemoteWorker()
        self._pending: list[_Transfer] = []
        self.num_loads = 0
        self.peer_holds_dropped: list[str] = []

    def peer_hold_dropped(self, request_id: str) -> None:
        self.peer_holds_dropped.append(request_id)

    def hands_over(self, request: ConnectorRequest) -> bool:
        return request.remote_decode

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> tuple[int, bool]:
        if not script_of(request).get("do_remote_prefill"):
            return 0, False
        return request.num_tokens - num_computed_tokens, True

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        params = script_of(request)
        if not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # one transfer per request, even if it is preempted later
        if num_external_tokens:
            start = request.num_tokens - num_external_tokens
            self.num_loads += 1
            self._pending.append(
                _Transfer(
                    "load",
                    request.request_id,
                    params.get("delay", 0),
                    list(block_ids),
                    start,
                    list(request.prompt_token_ids[start:]),
                    bool(params.get("fail")),
                    params.get("late_write"),
                )
            )

    def build_connector_meta(self) -> Any:
        pending, self._pending = self._pending, []
        return pending or None

    def request_finished(
        self, request: ConnectorRequest, block_ids: list[int], finish_reason: str
    ) -> tuple[bool, dict[str, Any] | None]:
        params = script_of(request)
        if params.get("peer_hold") and finish_reason in ("stop", "length"):
            self._pending.append(_Transfer("hold", request.request_id, params.get("delay", 0)))
            return True, None
        if request.remote_decode and finish_reason == "length":
            self._pending.append(_Transfer("hold", request.request_id, params.get("delay", 0)))
            return True, {"remote_block_ids": list(block_ids)}
        return False, None


def make_request(
    request_id: str,
    prompt: list[int],
    script: dict[str, Any] | None = None,
    cache_salt: str | None = None,
    **sampling: Any,
) -> Request:
    """A request for the fake runner; with ``script``, one FakeRemoteConnector plays (``ScriptedRequest``)."""
    from pdserve.engine.sampling_params import SamplingParams

    if script is None:
        return Request(request_id, prompt, SamplingParams(**sampling), EOS, cache_salt=cache_salt)
    return ScriptedRequest(request_id, prompt, SamplingParams(**sampling), EOS, cache_salt=cache_salt, script=script)


def prompt_of(length: int, seed: int) -> list[int]:
    """A reproducible prompt whose tokens avoid EOS (so only generated tokens can stop)."""
    import random

    rng = random.Random(seed)
    return [rng.choice([t for t in range(VOCAB) if t != EOS]) for _ in range(length)]
