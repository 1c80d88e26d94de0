"""The P/D connector's scheduler side: which requests hold blocks for a remote decode, which
pull blocks from a remote prefill, and the work order handed to the transfer agent each step.

Prefill side: a request sent with ``do_remote_decode`` that ends by reaching its length (the
normal end of the one-token prefill leg) keeps its blocks; its response carries where they are
and their generations. Any other ending (abort, error) frees them at once and returns nothing.

Decode side: a request with ``do_remote_prefill`` has its remote lease renewed from the moment it
is queued. When it is admitted, only the blocks beyond the local prefix-cache hit are pulled; the
remote reference is consumed then, so a later preemption recomputes instead of pulling again. A
request that ends before its pull, or needs nothing pulled, still tells the prefill side to free.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdserve.kvtransfer.base import ConnectorRequest, KVConnectorScheduler
from pdserve.kvtransfer.config import KVTransferConfig
from pdserve.kvtransfer.params import (
    RemotePrefill,
    parse_remote_prefill,
    prompt_hash,
    remote_prefill_params,
    wants_remote_decode,
)

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class LoadSpec:
    """Pull ``remote_block_ids`` (with their expected generations) into ``local_block_ids``."""

    request_id: str
    remote: RemotePrefill
    local_block_ids: list[int]
    remote_block_ids: list[int]
    generations: list[int]


@dataclass(slots=True)
class TransferWork:
    """One step's work order for the transfer agent."""

    holds: list[tuple[str, list[int]]] = field(default_factory=list)  # prefill: (request id, block ids)
    tracks: list[tuple[str, RemotePrefill]] = field(default_factory=list)  # decode: renew these leases
    loads: list[LoadSpec] = field(default_factory=list)
    releases: list[tuple[str, RemotePrefill]] = field(default_factory=list)  # decode: tell prefill to free
    # decode: requests that ended; a pull of theirs not started yet is dropped (and prefill told to free)
    cancels: list[str] = field(default_factory=list)
    unholds: list[str] = field(default_factory=list)  # prefill: holds dropped (the scheduler freed the blocks)

    def __bool__(self) -> bool:
        return bool(self.holds or self.tracks or self.loads or self.releases or self.cancels or self.unholds)


class PDConnectorScheduler(KVConnectorScheduler):
    def __init__(self, config: KVTransferConfig, compat_hash: str, block_size: int) -> None:
        self.config = config
        self.compat_hash = compat_hash
        self.block_size = block_size
        self.advertised_port = config.side_channel_port  # the transfer agent sets it once bound
        self.recompute_failed_loads = config.load_failure == "recompute"
        self._generations: np.ndarray | None = None
        self._remote: dict[str, RemotePrefill] = {}  # decode: queued requests not yet allocated
        self._pulling: set[str] = set()  # decode: requests whose pull was handed to the agent
        self._work = TransferWork()

    def bind_block_generations(self, generations: np.ndarray) -> None:
        self._generations = generations

    # ----- decode side ----------------------------------------------------------------------

    def request_added(self, request: ConnectorRequest) -> None:
        try:
            remote = parse_remote_prefill(request.kv_transfer_params)
        except ValueError as error:  # the API server validates first; a direct caller may not have
            logger.warning("request %s: ignoring kv_transfer_params (%s)", request.request_id, error)
            return
        if remote is None:
            return
        if (remote.compat_hash != self.compat_hash or remote.num_tokens != len(request.prompt_token_ids)
                or remote.prompt_hash != prompt_hash(request.prompt_token_ids)):
            # Blocks of another model, layout or text: computing locally is the only correct answer.
            logger.warning("request %s: remote KV does not match this engine or prompt; prefilling locally",
                           request.request_id)
            self._work.releases.append((request.request_id, remote))
            return
        self._remote[request.request_id] = remote
        self._work.tracks.append((request.request_id, remote))

    def release_remote(self, kv_transfer_params: dict[str, Any] | None) -> None:
        try:
            remote = parse_remote_prefill(kv_transfer_params)
        except ValueError:
            return  # nothing this engine could ever have pulled
        if remote is not None:
            self._work.releases.append((remote.request_id, remote))

    def has_pending_work(self) -> bool:
        return bool(self._work)

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> tuple[int, bool]:
        if request.request_id not in self._remote:
            return 0, False
        # The last prompt token is computed here anyway (its logits give the first output token),
        # so a load that would bring only that token is not worth a transfer.
        if request.num_tokens - 1 - num_computed_tokens <= 0:
            return 0, False
        return request.num_tokens - num_computed_tokens, True

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        remote = self._remote.pop(request.request_id, None)
        if remote is None:
            return
        if not num_external_tokens:  # everything was in the local prefix cache
            self._work.releases.append((request.request_id, remote))
            return
        first = (request.num_tokens - num_external_tokens) // self.block_size
        last = -(-request.num_tokens // self.block_size)
        self._pulling.add(request.request_id)
        self._work.loads.append(LoadSpec(request.request_id, remote, block_ids[first:last],
                                         remote.block_ids[first:last], remote.generations[first:last]))

    # ----- both ---------------------------------------------------------------------------

    def request_finished(self, request: ConnectorRequest, block_ids: list[int],
                         finish_reason: str) -> tuple[bool, dict[str, Any] | None]:
        remote = self._remote.pop(request.request_id, None)
        if remote is not None:  # ended while queued, before any pull
            self._work.releases.append((request.request_id, remote))
        elif request.request_id in self._pulling:
            self._pulling.discard(request.request_id)
            if finish_reason == "abort":
                self._work.cancels.append(request.request_id)
        if not (wants_remote_decode(request.kv_transfer_params) and finish_reason == "length" and block_ids):
            return False, None
        assert self._generations is not None, "the scheduler binds the block generations at start"
        num_tokens = len(request.prompt_token_ids)
        held = block_ids[:-(-num_tokens // self.block_size)]
        self._work.holds.append((request.request_id, list(held)))
        return True, remote_prefill_params(
            engine_id=self.config.engine_id, request_id=request.request_id, host=self.config.host,
            port=self.advertised_port, block_ids=list(held), generations=self._generations[held].tolist(),
            num_tokens=num_tokens, prompt=request.prompt_token_ids, compat_hash=self.compat_hash,
            lease_seconds=self.config.lease_seconds)

    def hold_cancelled(self, request_id: str) -> None:
        self._work.unholds.append(request_id)

    def build_connector_meta(self) -> TransferWork | None:
        if not self._work:
            return None
        work, self._work = self._work, TransferWork()
        return work
