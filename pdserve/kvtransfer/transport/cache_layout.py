"""CacheLayout: where each KV head's bytes lie inside one block of a rank's KV cache, so a transport can
read or write only the heads one decode rank takes (tensor parallelism at different sizes each side)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
