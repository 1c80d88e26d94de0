"""TcpTransport: the block bytes travel on the side channel. Decode asks with a ``ReadBlocks`` naming the
hold and its token; prefill checks the hold and the generations when it copies the blocks out, in the
thread that owns the holds (``holds.HeldBlocks``), and sends their BLAKE3 digest in the sealed reply,
which decode checks (with the length) before the bytes touch its cache. A peer reads only what a hold
it names holds: this is the transport for peers that are not trusted with the whole process
(docs/faults.md), where NIXL's transports would let them read and write anything.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import blake3
import numpy as np
import torch
import zmq

from pdserve.kvtransfer import messages
from pdserve.kvtransfer.transport.base import Transport

if TYPE_CHECKING:
    from pdserve.kvtransfer.pulls import Pull

logger = logging.getLogger(__name__)


class TcpTransport(Transport):
    name = "tcp"

    def __init__(
        self,
        kv_cache: torch.Tensor,
        generations: np.ndarray,
        seal: messages.Seal,
        rank: int = 0,
        ranks: int = 1,
        heads: tuple[int, int] | None = None,
    ) -> None:
        super().__init__(kv_cache, generations, seal, rank, ranks, heads)
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
