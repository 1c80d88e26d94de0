"""The ``pdserve`` command line: the one place that wires components together (DESIGN §9).

Subcommands are added as their components land; each is a thin shell over its package.
"""

from __future__ import annotations

import argparse
import sys

_SERVE_NOT_READY = """\
pdserve serve: the serving stack is not built yet.

What exists today is the shared engine core (scheduler, KV-cache manager, block pool,
prefix cache) driven by a deterministic fake model:
  make test                     # unit and property tests of the core
  .venv/bin/python bench/scheduler.py   # scheduler step cost at 64/256/1024 running requests

Still to come: the model runner (issue #3), the OpenAI server and colocated mode (#4), and
prefill/decode disaggregation with the router (#5), which `pdserve serve` will start.
"""


def _serve(args: argparse.Namespace) -> int:
    sys.stderr.write(_SERVE_NOT_READY)
    return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Prefill/decode-disaggregated LLM serving.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser("serve", help="run router + prefill + decode locally")
    serve.set_defaults(handler=_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
