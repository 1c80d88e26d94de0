"""The P/D connector's scheduler side: the hooks of ``KVConnectorScheduler`` routed to the two
role behaviours, ``prefill_side`` (hold a finished prefill leg's blocks for a decode engine) and
``decode_side`` (pull a prompt's blocks from a prefill engine), and to ``peer_side`` (hold a finished turn's
blocks for peers; read a prompt's leading blocks from one), which share one work order for the transfer agent.
Each hook reads top to bottom in its side's module.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pdserve.kvtransfer.base import ConnectorRequest, KVConnectorOutput, KVConnectorScheduler, TierStats
from pdserve.kvtransfer.config import KVTransferConfig
from pdserve.kvtransfer.connectors import ConnectorContext
from pdserve.kvtransfer.decode_side import DecodeSide
from pdserve.kvtransfer.params import RemotePrefill
from pdserve.kvtransfer.peer_side import MEDIUM as PEER_MEDIUM
from pdserve.kvtransfer.peer_side import PeerSide
from pdserve.kvtransfer.prefill_side import PrefillSide
from pdserve.kvtransfer.work import TransferWork, WorkOrders

# Beyond the agent's own bounds, before the scheduler gives up on a load's report.
LOAD_REPORT_SLACK_S = 5.0


class PDConnectorScheduler(KVConnectorScheduler):
    def __init__(
        self,
        config: KVTransferConfig,
        compat_hash: str,
        block_size: int,
        advertised_ports: list[int],
        block_generations: np.ndarray,
        state_rows: int = 0,
        block_bytes: int = 0,
        num_ranks: int = 1,
    ) -> None:
        """``advertised_ports``: where each rank's transfer agent listens (rank order); ``block_generations``:
        the cache rows' generation array, handed out with held blocks; ``state_rows``: the rows of a
        request's state slot (hybrid models), which follow its blocks in every transfer; ``block_bytes``: one
        block over every one of the ``num_ranks`` ranks."""
        self.compat_hash = compat_hash
        self.recompute_failed_loads = config.load_failure == "recompute"
        # The agent bounds a pull by a handshake and a transfer timeout (after any injected delay);
        # a load still unreported well after that was lost, and the watchdog ends it.
        self.load_report_timeout = 2 * config.transfer_timeout + config.faults.delay_load + LOAD_REPORT_SLACK_S
        self.quarantine_alarm_seconds = 3 * config.transfer_timeout
        self.max_held_fraction = config.max_held_fraction
        self.peer_hold_fraction = config.peer_hold_fraction if config.peer_hold_seconds > 0 else 0.0
        self.host = config.host
        self.peer_hold_seconds = config.peer_hold_seconds
        self.advertised_ports = advertised_ports
        self.outbox = WorkOrders()
        self.prefill = PrefillSide(
            config, compat_hash, block_size, advertised_ports, block_generations, self.outbox, state_rows
        )
        self.decode = DecodeSide(compat_hash, block_size, self.outbox, state_rows)
        self.peers = PeerSide(
            config, block_size, block_bytes // num_ranks, num_ranks, block_generations, self.outbox, state_rows
        )

    @classmethod
    def from_context(cls, context: ConnectorContext) -> PDConnectorScheduler:
        if context.config is None or context.block_generations is None:
            raise ValueError("the P/D connector runs on a P/D role's engine, next to its transfer agents")
        return cls(
            context.config,
            context.compat_hash,
            context.block_size,
            context.advertised_ports,
            context.block_generations,
            context.state_rows,
            context.block_bytes,
            context.num_ranks,
        )

    def request_added(self, request: ConnectorRequest) -> None:
        self.decode.request_added(request)

    def release_remote(self, remote: RemotePrefill | None) -> None:
        self.decode.release_remote(remote)

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> tuple[int, bool]:
        if self.decode.expects_remote_kv(request):
            return self.decode.get_num_new_matched_tokens(request, num_computed_tokens)
        return self.peers.get_num_new_matched_tokens(request, num_computed_tokens)

    def recompute_failed_load(self, request: ConnectorRequest) -> bool:
        # A peer read is an offer, never a promise: a failed one always recomputes.
        return self.peers.read_tried(request.request_id) or self.recompute_failed_loads

    def hands_over(self, request: ConnectorRequest) -> bool:
        return request.remote_decode

    def expects_remote_kv(self, request: ConnectorRequest) -> bool:
        return self.decode.expects_remote_kv(request)

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        self.decode.update_state_after_alloc(request, block_ids, num_external_tokens)
        self.peers.update_state_after_alloc(request, block_ids, num_external_tokens)

    def request_finished(
        self, request: ConnectorRequest, block_ids: list[int], finish_reason: str
    ) -> tuple[bool, dict[str, Any] | None]:
        self.decode.request_finished(request, finish_reason)
        if self.peers.request_finished(request, block_ids, finish_reason):
            return True, None
        return self.prefill.request_finished(request, block_ids, finish_reason)

    def peer_hold_dropped(self, request_id: str) -> None:
        self.peers.hold_dropped(request_id)

    def peer_source(self) -> tuple[str, list[int], float] | None:
        if not (self.peers.serves and self.advertised_ports):
            return None
        return self.host, self.advertised_ports, self.peer_hold_seconds

    def note_step(self, num_tokens: int) -> None:
        self.outbox.pending.step_tokens = num_tokens  # timed by the worker side, for the peer reads' cost

    def worker_reported(self, report: KVConnectorOutput) -> None:
        self.peers.worker_reported(report)

    def tier_stats(self) -> dict[str, TierStats]:
        return {PEER_MEDIUM: self.peers.tier_stats()}

    def hold_cancelled(self, request_id: str) -> None:
        self.prefill.hold_cancelled(request_id)

    def has_pending_work(self) -> bool:
        return bool(self.outbox.pending)

    def build_connector_meta(self) -> TransferWork | None:
        return self.outbox.take()
