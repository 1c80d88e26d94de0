"""KVTierConfig: which KV tiers an engine keeps below its block pool, and how large each may grow.

Every tier is off unless its flag is given. A tier stores a block once it is full and hashed (the disk and
shared tiers: written through, so a crash loses nothing stored) or when the pool evicts it (host memory:
written back, so device-to-host copies happen only for blocks that leave the pool), and loads a prompt's
blocks that the pool no longer has. What a tier may be trusted with is in docs/kv-cache.md.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from pdserve.api.flags import add_flags, flag, flag_values, parse_size

DAY_S = 86400.0


@dataclass(frozen=True)
class KVTierConfig:
    host_bytes: int = field(
        default=0,
        metadata=flag(
            "pinned host memory for KV blocks evicted from a GPU engine's pool (0: off; refused on a CPU engine, "
            "whose pool already is host memory)",
            name="kv-tier-host-bytes",
            parse=parse_size,
        ),
    )
    disk_path: str | None = field(
        default=None,
        metadata=flag(
            "a local folder for content-addressed KV block files, kept across restarts (off when not given)",
            name="kv-tier-disk",
        ),
    )
    disk_bytes: int = field(
        default=16 << 30,
        metadata=flag(
            "the local disk tier's size bound (least recently used files go first)",
            name="kv-tier-disk-bytes",
            parse=parse_size,
        ),
    )
    shared_path: str | None = field(
        default=None,
        metadata=flag(
            "a folder several engines mount (a ReadWriteMany volume): each one's stored prefixes are every one's "
            "hits. IT TRUSTS EVERY ENGINE THAT CAN WRITE IT (docs/kv-cache.md); off when not given",
            name="kv-tier-shared",
        ),
    )
    shared_bytes: int = field(
        default=64 << 30,
        metadata=flag(
            "the shared tier's size bound (least recently used files go first)",
            name="kv-tier-shared-bytes",
            parse=parse_size,
        ),
    )
    shared_read_only: bool = field(
        default=False,
        metadata=flag(
            "load from the shared tier, never write to it (a pool that mounts it read-only)",
            name="kv-tier-shared-read-only",
        ),
    )
    max_age_s: float = field(
        default=DAY_S,
        metadata=flag(
            "seconds a block file is kept after it was last used (KV at rest is user data)", name="kv-tier-max-age"
        ),
    )

    load_timeout_s: float = field(
        default=30.0,
        metadata=flag(
            "seconds a load from the tiers may take before its request computes the prompt instead (a hung read "
            "of a slow shared volume); its blocks stay out of use until the read ends",
            name="kv-tier-load-timeout",
        ),
    )
    always_load: bool = field(
        default=False,
        metadata=flag(
            "load every tier hit, even where recomputing it was measured faster (tests, and benchmarks of the "
            "load path)",
            name="kv-tier-always-load",
        ),
    )

    def __post_init__(self) -> None:
        if self.host_bytes < 0 or self.disk_bytes <= 0 or self.shared_bytes <= 0:
            raise ValueError("KV tier sizes must be positive")
        if self.load_timeout_s <= 0:
            raise ValueError(f"--kv-tier-load-timeout must be positive, got {self.load_timeout_s}")
        if self.max_age_s <= 0:
            raise ValueError(f"--kv-tier-max-age must be positive, got {self.max_age_s}")
        if self.shared_read_only and self.shared_path is None:
            raise ValueError("--kv-tier-shared-read-only needs --kv-tier-shared")

    @property
    def enabled(self) -> bool:
        return bool(self.host_bytes or self.disk_path or self.shared_path)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        add_flags(parser, KVTierConfig)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> KVTierConfig | None:
        """The tiers the flags name, or None when they name none."""
        config = cls(**flag_values(args, cls))
        return config if config.enabled else None
