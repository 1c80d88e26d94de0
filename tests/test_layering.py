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


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split(".")[1:])
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _type_checking_only(tree: ast.Module) -> set[int]:
    """Ids of the import nodes under ``if TYPE_CHECKING:`` (annotations only: never run)."""
    hidden: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            hidden |= {id(child) for statement in node.body for child in ast.walk(statement)}
    return hidden


def _imports(path: Path, runtime_only: bool = False) -> list[str]:
    tree = ast.parse(path.read_text())
    hidden = _type_checking_only(tree) if runtime_only else set()
    found = []
    for node in ast.walk(tree):
        if id(node) in hidden:
            continue
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name.startswith("pdserve.")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pdserve."):
            # ``from pdserve.x import y`` imports the module pdserve.x.y when there is one.
            submodules = [
                f"{node.module}.{alias.name}" for alias in node.names if _is_module(f"{node.module}.{alias.name}")
            ]
            found += submodules or [node.module]
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


def _modules() -> dict[str, Path]:
    return {
        "pdserve." + ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): path
        for path in sorted(ROOT.rglob("*.py"))
    }


# Inside the engine core, concrete parts (torch, models, executors, transports, agents) are the composition
# root's alone; the rest of the core sees the step contract, the connector interface, and the torch-free
# settings and registry tables that name implementations without importing them.
COMPOSITION_ROOT = "pdserve.engine.build"
CORE_MAY_IMPORT = {
    "pdserve.worker.interface",  # the step contract
    "pdserve.worker.executors",  # the executors' table
    "pdserve.kvtransfer.base",  # the connector interface
    "pdserve.kvtransfer.config",  # the KV transfer's settings
    "pdserve.kvtransfer.tiers.config",  # the KV tiers' settings
    "pdserve.kvtransfer.connectors",  # the connectors' table
    "pdserve.kvtransfer.params",  # the P/D params' wire format (RemotePrefill), plain data
    "pdserve.models.config",  # torch-free: the KV cache dtypes' names (--kv-cache-dtype)
}


def test_only_the_composition_root_imports_concrete_parts_into_the_core():
    wrong = []
    for module, path in _modules().items():
        if not module.startswith("pdserve.engine.") or module == COMPOSITION_ROOT:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")
                concrete = top[0] == "pdserve" and top[1] in ("worker", "kvtransfer", "models")
                # The structured-output manager fills a torch bitmask lazily (xgrammar's API takes one).
                lazy_bitmask = module == "pdserve.engine.structured_outputs" and name == "torch"
                if (concrete and name not in CORE_MAY_IMPORT) or (top[0] == "torch" and not lazy_bitmask):
                    wrong.append(f"{module} imports {name}")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle_inside_a_package():
    """Modules of one package import each other along one direction (imports that only annotations see
    excepted)."""
    modules = _modules()
    edges = {
        module: {
            imported
            for imported in _imports(path, runtime_only=True)
            if imported in modules and imported != module and _unit(imported) == _unit(module)
        }
        for module, path in modules.items()
    }
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[str] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for imported in sorted(edges[module]):
            if state.get(imported) == 1:
                cycles.append(" -> ".join([*path[path.index(imported) :], imported]))
            elif imported not in state:
                visit(imported, [*path, imported])
        state[module] = 2

    for module in sorted(modules):
        if module not in state:
            visit(module, [module])
    assert not cycles, "\n".join(cycles)


def test_the_floor_picture_in_the_docs_is_ranks():
    """docs/architecture.md draws the floors top to bottom: its lines name the packages in RANKS's order."""
    text = (ROOT.parent / "docs" / "architecture.md").read_text()
    picture = text.split("## Layering: imports point down", 1)[1].split("```", 2)[1]
    drawn = []
    for line in picture.strip().splitlines():
        names = [
            word.removeprefix("pdserve/").removesuffix(".py") for word in line.split() if word.startswith("pdserve/")
        ]
        drawn.append(sorted(names))
    floors = sorted({rank for unit, rank in RANKS.items() if unit != "__init__"}, reverse=True)
    expected = [
        sorted(unit for unit, rank in RANKS.items() if rank == floor and unit != "__init__") for floor in floors
    ]
    assert drawn == expected
