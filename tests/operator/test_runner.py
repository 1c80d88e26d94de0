"""The package as others see it: `run` (the entry point of `pdserve operator`) and its imports."""

import ast
import pathlib

import kopf

from pdserve.operator import run


def test_run_is_kopf_standalone_with_liveness(monkeypatch):
    calls = []
    monkeypatch.setattr(kopf, "configure", lambda **_: None)
    monkeypatch.setattr(kopf, "run", lambda **kwargs: calls.append(kwargs))
    run("ml", liveness_port=9090)
    run()
    assert calls == [
        {
            "standalone": True,
            "clusterwide": False,
            "namespaces": ["ml"],
            "liveness_endpoint": "http://0.0.0.0:9090/healthz",
        },
        {"standalone": True, "clusterwide": True, "namespaces": [], "liveness_endpoint": "http://0.0.0.0:8080/healthz"},
    ]


def test_operator_imports_nothing_else_of_pdserve():
    # Layering (docs/architecture.md): the operator shares nothing with the engine but the CLI names it
    # writes, and the planner its autoscaler runs.
    package = pathlib.Path(__file__).resolve().parents[2] / "pdserve/operator"
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            for name in names:
                if name.startswith("pdserve"):
                    allowed = ("pdserve.operator", "pdserve.api", "pdserve.planner")
                    assert name.startswith(allowed), f"{path.name} imports {name}"
