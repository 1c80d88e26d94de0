"""Registry rows: ``"module:attribute"`` strings that name an implementation without importing it.

A table of implementations (transports, KV connectors, executors) maps each name to such a
row, so settings and the CLI read the names (their choices) without importing what the rows name (NIXL,
torch, model code); the one place that builds the thing resolves its row then.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any


def resolve(table: Mapping[str, str], name: str, what: str) -> Any:
    """The implementation ``table`` names ``name``; ValueError (listing the names) for an unknown one."""
    row = table.get(name)
    if row is None:
        raise ValueError(f"{what} must be one of {', '.join(table)}, got {name!r}")
    return load_row(row)


def load_row(row: str) -> Any:
    """What ``"module:attribute"`` names, imported."""
    module, _, attribute = row.partition(":")
    return getattr(importlib.import_module(module), attribute)
