"""KVCacheManager: which blocks each request owns, prefix-cache lookups, and prefix-cache stats;
for hybrid models also which state slot (``StateSlotManager``).

Owned by the Scheduler (memory state is an input to every scheduling decision); it is the only
caller of the BlockPool. A request's block table always covers the tokens it has computed plus
those scheduled (or being loaded) this step. A hybrid model's request also holds one state slot for
its linear-attention layers from its first allocation to its release: ``allocate_slots`` gives both
or neither, ``free`` and ``quarantine`` take both. Prefix caching is off for hybrid models (a
cached block's KV says nothing of the linear layers' state at that point).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pdserve.engine.block_hash import BlockHash, extend_block_hashes
from pdserve.engine.block_pool import BlockPool, KVCacheBlock
from pdserve.engine.request import Request
from pdserve.engine.state_slots import StateSlotManager


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        block_generations: np.ndarray | None = None,
        num_state_slots: int = 0,
        rows_per_state_slot: int = 0,
    ) -> None:
        """``num_state_slots`` of ``rows_per_state_slot`` rows each (hybrid models) follow the pool's
        blocks in the cache; ``block_generations``, when given, covers those rows too."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.state_slots = (
            StateSlotManager(num_state_slots, num_blocks, rows_per_state_slot, block_generations)
            if num_state_slots
            else None
        )
        self.enable_caching = enable_caching and self.state_slots is None
        self.block_pool = BlockPool(
            num_blocks, self.enable_caching, None if block_generations is None else block_generations[:num_blocks]
        )
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # The same tables as block ids, kept in step with req_to_blocks for the model runner.
        self.req_to_block_ids: dict[str, list[int]] = {}
        # How many leading blocks of each request are registered in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        # Blocks taken from requests whose remote load was abandoned while a write into them might
        # still land: owned by nobody, reused by nobody, until released (request id -> blocks).
        self.quarantined: dict[str, list[KVCacheBlock]] = {}
        # Cumulative prefix-cache statistics, in tokens.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def block_generations(self) -> np.ndarray:
        """Each block's generation (bumped when it loses its last owner): what remote readers check."""
        return self.block_pool.generations

    def cached_block_hashes(self) -> list[BlockHash]:
        """Every hash in the prefix cache now."""
        return list(self.block_pool.cached_blocks)

    def record_cache_events(self) -> None:
        """Start recording the hashes that enter and leave the prefix cache (for KV events)."""
        self.block_pool.record_events()

    def take_cache_events(self) -> tuple[list[BlockHash], list[BlockHash]]:
        """(stored, removed) hashes since the last call."""
        return self.block_pool.take_events()

    def owns_blocks(self, request_id: str) -> bool:
        return request_id in self.req_to_blocks

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of the request's leading full blocks already in the cache, and its tokens.

        At least the last token is always left to compute: its logits give the next token.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        block_size = self.block_size
        hashes = extend_block_hashes(request.block_hashes, request.all_token_ids, block_size, request.cache_salt)
        max_hit_blocks = (request.num_tokens - 1) // block_size
        cached = self.block_pool.cached_blocks
        hit_blocks = []
        for index in range(max_hit_blocks):
            block = cached.get(hashes[index])
            if block is None:
                break
            hit_blocks.append(block)
        return hit_blocks, len(hit_blocks) * block_size

    def can_start(self, request: Request, max_new_tokens: int | None) -> bool:
        """Whether a request that owns no blocks could take, now, blocks for its prefix hits and up to
        ``max_new_tokens`` more tokens (None: all of them), and a state slot when the model has them."""
        slots = self.state_slots
        if slots is not None and not slots.num_free_slots:
            return False
        hit_blocks, num_hit_tokens = self.get_computed_blocks(request)
        num_new = request.num_tokens - num_hit_tokens
        if max_new_tokens is not None:
            num_new = min(num_new, max_new_tokens)
        num_new_blocks = -(-(num_hit_tokens + num_new) // self.block_size) - len(hit_blocks)
        num_evictable_hits = sum(1 for block in hit_blocks if block.ref_cnt == 0)
        return num_new_blocks <= self.block_pool.num_free_blocks - num_evictable_hits

    def count_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """A request admitted after a prefix-cache lookup: counted once, however often it was looked up while
        it waited for room."""
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_new_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> list[KVCacheBlock] | None:
        """Give the request blocks for ``num_new_tokens`` more tokens (after adopting prefix-hit blocks).

        Returns the newly allocated blocks (often none), or None when the pool has no room; then
        nothing changed. ``delay_cache_blocks``: the blocks' contents are still being loaded, so
        they must not be offered to other requests yet (see ``cache_blocks``).
        """
        request_id = request.request_id
        blocks = self.req_to_blocks.get(request_id)
        num_total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_required = -(-num_total // self.block_size)
        num_owned = 0 if blocks is None else len(blocks)
        num_new_blocks = num_required - num_owned - len(new_computed_blocks)
        slots = self.state_slots
        if slots is not None and not slots.has_slot(request_id):
            if not slots.num_free_slots:
                return None
            if blocks is not None or new_computed_blocks:  # (caching is off: no hit blocks either)
                raise ValueError(f"request {request_id!r} owns blocks but no state slot")

        # Fast path, most decode steps: the last block still has room.
        if num_new_blocks <= 0 and blocks is not None and not new_computed_blocks:
            if self.enable_caching and not delay_cache_blocks:
                self._cache_full_blocks(request, min(num_total, request.num_tokens))
            return []

        pool = self.block_pool
        if new_computed_blocks:
            if blocks:
                raise ValueError(f"request {request_id!r} adopts prefix-hit blocks after owning blocks")
            # Hit blocks that sit in the free queue stop being free once adopted.
            num_evictable_hits = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
            if max(num_new_blocks, 0) > pool.num_free_blocks - num_evictable_hits:
                return None
        elif num_new_blocks > pool.num_free_blocks:
            return None

        if blocks is None:
            blocks = self.req_to_blocks[request_id] = []
            self.req_to_block_ids[request_id] = []
            self.num_cached_blocks[request_id] = 0
            if slots is not None:
                slots.allocate(request_id)
        block_ids = self.req_to_block_ids[request_id]
        if new_computed_blocks:
            pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
            block_ids.extend(block.block_id for block in new_computed_blocks)
            # Hit blocks are cached already.
            self.num_cached_blocks[request_id] = len(new_computed_blocks)
        new_blocks = pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0 else []
        blocks.extend(new_blocks)
        block_ids.extend(block.block_id for block in new_blocks)
        if self.enable_caching and not delay_cache_blocks:
            # Tokens scheduled this step are cached now: they are known, and within one forward
            # pass every layer writes its KV before attention reads it, so a request that hits
            # these blocks in the same step still reads correct values.
            self._cache_full_blocks(request, min(num_total, request.num_tokens))
        return new_blocks

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Offer the request's full blocks up to ``num_computed_tokens`` to the prefix cache."""
        if self.enable_caching and request.request_id in self.req_to_blocks:
            self._cache_full_blocks(request, num_computed_tokens)

    def _cache_full_blocks(self, request: Request, num_known_tokens: int) -> None:
        request_id = request.request_id
        num_full_blocks = num_known_tokens // self.block_size
        num_cached = self.num_cached_blocks[request_id]
        if num_full_blocks <= num_cached:
            return
        hashes = extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, request.cache_salt)
        blocks = self.req_to_blocks[request_id]
        cache_block = self.block_pool.cache_block
        for index in range(num_cached, num_full_blocks):
            cache_block(blocks[index], hashes[index])
        self.num_cached_blocks[request_id] = num_full_blocks

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first (its least shared blocks are evicted first)."""
        request_id = request.request_id
        blocks = self.req_to_blocks.pop(request_id, None)
        if blocks is None:
            return
        del self.req_to_block_ids[request_id]
        del self.num_cached_blocks[request_id]
        self.block_pool.free_blocks(reversed(blocks))
        if self.state_slots is not None:
            self.state_slots.free(request_id)

    def quarantine(self, request: Request) -> int:
        """Take the request's blocks away from it without freeing them (a load into them may still
        be writing); returns how many. The request can then be given fresh blocks."""
        request_id = request.request_id
        blocks = self.req_to_blocks.pop(request_id, None)
        if blocks is None:
            return 0
        del self.req_to_block_ids[request_id]
        del self.num_cached_blocks[request_id]
        self.quarantined.setdefault(request_id, []).extend(blocks)
        if self.state_slots is not None:
            self.state_slots.quarantine(request_id)
        return len(blocks)

    def release_quarantine(self, request_id: str) -> None:
        """Nothing can write into these blocks any more: back to the pool (never cached: a load
        caches its blocks only once it has landed)."""
        blocks = self.quarantined.pop(request_id, None)
        if blocks is not None:
            self.block_pool.free_blocks(reversed(blocks))
        if self.state_slots is not None:
            self.state_slots.release_quarantine(request_id)

    @property
    def num_quarantined_blocks(self) -> int:
        return sum(len(blocks) for blocks in self.quarantined.values())

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table (the live list: read it, never modify it); empty if it owns none."""
        return self.req_to_block_ids.get(request_id, [])

    def transfer_block_ids(self, request_id: str) -> list[int]:
        """What a KV transfer of the request moves: its block table, then (hybrid models) its state
        slot's rows."""
        block_ids = self.get_block_ids(request_id)
        if self.state_slots is None or request_id not in self.state_slots.req_to_slot:
            return block_ids
        return [*block_ids, *self.state_slots.rows_of(request_id)]

    def num_owned_blocks(self, request_id: str) -> int:
        return len(self.req_to_block_ids.get(request_id, ()))
