"""The engine commands: ``pdserve prefill`` and ``pdserve decode`` (one engine, as a pod runs it), and the
colocated engine of ``pdserve serve --mode colocated``. Their flags are declared by the settings they set:
``EngineArgs``, ``ServerSettings``, ``KVTierConfig`` and ``KVTransferConfig``; the addresses and keys are the
process's."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

from pdserve.api.keys import ENGINE_FILES
from pdserve.api.roles import Role, engine_role
from pdserve.cli.common import add_key_flags, deployment_keys, set_log_level, wait_for_signal
from pdserve.engine.engine_args import EngineArgs
from pdserve.kvtransfer.config import KVTransferConfig
from pdserve.kvtransfer.tiers.config import KVTierConfig
from pdserve.server.settings import ServerSettings

# The settings whose declared flags every engine command takes, in the order its help lists them.
ENGINE_SETTINGS = (EngineArgs, ServerSettings, KVTierConfig, KVTransferConfig)


def add_engine_flags(parser: argparse.ArgumentParser, kv_transfer: bool = True) -> None:
    EngineArgs.add_cli_args(parser)
    ServerSettings.add_cli_args(parser)
    KVTierConfig.add_cli_args(parser)
    if kv_transfer:
        KVTransferConfig.add_cli_args(parser)
        parser.add_argument(
            "--kv-side-channel-host",
            default=os.environ.get("PDSERVE_KV_HOST"),
            help="address of the KV side channel and the KV events, advertised to peers (default: env "
            "PDSERVE_KV_HOST, else --host)",
        )
        add_key_flags(parser)


def engine_args(args: argparse.Namespace, role: Role, keys_dir: str | None) -> EngineArgs:
    """The engine's settings from the parsed flags; a role without KV transfer ignores the KV flags."""
    host = args.kv_side_channel_host or args.host
    kv_transfer = KVTransferConfig.from_cli_args(args, host, keys_dir) if role.kv_transfer else None
    return EngineArgs.from_cli_args(args, role.name, kv_transfer, host, KVTierConfig.from_cli_args(args))


async def _run_engine(args: argparse.Namespace, role: Role) -> None:
    from pdserve.server.app import start_engine_server

    settings = ServerSettings.from_cli_args(args)
    keys_dir = None
    verifier = None
    if role.kv_transfer:  # a colocated engine has no side channel and takes no P/D params
        hosts = [args.host, args.kv_side_channel_host or args.host]
        keys_dir = deployment_keys(args, role.name, hosts, ENGINE_FILES)
    settings_of_engine = engine_args(args, role, keys_dir)
    if keys_dir is not None:  # with keys, P/D params come from the router only, whatever --kv-insecure says
        from pdserve.api.auth import RouterVerifier
        from pdserve.api.keys import load_router_public

        assert settings_of_engine.kv_transfer is not None
        verifier = RouterVerifier(load_router_public(keys_dir), settings_of_engine.kv_transfer.engine_id)
    running = await start_engine_server(
        settings_of_engine,
        args.host,
        args.port,
        settings.served_model_name,
        args.api_key,
        settings.limits(),
        verifier,
        settings.tool_call_parser,
    )
    print(f"pdserve {role.name} engine serving {running.server.model_name} at {running.url}/v1", flush=True)
    client = running.server.client
    await wait_for_signal(client.died)
    log = logging.getLogger("pdserve")
    if client.died.is_set():
        # Its requests were answered 503 when it died; nothing can serve more: exit, so the pod restarts.
        log.error("the engine core died: stopping")
        await running.close()
        raise SystemExit(1)
    timeout = settings.drain_timeout if settings.drain_timeout is not None else args.kv_lease_seconds + 15
    log.info("draining: refusing new requests; waiting up to %.0f s for running ones and held KV blocks", timeout)
    if not await running.drain(timeout, settings.drain_handoff):
        log.warning("drain timed out: stopping with work still in flight")
    log.info("shutting down: closing connections, stopping the engine core")
    await running.close()


def run_engine(args: argparse.Namespace) -> int:
    set_log_level(args)
    asyncio.run(_run_engine(args, engine_role(args.command)))
    return 0
