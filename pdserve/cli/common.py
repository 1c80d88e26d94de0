"""What every ``pdserve`` process command shares: the HTTP server's flags, the deployment key flags and
their check, and waiting for a stop signal."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal

from pdserve.api.auth import API_KEY_ENV
from pdserve.api.keys import ENGINE_FILES, KEYS_ENV, ROUTER_FILES

LOG_LEVELS = ("debug", "info", "warning", "error")


def add_server_flags(parser: argparse.ArgumentParser, port: int) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=port)
    parser.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help="require 'Authorization: Bearer KEY' on /v1 and /debug (default: env PDSERVE_API_KEY)",
    )
    add_log_level(parser)


def add_log_level(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", default="info", choices=LOG_LEVELS)


def set_log_level(args: argparse.Namespace) -> None:
    logging.getLogger("pdserve").setLevel(args.log_level.upper())


def add_key_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kv-keys",
        default=os.environ.get(KEYS_ENV) or None,
        metavar="DIR",
        help=f"the deployment's key folder (`pdserve keys DIR` makes one): it authenticates the KV side channel, "
        f"the router's P/D legs and KV events; a router reads {' and '.join(ROUTER_FILES)}, an engine "
        f"{', '.join(ENGINE_FILES)} (default: env {KEYS_ENV})",
    )
    parser.add_argument(
        "--kv-insecure",
        action="store_true",
        help="run without keys on a non-loopback address: an engine without keys takes P/D params from any client "
        "(vLLM's proxy) and its side channel from any peer; only where the network itself keeps strangers out. "
        "An engine with keys checks them whatever this says",
    )


def deployment_keys(args: argparse.Namespace, component: str, hosts: list[str], files: tuple[str, ...]) -> str | None:
    """The key folder (checked to hold ``files``), or None; exits when there is none but there must be."""
    from pdserve.api.auth import exposure_problem
    from pdserve.api.keys import KeyFileError, check_folder

    if args.kv_keys:
        try:
            check_folder(args.kv_keys, files, f"pdserve {component}")
        except KeyFileError as error:
            raise SystemExit(str(error)) from None
    problem = exposure_problem(f"pdserve {component}", hosts, args.kv_keys is not None, args.kv_insecure)
    if problem is not None:
        raise SystemExit(problem)
    if args.kv_keys is None:
        logging.getLogger("pdserve").warning(
            "pdserve %s: no keys: the KV side channel, P/D params and KV events are not authenticated (%s)",
            component,
            "--kv-insecure" if args.kv_insecure else "loopback addresses only",
        )
    return str(args.kv_keys) if args.kv_keys else None


async def wait_for_signal(*others: asyncio.Event) -> None:
    """Until SIGTERM or SIGINT, or until one of ``others`` is set."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    waits = [asyncio.create_task(event.wait()) for event in (stop, *others)]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
