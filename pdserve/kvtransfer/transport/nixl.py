"""NixlTransport: both engines register their whole KV cache (and the block generation array) with a NIXL
agent (UCX backend; DRAM on CPU, VRAM on GPU). Decode READs the remote blocks straight into its own, then
READs the remote generations of those blocks, then sends the NIXL notification that tells prefill to free.
Data read before a generation that still matches cannot come from a freed or reused block, because a
block's generation changes when it loses its last owner, before it can be reused.

A read given up at its deadline while NIXL still runs it is not over: its handle is kept (releasing a
running one is not a cancel) and its pull reported by ``drained`` only once NIXL says it ended; a peer
dropped meanwhile keeps its NIXL agent until then. Where NIXL may serve at all is ``nixl_policy``'s call.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import zmq

from pdserve.kvtransfer import messages
from pdserve.kvtransfer.transport.base import Transport
from pdserve.kvtransfer.transport.cache_layout import CacheLayout

if TYPE_CHECKING:
    from pdserve.kvtransfer.pulls import Pull

logger = logging.getLogger(__name__)

_RELEASE_TAG = b"release:"


@dataclass
class _NixlPeer:
    agent_name: str
    kv_base: int
    gen_base: int
    mem_type: str
    device_id: int
    layout: CacheLayout  # of that rank's cache


@dataclass(eq=False)
class _Read:
    """A pull's NIXL reads: of its blocks, then of their generations; one posted at a time."""

    peer: _NixlPeer
    generations: bool = False  # the read of the generations (the blocks' read is done)
    handle: Any = None  # NIXL's handle of the read posted (None: none could be made)
    error: str | None = None  # why the read could not be posted


class NixlTransport(Transport):
    name = "nixl"

    def __init__(
        self,
        kv_cache: torch.Tensor,
        generations: np.ndarray,
        seal: messages.Seal,
        rank: int = 0,
        ranks: int = 1,
        heads: tuple[int, int] | None = None,
    ) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        super().__init__(kv_cache, generations, seal, rank, ranks, heads)
        # No progress thread: on few cores it costs 2-3x throughput and makes it erratic; the
        # agent thread polls instead, which also makes the passive side's notifications progress.
        self.agent = nixl_agent(seal.agent_id, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self.mem_type = "VRAM" if kv_cache.is_cuda else "DRAM"
        self.device_id = kv_cache.device.index or 0
        self.kv_base = kv_cache.data_ptr()
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
        self._reads: dict[Pull, _Read] = {}  # of the pulls in flight
        # Timed-out reads NIXL still ran when they were given up: their handles are kept (releasing a running
        # one is not a cancel) until NIXL says they ended; only then can nothing more land in their blocks.
        self._draining: dict[Pull, _Read] = {}
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
        busy = {id(read.peer) for read in self._draining.values()}
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
        read = self._reads[pull] = _Read(peer)
        self._post(read, local, self.mem_type, remote, peer.mem_type)

    def _post(
        self,
        read: _Read,
        local: list[tuple[int, int, int]],
        local_mem: str,
        remote: list[tuple[int, int, int]],
        remote_mem: str,
    ) -> None:
        """Create and post one READ; NIXL errors (a peer that died, say) mark the read failed."""
        read.handle = None
        try:
            read.handle = self.agent.initialize_xfer(
                "READ",
                self.agent.get_xfer_descs(local, local_mem),
                self.agent.get_xfer_descs(remote, remote_mem),
                read.peer.agent_name,
                b"",
            )
            if self.agent.transfer(read.handle) == "ERR":
                read.error = "the transfer could not be posted"
        except Exception as error:
            read.error = f"{type(error).__name__}: {error}"

    def _start_generation_read(self, pull: Pull, read: _Read) -> None:
        spec = pull.spec
        local = [(self.pulled_generations.ctypes.data + 8 * b, 8, 0) for b in spec.local_block_ids]
        remote = [(read.peer.gen_base + 8 * b, 8, 0) for b in spec.remote_block_ids]
        read.generations = True
        self._post(read, local, "DRAM", remote, "DRAM")

    def progress(self, now: float) -> list[tuple[Pull, str | None]]:
        done: list[tuple[Pull, str | None]] = []
        for pull in list(self._pulls):
            result = self._advance(pull, self._reads[pull])
            if result is not None:
                self._pulls.remove(pull)
                del self._reads[pull]
                done.append(result)
        return done

    def _advance(self, pull: Pull, read: _Read) -> tuple[Pull, str | None] | None:
        """Move a pull through its two reads as far as it goes now; its result once it has ended."""
        while True:
            reason = read.error or "the transfer failed"
            try:
                state = "ERR" if read.error is not None else self.agent.check_xfer_state(read.handle)
            except Exception as error:
                state, reason = "ERR", f"{type(error).__name__}: {error}"
            if state == "PROC":
                return None
            if read.handle is not None:
                self._release_handle(read.handle)
                read.handle = None
            if state == "ERR":
                pull.peer_failed = True
                return pull, f"NIXL read failed: {reason}"
            if read.generations:
                self._notify_release(pull, read.peer)
                pulled = self.pulled_generations[pull.spec.local_block_ids].tolist()
                stale = pulled != pull.spec.generations
                return pull, "the remote blocks were freed or reused before the read ended" if stale else None
            self._start_generation_read(pull, read)  # and check it at once: small reads often end inside post

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

    def _release_handle(self, handle: Any) -> None:
        try:
            self.agent.release_xfer_handle(handle)
        except Exception as error:
            logger.debug("releasing a NIXL transfer handle: %s", error)

    def _cancel(self, pull: Pull) -> bool:
        read = self._reads.pop(pull, None)
        if read is None or read.handle is None:
            return False
        if self._state(read.handle) == "PROC":
            # Still running: UCX may write into the blocks until it ends. Kept until it does.
            self._draining[pull] = read
            return True
        self._release_handle(read.handle)
        return False

    def _state(self, handle: Any) -> str:
        try:
            return str(self.agent.check_xfer_state(handle))
        except Exception as error:  # a failed peer surfaces here: the read is over
            logger.debug("checking a NIXL transfer: %s", error)
            return "ERR"

    def drained(self) -> list[Pull]:
        drained = []
        for pull, read in list(self._draining.items()):
            if self._state(read.handle) != "PROC":
                del self._draining[pull]
                self._release_handle(read.handle)
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
