"""The decode role's P/D behaviour, top to bottom. The life of a request on a decode engine:

1. The router sends the client's request with the prefill leg's ``kv_transfer_params``
   (``do_remote_prefill`` and where the blocks are). The API process's P/D gate
   (pdserve/server/pd_gate.py) parses them once (``parse_remote_prefill``): malformed params are a
   400 before anything is queued. Once the prompt is known it screens them (``unusable_reason``):
   params for another model, layout or prompt text, or a request for prompt logprobs, are never
   pulled (the prompt is computed locally and the prefill engine told to free). A request refused
   at the door (bad value, overload, draining) tells the prefill engine to free (``release_remote``),
   or its blocks would wait for the lease. What passes reaches the core as a ``RemotePrefill``.
2. Queued (``request_added``): the request's remote lease is renewed from now on, so its blocks
   outlive a long queue; a hybrid model's params that do not end with a state slot's rows are never
   pulled (only the core knows the slot's size).
3. Admitted: the scheduler counts the prompt tokens already in the local prefix cache and asks
   ``get_num_new_matched_tokens`` how many more can come from the prefill engine: all the rest,
   asynchronously (the last prompt token is recomputed here for its logits, so a load of only
   that token is skipped). It allocates blocks for them and parks the request in
   ``WAITING_FOR_REMOTE_KVS``.
4. ``update_state_after_alloc`` turns that into a ``LoadSpec``: only the blocks past the local
   hit, with their expected generations (a hybrid model's state slot rows too, after the
   blocks). The remote reference is consumed here, so a later preemption recomputes instead of
   pulling twice; a full local hit pulls nothing and releases.
5. The transfer agent hand-shakes with the prefill engine (once per peer), pulls, checks the
   generations (stale blocks are a failure, never data) and tells the prefill engine to free.
   The scheduler caches the landed blocks and the request runs. A failed pull recomputes the
   prompt or fails the request (``--kv-load-failure``).
6. Ending before the pull (abort, a full local hit) releases the remote blocks; an abort while
   the pull is pending cancels it; an abort mid-pull keeps the blocks until the pull drains.
"""

from __future__ import annotations

import logging

from pdserve.kvtransfer.base import ConnectorRequest
from pdserve.kvtransfer.params import RemotePrefill, prompt_hash
from pdserve.kvtransfer.work import LoadSpec, WorkOrders

logger = logging.getLogger(__name__)


def unusable_reason(
    remote: RemotePrefill, prompt_token_ids: list[int], compat_hash: str | None, wants_prompt_logprobs: bool
) -> str | None:
    """Why a decode leg's remote blocks cannot serve this request (None: they can). Computing the
    prompt here is then the only correct answer: blocks of another model or layout, or of another
    text, would generate from the wrong KV; prompt logprobs need the prompt's logits."""
    if remote.compat_hash != compat_hash:
        return "kv_compat_hash"
    if remote.num_tokens != len(prompt_token_ids) or remote.prompt_hash != prompt_hash(prompt_token_ids):
        return "prompt"
    if wants_prompt_logprobs:
        return "prompt_logprobs"
    return None


class DecodeSide:
    def __init__(self, compat_hash: str, block_size: int, outbox: WorkOrders, state_rows: int = 0) -> None:
        self.compat_hash = compat_hash
        self.block_size = block_size
        self.outbox = outbox
        self.state_rows = state_rows  # the trailing rows of both sides' transfer ids: the state slot
        self._remote: dict[str, RemotePrefill] = {}  # queued requests not yet allocated
        self._pulling: set[str] = set()  # requests whose pull was handed to the agent

    def request_added(self, request: ConnectorRequest) -> None:
        remote = request.remote_prefill
        if remote is None:
            return
        if self.state_rows and len(remote.block_ids) != self._num_rows(remote.num_tokens):
            # The params do not end with a state slot's rows: nothing to pull the state from.
            logger.warning("request %s: remote KV has no state slot; prefilling locally", request.request_id)
            self.outbox.pending.releases.append((request.request_id, remote))
            return
        self._remote[request.request_id] = remote
        self.outbox.pending.tracks.append((request.request_id, remote))

    def _num_rows(self, num_tokens: int) -> int:
        """A hybrid prefill's transfer ids for ``num_tokens``: the prompt's blocks and a state slot."""
        return -(-num_tokens // self.block_size) + self.state_rows

    def release_remote(self, remote: RemotePrefill | None) -> None:
        if remote is not None:
            self.outbox.pending.releases.append((remote.request_id, remote))

    def expects_remote_kv(self, request: ConnectorRequest) -> bool:
        return request.request_id in self._remote

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> tuple[int, bool]:
        if request.request_id not in self._remote:
            return 0, False
        # The last prompt token is computed here anyway (its logits give the first output token),
        # so a load that would bring only that token is not worth a transfer.
        if request.num_tokens - 1 - num_computed_tokens <= 0:
            return 0, False
        return request.num_tokens - num_computed_tokens, True

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        remote = self._remote.pop(request.request_id, None)
        if remote is None:
            return
        if not num_external_tokens:  # everything was in the local prefix cache
            self.outbox.pending.releases.append((request.request_id, remote))
            return
        first = (request.num_tokens - num_external_tokens) // self.block_size
        last = -(-request.num_tokens // self.block_size)
        local, remote_ids, generations = (
            block_ids[first:last],
            remote.block_ids[first:last],
            remote.generations[first:last],
        )
        if self.state_rows:  # the state as of the last prompt token, whose KV is computed here again
            local = local + block_ids[-self.state_rows :]
            remote_ids = remote_ids + remote.block_ids[-self.state_rows :]
            generations = generations + remote.generations[-self.state_rows :]
        self._pulling.add(request.request_id)
        self.outbox.pending.loads.append(LoadSpec(request.request_id, remote, local, remote_ids, generations))

    def request_finished(self, request: ConnectorRequest, finish_reason: str) -> None:
        remote = self._remote.pop(request.request_id, None)
        if remote is not None:  # ended while queued, before any pull
            self.outbox.pending.releases.append((request.request_id, remote))
        elif request.request_id in self._pulling:
            self._pulling.discard(request.request_id)
            if finish_reason == "abort":
                self.outbox.pending.cancels.append(request.request_id)
