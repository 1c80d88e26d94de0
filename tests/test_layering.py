"""Imports point down only: each package of pdserve may import the layers below it, never above,
so the tree keeps the process picture of docs/architecture.md. Checked on every import statement,
including the lazy ones inside functions."""

from __future__ import annotations

import ast
from pathlib import Path

import pdserve

ROOT = Path(pdserve.__file__).parent

# Higher imports lower. The API process, the router and the operator are siblings on one floor.
RANKS = {
    "api": 0,
    "kernels": 1,
    "models": 2,
    "kvtransfer": 3,
    "worker": 4,
    "engine": 5,
    "planner": 5.5,  # runs the engine's Scheduler in simulation; the operator may use it
    "server": 6,
    "router": 6,
    "operator": 6,
    "llm": 7,
    "launcher": 7,
    "testing": 8,
    "bench": 8,
    "cli": 9,
    "__init__": 9,
}
# The router and the operator talk to engines over the network: they share only the protocol
# types (api) and, for the router, the one dependency-free block-hash module; the operator also
# sizes pools with the planner.
NETWORK_ONLY = {"router": {"api", "engine.block_hash"}, "operator": {"api", "planner"}}


def _unit(module: str) -> str:
    """The layer a module belongs to: pdserve.<package>, or the top-level module's name."""
    return module.split(".")[1] if module.count(".") >= 1 else "__init__"


def _imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name.startswith("pdserve.")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pdserve."):
            found.append(node.module)
    return found


def test_every_pdserve_import_points_down():
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        module = "pdserve." + ".".join(path.relative_to(ROOT).with_suffix("").parts)
        unit = _unit(module)
        assert unit in RANKS, f"{module}: a new package needs a floor in RANKS (and in docs/architecture.md)"
        for imported in _imports(path):
            target = _unit(imported)
            if target == unit:
                continue
            allowed = NETWORK_ONLY.get(unit)
            if allowed is not None:
                relative = imported.removeprefix("pdserve.")
                if not any(relative == a or relative.startswith(a + ".") for a in allowed):
                    wrong.append(f"{module} imports {imported} (only {sorted(allowed)} allowed)")
            elif RANKS[target] >= RANKS[unit]:
                wrong.append(f"{module} imports {imported} (a floor at or above its own)")
    assert not wrong, "\n".join(wrong)
