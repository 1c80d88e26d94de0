"""``pdserve router``: the OpenAI front that sends each request to a prefill pod, then a decode pod. Its
flags are ``RouterConfig``'s, plus the pod lists and the process's address and keys."""

from __future__ import annotations

import argparse
import asyncio

from pdserve.api.keys import ROUTER_FILES
from pdserve.api.roles import ROUTER, ROUTER_PORT
from pdserve.cli.common import add_key_flags, add_server_flags, deployment_keys, set_log_level, wait_for_signal
from pdserve.router.config import RouterConfig

EPP_GRPC_PORT = 9002  # the Inference Extension's conventional ext_proc port
EPP_HTTP_PORT = 9003


def add_router_command(commands: argparse._SubParsersAction) -> None:
    router = commands.add_parser(ROUTER, help="run the router: prefill leg, then decode leg streamed back")
    add_server_flags(router, ROUTER_PORT)
    add_key_flags(router)
    router.add_argument("--prefill", nargs="*", default=[], metavar="URL", help="prefill engine URLs (without /v1)")
    router.add_argument("--decode", nargs="*", default=[], metavar="URL", help="decode engine URLs (without /v1)")
    RouterConfig.add_cli_args(router)
    router.set_defaults(handler=_router)

    epp = commands.add_parser(
        "epp",
        help="run the endpoint picker a gateway consults (Envoy ext_proc, the Gateway API Inference Extension's "
        "protocol), with the router's pod choice and flow control; its HTTP port serves /health and /metrics",
    )
    add_server_flags(epp, EPP_HTTP_PORT)
    add_key_flags(epp)
    epp.add_argument("--grpc-port", type=int, default=EPP_GRPC_PORT, help="where the gateway reaches the picker")
    epp.add_argument("--prefill", nargs="*", default=[], metavar="URL", help="prefill engine URLs (without /v1)")
    epp.add_argument("--decode", nargs="*", default=[], metavar="URL", help="decode engine URLs (without /v1)")
    RouterConfig.add_cli_args(epp)
    epp.set_defaults(handler=_epp)


def _check_discovery(args: argparse.Namespace, command: str) -> None:
    if args.discovery == "static" and not args.decode:
        raise SystemExit(f"pdserve {command}: --decode URL ... is required with --discovery static")
    if args.discovery == "static" and args.inference_pool:
        raise SystemExit(f"pdserve {command}: --inference-pool is read with --discovery kubernetes only")


async def _run_router(args: argparse.Namespace) -> None:
    from pdserve.router import start_router

    _check_discovery(args, "router")
    keys_dir = deployment_keys(args, ROUTER, [args.host], ROUTER_FILES)
    running = await start_router(RouterConfig.from_cli_args(args, args.api_key, keys_dir), args.host, args.port)
    pods = (
        f"prefill: {', '.join(args.prefill) or 'none'}; decode: {', '.join(args.decode)}"
        if args.discovery == "static"
        else f"pods found by Kubernetes discovery ({args.selector or 'all'})"
    )
    print(f"pdserve router serving at {running.url}/v1 ({pods})", flush=True)
    await wait_for_signal()
    await running.close()


async def _run_epp(args: argparse.Namespace) -> None:
    from pdserve.router import start_router
    from pdserve.router.epp import start_picker

    _check_discovery(args, "epp")
    keys_dir = deployment_keys(args, ROUTER, [args.host], ROUTER_FILES)
    running = await start_router(RouterConfig.from_cli_args(args, args.api_key, keys_dir), args.host, args.port)
    picker, port = await start_picker(running.router, args.host, args.grpc_port)
    print(f"pdserve epp picking at {args.host}:{port} (ext_proc); health and metrics at {running.url}", flush=True)
    await wait_for_signal()
    await picker.stop(5)
    await running.close()


def _epp(args: argparse.Namespace) -> int:
    set_log_level(args)
    asyncio.run(_run_epp(args))
    return 0


def _router(args: argparse.Namespace) -> int:
    from pdserve.router import event_loop

    set_log_level(args)
    event_loop.run(_run_router(args))
    return 0
