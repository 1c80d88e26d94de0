"""``pdserve operator``: the Kubernetes operator (PDService and PDPool resources)."""

from __future__ import annotations

import argparse

from pdserve.cli.common import add_log_level, set_log_level


def add_operator_command(commands: argparse._SubParsersAction) -> None:
    operator = commands.add_parser("operator", help="run the Kubernetes operator (PDService and PDPool resources)")
    operator.add_argument("--namespace", default=None, help="watch one namespace (default: all namespaces)")
    operator.add_argument("--liveness-port", type=int, default=8080, help="serves /healthz for the liveness probe")
    add_log_level(operator)
    operator.set_defaults(handler=_operator)


def _operator(args: argparse.Namespace) -> int:
    from pdserve.operator import run

    set_log_level(args)
    run(namespace=args.namespace, liveness_port=args.liveness_port)
    return 0
