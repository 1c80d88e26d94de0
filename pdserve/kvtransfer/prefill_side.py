"""The prefill role's P/D behaviour, top to bottom. The life of a request on a prefill engine:

1. The router sends the client's request with ``kv_transfer_params={"do_remote_decode": true}``
   and ``stream=false``. The API process's P/D gate (pdserve/server/pd_gate.py) takes it as a prefill
   leg (``remote_decode``: a streamed one is a 400), and its serving layer (pdserve/server/serving.py)
   rewrites its sampling as the prefill-leg field contract says (``pdserve.api.prefill_leg.leg_sampling``):
   one token, EOS, stop strings, stop tokens and ``min_tokens`` off, so the leg always ends by length and
   its blocks are always handed over.
2. The scheduler runs the prompt like any other (prefix-cache hits, chunked prefill) and samples
   the one token.
   A hybrid model's leg runs its last prompt token as a step of its own that leaves the request's
   state slot as it found it: what it hands over is the state before that token, which the decode
   engine computes again (for its logits) and a linear layer must not see twice.
3. It finishes by length: ``PrefillSide.request_finished`` keeps its prompt blocks (the scheduler
   holds them instead of freeing) and returns ``remote_prefill_params`` — where the blocks are, their
   generations, the prompt's length and hash, the KV compatibility hash, the lease and the hold's random
   token (only a peer that names it reads, renews or releases the hold) — which the API process puts in the
   response for the router to forward to a decode engine.
4. The transfer agent holds the blocks with a lease (``--kv-lease-seconds``): the decode engine
   renews it while its request queues, pulls the blocks (NIXL READ, or TCP reads served by this
   agent), then releases them. A release, a finished pull or an expired lease reports the hold
   as finished sending; the scheduler frees the blocks, which bumps their generations, so any
   later read of them is detected as stale.
5. Any other ending (abort, error) frees the blocks at once and returns no params. A leg whose
   caller left after it finished but before it could hand the params on (aborted while held)
   cancels the hold at once (``hold_cancelled``) instead of waiting for the lease.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pdserve.kvtransfer.base import ConnectorRequest
from pdserve.kvtransfer.config import KVTransferConfig
from pdserve.kvtransfer.params import new_hold_token, remote_prefill_params
from pdserve.kvtransfer.work import WorkOrders


class PrefillSide:
    def __init__(
        self,
        config: KVTransferConfig,
        compat_hash: str,
        block_size: int,
        advertised_ports: list[int],
        block_generations: np.ndarray,
        outbox: WorkOrders,
        state_rows: int = 0,
    ) -> None:
        self.config = config
        self.compat_hash = compat_hash
        self.block_size = block_size
        self.advertised_ports = advertised_ports
        self.generations = block_generations
        self.outbox = outbox
        self.state_rows = state_rows  # the trailing rows of a request's transfer ids: its state slot

    def request_finished(
        self, request: ConnectorRequest, block_ids: list[int], finish_reason: str
    ) -> tuple[bool, dict[str, Any] | None]:
        """Hold a finished prefill leg's prompt blocks (and state slot) and say where they are; else nothing."""
        if not (request.remote_decode and finish_reason == "length" and block_ids):
            return False, None
        num_tokens = len(request.prompt_token_ids)
        held = block_ids[: -(-num_tokens // self.block_size)]
        if self.state_rows:
            held += block_ids[-self.state_rows :]
        token = new_hold_token()
        self.outbox.pending.holds.append((request.request_id, list(held), token))
        return True, remote_prefill_params(
            engine_id=self.config.engine_id,
            request_id=request.request_id,
            host=self.config.host,
            ports=self.advertised_ports,
            block_ids=list(held),
            generations=self.generations[held].tolist(),
            num_tokens=num_tokens,
            prompt=request.prompt_token_ids,
            compat_hash=self.compat_hash,
            lease_seconds=self.config.lease_seconds,
            hold_token=token,
        )

    def hold_cancelled(self, request_id: str) -> None:
        self.outbox.pending.unholds.append(request_id)
