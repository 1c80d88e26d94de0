"""The work order a KV connector's scheduler side hands its worker side each step.

One order type for every connector the engine runs (so a step's order crosses to worker processes as one
typed message): the P/D fields are the transfer agent's, the ``tier_*`` fields the KV tiers' worker
(``tiers.worker``); each worker side reads its own fields, and the multi-connector merges its parts' orders
field by field (``merge``). Both sides of the P/D connector (``prefill_side``, ``decode_side``) append to one
``WorkOrders`` outbox; the scheduler drains it once per step (``build_connector_meta``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from pdserve.api.peer_kv import PrefixSource
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
class PeerHold:
    """Serve a finished request's blocks to peers under ``handle``: ``hashes`` are the blocks' chained hashes,
    ``generations`` their generations now (a block freed meanwhile is never served)."""

    request_id: str
    handle: str
    block_ids: list[int]
    hashes: list[bytes]
    generations: list[int]


@dataclass(slots=True)
class PeerLoad:
    """Read the blocks [first, first + len(local_block_ids)) of ``source``'s hold into ``local_block_ids``;
    ``last_hash``: this prompt's hash of the last of them."""

    request_id: str
    source: PrefixSource
    first: int
    local_block_ids: list[int]
    last_hash: bytes


@dataclass(slots=True)
class TierLoad:
    """Load a request's blocks from the KV tiers: ``blocks`` are (local block id, medium, block hash, host
    slot or -1), in prompt order."""

    request_id: str
    blocks: list[tuple[int, str, bytes, int]]


@dataclass(slots=True)
class TierStore:
    """Copy block ``block_id`` (hash ``block_hash``) into ``media`` (``host_slot``: its host-memory slot, or -1)."""

    block_id: int
    block_hash: bytes
    media: list[str]
    host_slot: int = -1


@dataclass(slots=True)
class TransferWork:
    """One step's work order for the KV connectors' worker sides."""

    holds: list[tuple[str, list[int], str]] = field(default_factory=list)  # prefill: (request id, block ids, token)
    tracks: list[tuple[str, RemotePrefill]] = field(default_factory=list)  # decode: renew these leases
    loads: list[LoadSpec] = field(default_factory=list)
    releases: list[tuple[str, RemotePrefill]] = field(default_factory=list)  # decode: tell prefill to free
    # decode: requests that ended; a pull of theirs not started yet is dropped (and prefill told to free)
    cancels: list[str] = field(default_factory=list)
    unholds: list[str] = field(default_factory=list)  # prefill: holds dropped (the scheduler freed the blocks)
    # Peer reads: finished requests' blocks served to peers, those dropped (freed by the scheduler), and
    # prompts' leading blocks read from a peer.
    peer_holds: list[PeerHold] = field(default_factory=list)
    peer_unholds: list[str] = field(default_factory=list)
    peer_loads: list[PeerLoad] = field(default_factory=list)
    # KV tiers. Saves run before this step's forward (which may overwrite the evicted blocks), stores after it
    # (which writes the blocks they copy); loads write into blocks no step reads until they are reported landed.
    tier_saves: list[TierStore] = field(default_factory=list)
    tier_stores: list[TierStore] = field(default_factory=list)
    tier_loads: list[TierLoad] = field(default_factory=list)
    tier_deletes: list[tuple[str, bytes]] = field(default_factory=list)  # (medium, hash): files to remove
    tier_cancels: list[str] = field(default_factory=list)  # loads given up on: dropped if not started (reported)
    # Tokens this step computes (the tiers time the forward, to weigh loading against recomputing).
    step_tokens: int = 0

    def __bool__(self) -> bool:
        return bool(
            self.holds
            or self.tracks
            or self.loads
            or self.releases
            or self.cancels
            or self.unholds
            or self.peer_holds
            or self.peer_unholds
            or self.peer_loads
            or self.tier_saves
            or self.tier_stores
            or self.tier_loads
            or self.tier_deletes
            or self.tier_cancels
        )

    def merge(self, other: TransferWork) -> None:
        """Append ``other``'s items to this order's (the multi-connector's parts each build one)."""
        for item in fields(self):
            name = item.name
            if name == "step_tokens":
                self.step_tokens = max(self.step_tokens, other.step_tokens)
            else:
                getattr(self, name).extend(getattr(other, name))


class WorkOrders:
    """The outbox both connector sides write to between two steps."""

    def __init__(self) -> None:
        self.pending = TransferWork()

    def take(self) -> TransferWork | None:
        """Everything queued since the last call (or only the step's token count); None when nothing was."""
        if not self.pending and not self.pending.step_tokens:
            return None
        work, self.pending = self.pending, TransferWork()
        return work
