"""The ``pdserve`` command line: one parser, assembled from the commands' modules.

Each command is a thin shell over its package, and heavy imports (torch, the model code) happen only inside
the command that runs them: building the parser imports none. Flags are declared by the settings they set
(``pdserve.api.flags``); their names are a contract (docs/contracts.md): vLLM's where vLLM has one.

- ``serve`` (``cli.serve``): router + prefill + decode on one machine, or one colocated engine;
- ``prefill``, ``decode`` (``cli.engine``): one engine, as a pod runs it;
- ``router`` (``cli.router``); ``operator`` (``cli.operator``);
- ``bench``, ``profile``, ``plan``, ``keys``, ``demo-model``, ``build-kernels`` (``cli.tools``).
"""

from __future__ import annotations

import argparse
import sys

from pdserve.api.roles import POOL_ROLES
from pdserve.cli.common import add_server_flags
from pdserve.cli.engine import add_engine_flags, run_engine
from pdserve.cli.operator import add_operator_command
from pdserve.cli.router import add_router_command
from pdserve.cli.serve import add_serve_command
from pdserve.cli.tools import add_tool_commands


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Prefill/decode-disaggregated LLM serving.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_serve_command(commands)
    for role in POOL_ROLES:
        engine = commands.add_parser(
            role.name, help=f"run one {role.name} engine (OpenAI API + KV transfer), as a pod does"
        )
        add_server_flags(engine, role.default_port)
        add_engine_flags(engine)
        engine.set_defaults(handler=run_engine)
    add_router_command(commands)
    add_tool_commands(commands)
    add_operator_command(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
