"""Every table of implementations is the one source of its names: the CLI's choices, the operator's and the
CRD's enums equal the table, and each row resolves to what it promises. Settings, the CLI and the API
process's app import no torch and no model stack (the composition root and the commands that run models do)."""

from __future__ import annotations

import argparse
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pdserve.api.registry import load_row
from pdserve.cli import build_parser
from pdserve.engine.reasoning import REASONING_PARSERS
from pdserve.kvtransfer.base import KVConnectorScheduler
from pdserve.kvtransfer.config import LOAD_FAILURE_POLICIES, TRANSPORTS
from pdserve.kvtransfer.connectors import KV_CONNECTORS
from pdserve.models.families import DEMO_FAMILIES
from pdserve.operator.spec import KV_BACKENDS, LOAD_FAILURE
from pdserve.router.policies import ROUTING_POLICIES, RoutingPolicy
from pdserve.server.tool_parsers import TOOL_PARSERS
from pdserve.worker.executors import EXECUTORS

CRD = Path(__file__).parents[1] / "helm" / "pdserve" / "crds" / "pdservices.pdserve.io.yaml"


def _choices(command: str, dest: str) -> list[str]:
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    action = next(a for a in commands.choices[command]._actions if a.dest == dest)
    return list(action.choices or [])


@pytest.mark.parametrize("command", ["serve", "prefill", "decode"])
def test_engine_choices_are_the_tables(command):
    assert _choices(command, "kv_transfer") == list(TRANSPORTS)
    assert _choices(command, "kv_connector") == list(KV_CONNECTORS)
    assert _choices(command, "distributed_executor_backend") == list(EXECUTORS)
    assert _choices(command, "kv_load_failure") == list(LOAD_FAILURE_POLICIES)
    assert _choices(command, "reasoning_parser") == sorted(REASONING_PARSERS)
    assert _choices(command, "tool_call_parser") == sorted(TOOL_PARSERS)


def test_tool_and_router_choices_are_the_tables():
    assert _choices("router", "routing") == list(ROUTING_POLICIES)
    assert _choices("demo-model", "family") == list(DEMO_FAMILIES)
    assert _choices("profile", "kv_transfer") == list(TRANSPORTS)


def test_the_operator_and_its_crd_offer_the_transports_and_failure_policies():
    """The operator may not import the transfer stack (it talks to engines over the network): its copies are
    held to the tables here."""
    assert KV_BACKENDS == TRANSPORTS and LOAD_FAILURE == LOAD_FAILURE_POLICIES
    schema = yaml.safe_load(CRD.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    kv = schema["properties"]["spec"]["properties"]["kvTransfer"]["properties"]
    assert kv["backend"]["enum"] == list(TRANSPORTS)
    assert kv["loadFailure"]["enum"] == list(LOAD_FAILURE_POLICIES)


def test_each_row_resolves_to_its_kind():
    for row in EXECUTORS.values():
        starter = load_row(row)
        assert list(inspect.signature(starter).parameters)[:2] == ["spec", "runner_cls"], row
    for row in KV_CONNECTORS.values():
        assert issubclass(load_row(row), KVConnectorScheduler), row
    for name, policy in ROUTING_POLICIES.items():
        assert issubclass(policy, RoutingPolicy) and policy.name == name


def test_an_unknown_name_is_refused_with_the_table():
    from pdserve.engine.engine_args import EngineArgs

    with pytest.raises(ValueError, match="must be one of uni, mp"):
        EngineArgs(distributed_executor_backend="ray")
    with pytest.raises(ValueError, match="KV connector must be one of pd"):
        EngineArgs(role="decode", kv_connector="lmcache")


# The model stack: what the API process must not import to read its settings.
HEAVY = ("torch", "pdserve.kernels", "pdserve.worker.model_runner", "pdserve.models.transformer", "nixl")


@pytest.mark.parametrize("module", ["pdserve.engine.engine_args", "pdserve.cli", "pdserve.server.app"])
def test_settings_the_cli_and_the_api_app_import_no_model_stack(module):
    script = (
        f"import importlib, json, sys; importlib.import_module({module!r}); "
        "from pdserve.cli import build_parser; build_parser(); print(json.dumps(sorted(sys.modules)))"
    )
    loaded = json.loads(subprocess.run([sys.executable, "-c", script], check=True, capture_output=True).stdout)
    assert not [name for name in loaded if name.startswith(HEAVY)]
