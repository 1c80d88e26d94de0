"""``pdserve serve``: the OpenAI API on one machine, as router + prefill + decode processes (``--mode
disagg``, the default: ``pdserve.launcher`` supervises them) or one colocated engine.

Its children are the commands pods run; every engine flag ``pdserve serve`` was given reaches every engine
child, written out from the flags the settings declare (``forwarded_argv``), except the per-child ones in
``PER_CHILD`` (``tests/server/test_cli_forwarding.py`` holds both to that).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator

from pdserve.api.auth import API_KEY_ENV
from pdserve.api.flags import forwarded_argv
from pdserve.api.keys import ENGINE_FILES, ROUTER_FILES
from pdserve.api.roles import COLOCATED, DECODE, PREFILL, ROUTER_PORT
from pdserve.cli.common import add_server_flags, set_log_level
from pdserve.cli.engine import ENGINE_SETTINGS, add_engine_flags, run_engine

MODES = ("disagg", COLOCATED.name)
# Engine settings each child gets its own value of, and why (field -> reason).
PER_CHILD = {
    "tensor_parallel_size": "each role's size (--prefill-tp, --decode-tp, default -tp), given by the launcher",
    "side_channel_port": "engines on one host cannot share a port: each child takes free ones",
    "kv_events_port": "engines on one host cannot share a port: each child takes a free one (or none, with -1)",
    "disk_path": "each engine keeps its own local disk tier, as each pod has its own disk: a subfolder named after "
    "the child (prefill-0, decode-0)",
}


def add_serve_command(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser(
        "serve",
        help="serve the OpenAI API locally: router + prefill + decode processes "
        "(--mode disagg, default) or one engine (--mode colocated)",
    )
    serve.add_argument("--mode", choices=MODES, default="disagg")
    serve.add_argument("--prefill", type=int, default=1, help="number of prefill engines (disagg)")
    serve.add_argument("--decode", type=int, default=1, help="number of decode engines (disagg)")
    serve.add_argument(
        "--prefill-tp", type=int, default=None, help="tensor-parallel size of each prefill engine (default: -tp)"
    )
    serve.add_argument(
        "--decode-tp", type=int, default=None, help="tensor-parallel size of each decode engine (default: -tp)"
    )
    add_server_flags(serve, ROUTER_PORT)
    add_engine_flags(serve)
    # Behind the router, the priorities it clamps are the engines' to honour; colocated, the API's own.
    serve.set_defaults(handler=_serve, scheduling_policy="priority")


def engine_child_argv(args: argparse.Namespace) -> list[str]:
    """What every engine child is given beyond its role, address and TP size: the engine flags (priority
    scheduling unless they say otherwise: ``pdserve serve``'s default), the side channel's address if one was
    given, the log level, and --kv-insecure if given (keys come apart)."""
    argv = forwarded_argv(args, ENGINE_SETTINGS, exclude=PER_CHILD)
    argv += ["--kv-events-port", "-1" if args.kv_events_port < 0 else "0", "--log-level", args.log_level]
    if args.kv_side_channel_host:
        argv += ["--kv-side-channel-host", args.kv_side_channel_host]
    return argv + (["--kv-insecure"] if args.kv_insecure else [])


def router_child_argv(args: argparse.Namespace) -> list[str]:
    argv = ["--log-level", args.log_level, "--tokenizer", args.tokenizer or args.model]
    return argv + (["--kv-insecure"] if args.kv_insecure else [])


def _serve(args: argparse.Namespace) -> int:
    if args.mode == COLOCATED.name:
        if args.prefill_tp is not None or args.decode_tp is not None:
            sys.stderr.write("--prefill-tp and --decode-tp size P/D pools: use -tp with --mode colocated\n")
            return 2
        args.command = COLOCATED.name
        return run_engine(args)
    from pdserve.launcher import run_disaggregated

    if args.prefill < 1 or args.decode < 1:
        sys.stderr.write("--prefill and --decode must be at least 1\n")
        return 2
    sizes = {
        role: args.tensor_parallel_size if size is None else size
        for role, size in ((PREFILL.name, args.prefill_tp), (DECODE.name, args.decode_tp))
    }
    if min(sizes.values()) < 1:
        sys.stderr.write("--prefill-tp, --decode-tp and --tensor-parallel-size must be at least 1\n")
        return 2
    set_log_level(args)
    if args.model is None:
        from pdserve.models.demo import ensure_demo_model

        args.model = str(ensure_demo_model())  # built once here, not raced by every child
    if args.api_key:  # children read it from the environment: a command line is visible to every user
        os.environ[API_KEY_ENV] = args.api_key
    with _local_keys(args) as (router_keys, engine_keys):
        router_argv, engine_argv = router_child_argv(args), engine_child_argv(args)
        if router_keys is not None and engine_keys is not None:
            router_argv += ["--kv-keys", router_keys]
            engine_argv += ["--kv-keys", engine_keys]
        return run_disaggregated(
            args.host, args.port, args.prefill, args.decode, engine_argv, router_argv, sizes, args.kv_tier_disk
        )


@contextlib.contextmanager
def _local_keys(args: argparse.Namespace) -> Iterator[tuple[str | None, str | None]]:
    """The key folders of `pdserve serve`'s router and engines: the one given (each child reads its own files),
    none under --kv-insecure (its children then take P/D params from any client, as the flag says), else fresh
    keys in a private temporary folder, the router's files and the engines' apart, removed at the end."""
    if args.kv_keys:
        yield args.kv_keys, args.kv_keys
        return
    if args.kv_insecure:
        yield None, None
        return
    from pdserve.api.keys import new_bundle, write_bundle

    with tempfile.TemporaryDirectory(prefix="pdserve-keys-") as folder:
        bundle = new_bundle()
        router, engine = os.path.join(folder, "router"), os.path.join(folder, "engine")
        write_bundle(router, bundle, ROUTER_FILES)
        write_bundle(engine, bundle, ENGINE_FILES)
        yield router, engine
