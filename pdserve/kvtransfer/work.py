"""The work order the KV connector's scheduler side hands the transfer agent each step.

Both sides of the connector (``prefill_side``, ``decode_side``) append to one ``WorkOrders``
outbox; the scheduler drains it once per step (``build_connector_meta``) and the engine posts
the result to the agent (``TransferAgent.submit``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.kvtransfer.params import RemotePrefill


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

    holds: list[tuple[str, list[int], str]] = field(default_factory=list)  # prefill: (request id, block ids, token)
    tracks: list[tuple[str, RemotePrefill]] = field(default_factory=list)  # decode: renew these leases
    loads: list[LoadSpec] = field(default_factory=list)
    releases: list[tuple[str, RemotePrefill]] = field(default_factory=list)  # decode: tell prefill to free
    # decode: requests that ended; a pull of theirs not started yet is dropped (and prefill told to free)
    cancels: list[str] = field(default_factory=list)
    unholds: list[str] = field(default_factory=list)  # prefill: holds dropped (the scheduler freed the blocks)

    def __bool__(self) -> bool:
        return bool(self.holds or self.tracks or self.loads or self.releases or self.cancels or self.unholds)


class WorkOrders:
    """The outbox both connector sides write to between two steps."""

    def __init__(self) -> None:
        self.pending = TransferWork()

    def take(self) -> TransferWork | None:
        """Everything queued since the last call; None when nothing was."""
        if not self.pending:
            return None
        work, self.pending = self.pending, TransferWork()
        return work
