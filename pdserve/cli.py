"""The ``pdserve`` command line: the one place that wires components together (DESIGN §9).

Subcommands are added as their components land; each is a thin shell over its package.
"""

from __future__ import annotations

import argparse
import sys

_SERVE_NOT_READY = """\
pdserve serve: the serving stack is not built yet.

What runs today, offline in one process (the engine core, our model code, the sampler):
  .venv/bin/python -c "from pdserve import LLM, SamplingParams; \\
      print(LLM().generate('Hello', SamplingParams(max_tokens=16))[0].outputs[0].text)"
  pdserve demo-model PATH       # write the built-in tiny model and tokenizer
  make test                     # the test suite
  make bench                    # scheduler and throughput benchmarks

Still to come: the OpenAI server and colocated mode (issue #4), then prefill/decode
disaggregation with the router (#5), which `pdserve serve` will start.
"""


def _serve(args: argparse.Namespace) -> int:
    sys.stderr.write(_SERVE_NOT_READY)
    return 2


def _demo_model(args: argparse.Namespace) -> int:
    from pdserve.models.demo import write_demo_model

    path = write_demo_model(args.path)
    print(f"wrote the demo model to {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Prefill/decode-disaggregated LLM serving.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser("serve", help="run router + prefill + decode locally")
    serve.set_defaults(handler=_serve)
    demo = commands.add_parser("demo-model", help="write the built-in tiny model and tokenizer to PATH")
    demo.add_argument("path", help="folder to write (created if missing)")
    demo.set_defaults(handler=_demo_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
