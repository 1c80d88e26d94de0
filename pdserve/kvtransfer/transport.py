"""Transports: how a decode engine's blocks get filled from a prefill engine's memory.

- :class:`NixlTransport` (default): both engines register their whole KV cache (and the block
  generation array) with a NIXL agent (UCX backend; DRAM on CPU, VRAM on GPU). Decode READs the
  remote blocks straight into its own, then READs the remote generations of those blocks, then
  sends the NIXL notification that tells prefill to free. Data read before a
  generation that still matches cannot come from a freed or reused block, because a block's
  generation changes when it loses its last owner, before it can be reused.
- :class:`TcpTransport`: the bytes travel on the side channel; prefill checks the hold (and its token)
  and the generations when it copies them out, in the thread that owns the holds, and sends their BLAKE3
  digest in the sealed reply, which decode checks (with the length) before the bytes touch its cache. A
  peer reads only what a hold it names holds: this is the transport for peers that are not trusted with
  the whole process (docs/faults.md), where NIXL's transports would let them read and write anything.

Both run only in the transfer agent's thread.
"""

from __future__ import annotations

import logging
import os
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import blake3
import numpy as np
import torch
import zmq

from pdserve.kvtransfer import messages
from pdserve.kvtransfer.nixl_policy import TransportChoice
from pdserve.kvtransfer.work import LoadSpec

logger = logging.getLogger(__name__)

_RELEASE_TAG = b"release:"


@dataclass(frozen=True)
class CacheLayout:
    """Where a range of KV heads lies inside one block of a rank's cache."""

    block_bytes: int
    head_start: int  # the first KV head this rank holds
    num_heads: int
    num_layers: int  # 0: a cache of another shape (tests), read only whole
    slab_bytes: int  # one head's K (or V) of one layer in one block

    @classmethod
    def of(cls, kv_cache: torch.Tensor, heads: tuple[int, int]) -> CacheLayout:
        """The layout of a rank's cache holding KV heads ``heads`` [start, end)."""
        block_bytes = kv_cache[0].numel() * kv_cache.element_size()
        if kv_cache.dim() != 6:
            return cls(block_bytes, heads[0], heads[1] - heads[0], 0, 0)
        _, layers, _, num_heads, block_size, head_dim = kv_cache.shape
        return cls(block_bytes, heads[0], num_heads, layers, block_size * head_dim * kv_cache.element_size())

    def with_heads(self, block_bytes: int, heads: tuple[int, int]) -> CacheLayout:
        """Another rank's layout of the same model: ``heads`` [start, end) in blocks of ``block_bytes``."""
        return CacheLayout(block_bytes, heads[0], heads[1] - heads[0], self.num_layers, self.slab_bytes)

    def holds_exactly(self, heads: tuple[int, int] | None) -> bool:
        return heads is None or heads == (self.head_start, self.head_start + self.num_heads)

    def regions(self, heads: tuple[int, int] | None, whole: bool = True) -> list[tuple[int, int]]:
        """(offset, length) in a block of each region holding ``heads``, in the order of the cache's
        layout; one region when this rank holds exactly those heads, unless not ``whole``."""
        if whole and self.holds_exactly(heads):
            return [(0, self.block_bytes)]
        if heads is None:
            heads = (self.head_start, self.head_start + self.num_heads)
        first, count = heads[0] - self.head_start, heads[1] - heads[0]
        if not self.num_layers or first < 0 or count < 1 or first + count > self.num_heads:
            held = (self.head_start, self.head_start + self.num_heads)
            raise ValueError(f"this rank holds KV heads [{held[0]}, {held[1]}), not {list(heads)}")
        return [
            (((layer * 2 + kv) * self.num_heads + first) * self.slab_bytes, count * self.slab_bytes)
            for layer in range(self.num_layers)
            for kv in (0, 1)
        ]

    def slice_bytes(self, heads: tuple[int, int] | None) -> int:
        """Bytes of ``heads`` in one block."""
        return self.block_bytes if self.holds_exactly(heads) else sum(n for _, n in self.regions(heads))


@dataclass(eq=False)
class Pull:
    """The blocks one decode rank pulls for a request from one prefill rank: KV heads ``heads`` (None:
    every head, one rank each side) from rank ``source_rank``. A decode rank reading from several
    prefill ranks runs one pull per rank, joined in ``load``."""

    spec: LoadSpec
    num_bytes: int
    source_rank: int = 0
    heads: tuple[int, int] | None = None
    load: Any = None  # the agent's record of the whole load this pull is part of
    not_before: float = 0.0  # fault hook: do not start before
    deadline: float = 0.0
    started: float = field(default_factory=time.monotonic)
    released: bool = False  # prefill was told to free (or frees by itself) once this pull ends
    peer_failed: bool = False  # failed in the transport (dead or unreachable peer), not by the peer's answer
    state: Any = None  # the transport's own progress record
    connection: Any = None  # the agent's connection to the peer this pull runs on (set when it starts)


class Transport(ABC):
    name: str

    def __init__(
        self, kv_cache: torch.Tensor, rank: int = 0, ranks: int = 1, heads: tuple[int, int] | None = None
    ) -> None:
        """``rank`` of ``ranks``: this agent's place in its engine (which a release names); ``heads``:
        the KV heads [start, end) the rank's cache holds (None: every head)."""
        self.num_blocks = kv_cache.shape[0]
        whole = (0, kv_cache.shape[3]) if kv_cache.dim() == 6 else (0, 0)
        self.layout = CacheLayout.of(kv_cache, heads or whole)
        self.block_bytes = self.layout.block_bytes
        self.rank = rank
        self.ranks = ranks
        self.kv_cache = kv_cache
        self._blocks = kv_cache.view(torch.uint8).view(self.num_blocks, self.block_bytes)
        self._pulls: list[Pull] = []

    @property
    def busy(self) -> bool:
        return bool(self._pulls)

    def pulls_on(self, connection: object) -> bool:
        """Whether any pull is in flight on this connection."""
        return any(pull.connection is connection for pull in self._pulls)

    def discard(self, pull: Pull) -> bool:
        """Stop tracking a pull that is reported elsewhere (it failed to start); True if a write into
        its blocks may still land (see ``drained``)."""
        if pull in self._pulls:
            self._pulls.remove(pull)
            return self._cancel(pull)
        return False

    def local_info(self) -> dict[str, Any]:
        """What a peer needs, besides the handshake's common fields, to pull from this engine."""
        return {}

    def add_peer(self, address: tuple[str, int], reply: messages.HandshakeReply) -> None:
        return None

    def forget_peer(self, address: tuple[str, int]) -> None:
        return None

    @abstractmethod
    def start_pull(self, pull: Pull, socket: zmq.Socket[bytes], receiver: str) -> None:
        """Start the transfer (``socket`` is the peer's side channel, ``receiver`` its agent's id)."""

    @abstractmethod
    def progress(self, now: float) -> list[tuple[Pull, str | None]]:
        """Pulls that ended since the last call, with an error message for the failed ones."""

    def expire(self, now: float) -> list[tuple[Pull, bool]]:
        """Pulls past their deadline, cancelled where the transport can, each with whether a write
        into its blocks may still land (it is then reported by ``drained`` once none can)."""
        expired = [pull for pull in self._pulls if pull.deadline <= now]
        results = []
        for pull in expired:
            self._pulls.remove(pull)
            pull.peer_failed = True
            results.append((pull, self._cancel(pull)))
        return results

    def _cancel(self, pull: Pull) -> bool:
        """Stop a pull; True if a write into its blocks may still land."""
        return False

    def drained(self) -> list[Pull]:
        """Cancelled pulls that were still writing, and now no longer can."""
        return []

    def on_blocks_reply(self, reply: messages.BlocksReply, data: memoryview | None, connection: object) -> None:
        logger.warning("side channel: unexpected block data for %s", reply.request_id)

    def poll_releases(self) -> list[tuple[str, str, int, int]]:
        """(request id, hold token, decode rank, decode ranks) for each release a peer sent through the transport."""
        return []

    def _head_view(self, block_ids: list[int], heads: tuple[int, int]) -> tuple[int, int]:
        start = heads[0] - self.layout.head_start
        self.layout.regions(heads, whole=False)  # raises unless this rank holds them all
        return start, start + heads[1] - heads[0]

    def read_local(self, block_ids: list[int], heads: tuple[int, int] | None = None) -> np.ndarray:
        """A copy of these blocks' bytes (of KV heads ``heads`` only, if given), block after block."""
        if self.layout.holds_exactly(heads):
            return self._blocks[block_ids].cpu().numpy()
        assert heads is not None
        first, end = self._head_view(block_ids, heads)
        part = self.kv_cache[block_ids][:, :, :, first:end].contiguous()
        return part.view(torch.uint8).reshape(len(block_ids), -1).cpu().numpy()

    def write_local(self, block_ids: list[int], data: memoryview, heads: tuple[int, int] | None = None) -> None:
        """Write bytes ``read_local`` made (of the same heads) into these blocks."""
        if self.layout.holds_exactly(heads):
            source = np.frombuffer(data, dtype=np.uint8).reshape(len(block_ids), self.block_bytes)
            if self.kv_cache.is_cuda:
                self._blocks[block_ids] = torch.from_numpy(source.copy()).to(self.kv_cache.device)
            else:
                self._blocks.numpy()[block_ids] = source
            return
        assert heads is not None
        first, end = self._head_view(block_ids, heads)
        shape = (len(block_ids), *self.kv_cache.shape[1:3], end - first, *self.kv_cache.shape[4:])
        part = torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy()).view(self.kv_cache.dtype).view(shape)
        self.kv_cache[block_ids, :, :, first:end] = part.to(self.kv_cache.device)

    def close(self) -> None:
        return None


class TcpTransport(Transport):
    name = "tcp"

    def __init__(
        self, kv_cache: torch.Tensor, seal: messages.Seal, rank: int, ranks: int, heads: tuple[int, int] | None
    ) -> None:
        super().__init__(kv_cache, rank, ranks, heads)
        self.seal = seal
        self._done: list[tuple[Pull, str | None]] = []

    def start_pull(self, pull: Pull, socket: zmq.Socket[bytes], receiver: str) -> None:
        spec = pull.spec
        read = messages.ReadBlocks(
            spec.remote.request_id,
            spec.remote.hold_token,
            spec.remote_block_ids,
            spec.generations,
            release=True,
            heads=pull.heads,
            reader_rank=self.rank,
            readers=self.ranks,
        )
        socket.send(
            self.seal.seal(read, receiver), zmq.NOBLOCK
        )  # raises if the connection takes no more: the pull fails
        self._pulls.append(pull)

    def on_blocks_reply(self, reply: messages.BlocksReply, data: memoryview | None, connection: object) -> None:
        pull = next(
            (p for p in self._pulls if p.connection is connection and p.spec.remote.request_id == reply.request_id),
            None,
        )
        if pull is None:  # timed out already: its blocks may be someone else's now
            return
        self._pulls.remove(pull)
        # Prefill frees the blocks once it has sent them (the read asked it to); any other ending
        # leaves it to this side to tell it, as for every failed pull.
        pull.released = reply.error is None
        if reply.error is not None:
            self._done.append((pull, reply.error))
        elif data is None or len(data) != pull.num_bytes:
            self._done.append((pull, f"expected {pull.num_bytes} bytes, got {0 if data is None else len(data)}"))
        elif blake3.blake3(data).digest() != reply.digest:
            self._done.append((pull, "the block bytes arrived corrupted (digest mismatch)"))
        else:
            try:
                self.write_local(pull.spec.local_block_ids, data, pull.heads)
            except Exception as error:  # e.g. out of device memory for the staging copy
                logger.exception("request %s: writing pulled blocks", pull.spec.request_id)
                self._done.append((pull, f"writing the pulled blocks failed: {type(error).__name__}: {error}"))
                return
            self._done.append((pull, None))

    def progress(self, now: float) -> list[tuple[Pull, str | None]]:
        done, self._done = self._done, []
        return done


@dataclass
class _NixlPeer:
    agent_name: str
    kv_base: int
    gen_base: int
    mem_type: str
    device_id: int
    layout: CacheLayout  # of that rank's cache


class NixlTransport(Transport):
    name = "nixl"

    def __init__(
        self,
        agent_name: str,
        kv_cache: torch.Tensor,
        generations: np.ndarray,
        rank: int,
        ranks: int,
        heads: tuple[int, int] | None,
    ) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        super().__init__(kv_cache, rank, ranks, heads)
        # No progress thread: on few cores it costs 2-3x throughput and makes it erratic; the
        # agent thread polls instead, which also makes the passive side's notifications progress.
        self.agent = nixl_agent(agent_name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self.mem_type = "VRAM" if kv_cache.is_cuda else "DRAM"
        self.device_id = kv_cache.device.index or 0
        self.kv_base = kv_cache.data_ptr()
        self.generations = generations
        # Where pulled generations land: one slot per local block, so concurrent pulls never share one.
        self.pulled_generations = np.zeros(self.num_blocks, dtype=np.int64)
        self._registrations = [
            self.agent.register_memory(
                [(self.kv_base, self.num_blocks * self.block_bytes, self.device_id, "")], self.mem_type
            ),
            self.agent.register_memory([(generations.ctypes.data, generations.nbytes, 0, "")], "DRAM"),
            self.agent.register_memory(
                [(self.pulled_generations.ctypes.data, self.pulled_generations.nbytes, 0, "")], "DRAM"
            ),
        ]
        self._peers: dict[tuple[str, int], _NixlPeer] = {}
        # Timed-out reads NIXL still ran when they were given up: their handles are kept (releasing a running
        # one is not a cancel) until NIXL says they ended; only then can nothing more land in their blocks.
        self._draining: list[Pull] = []
        # Peers dropped while reads from them still drain: their agents are removed once those reads ended.
        self._retiring: list[_NixlPeer] = []

    def local_info(self) -> dict[str, Any]:
        return {
            "agent_metadata": self.agent.get_agent_metadata(),
            "kv_base": self.kv_base,
            "gen_base": self.generations.ctypes.data,
            "mem_type": self.mem_type,
            "device_id": self.device_id,
        }

    def add_peer(self, address: tuple[str, int], reply: messages.HandshakeReply) -> None:
        self.forget_peer(address)
        info = reply.transport_info
        start, end = reply.kv_head_ranges[reply.rank] if reply.kv_head_ranges else (0, self.layout.num_heads)
        layout = self.layout.with_heads(reply.block_bytes, (start, end))
        if self.layout.num_layers and layout.block_bytes != sum(n for _, n in layout.regions(None, whole=False)):
            raise ValueError(f"its blocks are {reply.block_bytes} bytes, not what KV heads [{start}, {end}) take")
        name = self.agent.add_remote_agent(info["agent_metadata"])
        self._peers[address] = _NixlPeer(
            name.decode() if isinstance(name, bytes) else name,
            int(info["kv_base"]),
            int(info["gen_base"]),
            str(info["mem_type"]),
            int(info["device_id"]),
            layout,
        )

    def forget_peer(self, address: tuple[str, int]) -> None:
        # A restarted engine comes back with new memory: keeping the old agent mapped is how vLLM
        # decode pods crashed (vllm#49238); drop it before anything else talks to that address.
        peer = self._peers.pop(address, None)
        if peer is None:
            return
        # Reads still draining from that peer keep its agent: removing it does not end them at once (UCX
        # closes the endpoint asynchronously, and a read's data can still land in a later progress call; seen
        # here, over UCX's tcp transport, as a given-up read writing into blocks already given to another
        # request). The agent goes once they ended; new transfers never use it (a restart has a new name).
        self._retiring.append(peer)
        self._retire_idle_peers()

    def _retire_idle_peers(self) -> None:
        busy = {id(pull.state[2]) for pull in self._draining}
        for peer in [peer for peer in self._retiring if id(peer) not in busy]:
            self._retiring.remove(peer)
            try:
                self.agent.remove_remote_agent(peer.agent_name)
            except Exception as error:
                logger.warning("removing NIXL agent %s: %s", peer.agent_name, error)

    def start_pull(self, pull: Pull, socket: zmq.Socket[bytes], receiver: str) -> None:
        peer = self._peers[pull.spec.remote.rank_address(pull.source_rank)]
        # One region per block when both ranks hold exactly the heads read; else one per layer and K/V.
        whole = self.layout.holds_exactly(pull.heads) and peer.layout.holds_exactly(pull.heads)
        local = _descriptors(self.kv_base, self.layout, pull.spec.local_block_ids, pull.heads, whole, self.device_id)
        remote = _descriptors(peer.kv_base, peer.layout, pull.spec.remote_block_ids, pull.heads, whole, peer.device_id)
        self._pulls.append(pull)
        self._post(pull, "data", peer, local, self.mem_type, remote, peer.mem_type)

    def _post(
        self,
        pull: Pull,
        stage: str,
        peer: _NixlPeer,
        local: list[tuple[int, int, int]],
        local_mem: str,
        remote: list[tuple[int, int, int]],
        remote_mem: str,
        notification: bytes = b"",
    ) -> None:
        """Create and post one READ; NIXL errors (a peer that died, say) mark the pull failed."""
        handle = None
        try:
            handle = self.agent.initialize_xfer(
                "READ",
                self.agent.get_xfer_descs(local, local_mem),
                self.agent.get_xfer_descs(remote, remote_mem),
                peer.agent_name,
                notification,
            )
            pull.state = (stage, handle, peer)
            if self.agent.transfer(handle) == "ERR":
                pull.state = ("failed", handle, peer, "the transfer could not be posted")
        except Exception as error:
            pull.state = ("failed", handle, peer, f"{type(error).__name__}: {error}")

    def _start_generation_read(self, pull: Pull, peer: _NixlPeer) -> None:
        spec = pull.spec
        local = [(self.pulled_generations.ctypes.data + 8 * b, 8, 0) for b in spec.local_block_ids]
        remote = [(peer.gen_base + 8 * b, 8, 0) for b in spec.remote_block_ids]
        self._post(pull, "generations", peer, local, "DRAM", remote, "DRAM")

    def progress(self, now: float) -> list[tuple[Pull, str | None]]:
        done: list[tuple[Pull, str | None]] = []
        for pull in list(self._pulls):
            result = self._advance(pull)
            if result is not None:
                self._pulls.remove(pull)
                done.append(result)
        return done

    def _advance(self, pull: Pull) -> tuple[Pull, str | None] | None:
        """Move a pull through its stages as far as it goes now; its result once it has ended."""
        while True:
            stage, handle, peer = pull.state[:3]
            reason = pull.state[3] if stage == "failed" else "the transfer failed"
            try:
                state = "ERR" if stage == "failed" else self.agent.check_xfer_state(handle)
            except Exception as error:
                state, reason = "ERR", f"{type(error).__name__}: {error}"
            if state == "PROC":
                return None
            if handle is not None:
                self._release_handle(handle)
            if state == "ERR":
                pull.peer_failed = True
                return pull, f"NIXL read failed: {reason}"
            if stage == "generations":
                self._notify_release(pull, peer)
                pulled = self.pulled_generations[pull.spec.local_block_ids].tolist()
                stale = pulled != pull.spec.generations
                return pull, "the remote blocks were freed or reused before the read ended" if stale else None
            self._start_generation_read(pull, peer)  # and check it at once: small reads often end inside post

    def _notify_release(self, pull: Pull, peer: _NixlPeer) -> None:
        """Both reads are done: tell prefill it may free, with a NIXL notification. (Sent on its
        own, not attached to the generation read: an attached one delays the read's completion
        until prefill's agent next makes progress.)"""
        try:
            remote = pull.spec.remote
            tag = _RELEASE_TAG + f"{self.rank}/{self.ranks}:{remote.hold_token}:{remote.request_id}".encode()
            self.agent.send_notif(peer.agent_name, tag)
            pull.released = True
        except Exception as error:  # the side channel's release message is sent instead
            logger.debug("NIXL release notification to %s: %s", peer.agent_name, error)

    def _release_handle(self, handle: Any) -> bool:
        try:
            self.agent.release_xfer_handle(handle)
            return True
        except Exception as error:
            logger.debug("releasing a NIXL transfer handle: %s", error)
            return False

    def _cancel(self, pull: Pull) -> bool:
        handle = pull.state[1] if pull.state is not None else None
        if handle is None:
            return False
        if self._state(handle) == "PROC":
            # Still running: UCX may write into the blocks until it ends. Kept until it does.
            self._draining.append(pull)
            return True
        self._release_handle(handle)
        return False

    def _state(self, handle: Any) -> str:
        try:
            return str(self.agent.check_xfer_state(handle))
        except Exception as error:  # a failed peer surfaces here: the read is over
            logger.debug("checking a NIXL transfer: %s", error)
            return "ERR"

    def drained(self) -> list[Pull]:
        drained = []
        for pull in list(self._draining):
            if self._state(pull.state[1]) != "PROC":
                self._draining.remove(pull)
                self._release_handle(pull.state[1])
                drained.append(pull)
        if self._retiring:
            self._retire_idle_peers()
        return drained

    def poll_releases(self) -> list[tuple[str, str, int, int]]:
        released: list[tuple[str, str, int, int]] = []
        try:
            notifications_by_agent = self.agent.get_new_notifs()
        except Exception as error:  # a peer's disconnect surfaces here too
            logger.debug("NIXL notifications: %s", error)
            return released
        for notifications in notifications_by_agent.values():
            for message in notifications:
                release = _parse_release(message)
                if release is not None:
                    released.append(release)
        return released

    def close(self) -> None:
        for registration in self._registrations:
            try:
                self.agent.deregister_memory(registration)
            except Exception as error:
                logger.debug("NIXL deregistration: %s", error)


def _descriptors(
    base: int, layout: CacheLayout, block_ids: list[int], heads: tuple[int, int] | None, whole: bool, device: int
) -> list[tuple[int, int, int]]:
    """NIXL descriptors of KV heads ``heads`` of these blocks, block after block (``whole``: one a block)."""
    regions = layout.regions(heads, whole)
    size = layout.block_bytes
    return [(base + b * size + offset, length, device) for b in block_ids for offset, length in regions]


def _parse_release(message: bytes) -> tuple[str, str, int, int] | None:
    """A release notification's (request id, hold token, decode rank, decode ranks); None for anything else."""
    if not message.startswith(_RELEASE_TAG):
        return None
    ranks, _, rest = message[len(_RELEASE_TAG) :].decode(errors="replace").partition(":")
    token, _, request_id = rest.partition(":")
    rank, _, size = ranks.partition("/")
    if not (rank.isdigit() and size.isdigit() and token and request_id):
        return None
    return request_id, token, int(rank), int(size)


def make_transport(
    choice: TransportChoice,
    kv_cache: torch.Tensor,
    generations: np.ndarray,
    seal: messages.Seal,
    rank: int = 0,
    kv_head_ranges: list[tuple[int, int]] | None = None,
) -> Transport:
    """The chosen transport (``nixl_policy.choose_transport``) over one rank's cache (``kv_head_ranges``: the
    engine's, per rank)."""
    ranks = len(kv_head_ranges) if kv_head_ranges else 1
    heads = tuple(kv_head_ranges[rank]) if kv_head_ranges else None
    if choice.name == "tcp":
        return TcpTransport(kv_cache, seal, rank, ranks, heads)  # type: ignore[arg-type]
    os.environ.update(choice.ucx_env)  # before UCX starts: its listeners stay on the engine's KV address
    return NixlTransport(seal.agent_id, kv_cache, generations, rank, ranks, heads)  # type: ignore[arg-type]
