"""KVTransferConfig: how an engine takes part in P/D transfers, and the fault-injection hook.

One config serves both P/D roles, set by the flags it declares (``pdserve.api.flags``); the role
(``pdserve.api.roles``) adds one thing, ``serves_blocks``: a prefill engine hands out its blocks when a
request asks for ``do_remote_decode``, a decode engine only pulls blocks for requests that carry
``do_remote_prefill``.

Faults (tests only): ``PDSERVE_KV_FAULTS`` holds comma-separated items, read when the engine
starts, so tests can stage races deterministically in real processes:

- ``delay_load=S``: wait S seconds before starting each pull (requests sit in WAITING_FOR_REMOTE_KVS);
- ``stall_after_read=S``: the agent thread sleeps S seconds right after it posts its first pull's read (an agent
  kept from running: a NIXL read's bytes then land when it next makes progress, long after the pull's timeout);
- ``fail_load``: every pull fails after its transfer (as a broken connection would);
- ``fail_handshake``: this engine refuses handshakes (answers with an error);
- ``no_renew``: never renew remote leases; ``no_release``: never tell the prefill side to free;
- ``corrupt_blocks`` / ``truncate_blocks``: (TCP) serve block bytes with one byte flipped / cut short.
"""

from __future__ import annotations

import argparse
import os
import uuid
from dataclasses import dataclass, field

from pdserve.api.flags import add_flags, flag, flag_values
from pdserve.kvtransfer.transport import registry

FAULTS_ENV = "PDSERVE_KV_FAULTS"
TRANSPORTS = tuple(registry.TRANSPORTS)
LOAD_FAILURE_POLICIES = ("recompute", "fail")


@dataclass(frozen=True)
class KVFaults:
    delay_load: float = 0.0
    stall_after_read: float = 0.0
    fail_load: bool = False
    fail_handshake: bool = False
    no_renew: bool = False
    no_release: bool = False
    corrupt_blocks: bool = False
    truncate_blocks: bool = False

    @classmethod
    def from_env(cls) -> KVFaults:
        text = os.environ.get(FAULTS_ENV, "").strip()
        if not text:
            return cls()
        values: dict[str, float | bool] = {}
        for item in text.split(","):
            name, _, value = item.strip().partition("=")
            if name in ("delay_load", "stall_after_read"):
                values[name] = float(value)
            elif name in ("fail_load", "fail_handshake", "no_renew", "no_release", "corrupt_blocks", "truncate_blocks"):
                values[name] = True
            else:
                raise ValueError(f"{FAULTS_ENV}: unknown fault {name!r}")
        return cls(**values)  # type: ignore[arg-type]


@dataclass
class KVTransferConfig:
    transport: str = field(
        default="nixl",
        metadata=flag(
            "how KV blocks move between engines: nixl where it exposes nothing beyond the KV cache (peers on "
            "this host, or UCX limited to RDMA), else the checked TCP transport; tcp: always the TCP transport",
            name="kv-transfer",
            choices=TRANSPORTS,
        ),
    )
    host: str = "127.0.0.1"  # the address decode engines reach this engine's side channel on
    side_channel_port: int = field(
        default=0,
        metadata=flag(
            "rank 0's side channel; rank r of a tensor-parallel engine listens on it + r (0: free ports, advertised)",
            name="kv-side-channel-port",
        ),
    )
    lease_seconds: float = field(
        default=30.0,
        metadata=flag(
            "held blocks are freed if no decode engine takes or renews them within this time", name="kv-lease-seconds"
        ),
    )
    transfer_timeout: float = field(
        default=10.0, metadata=flag("seconds a handshake or one transfer may take", name="kv-transfer-timeout")
    )
    load_failure: str = field(
        default="recompute",
        metadata=flag(
            "what a failed or expired pull does: recompute the prompt locally, or fail the request",
            name="kv-load-failure",
            choices=LOAD_FAILURE_POLICIES,
        ),
    )
    # Of the KV cache, held for remote readers at once (beyond: no hold).
    max_held_fraction: float = field(
        default=0.5,
        metadata=flag(
            "share of the KV cache a prefill engine holds for decode engines at once; beyond it a prefill leg "
            "answers without params and its decode computes the prompt",
            name="kv-max-held-fraction",
        ),
    )
    # Peer reads (docs/kv-cache.md, "Peers"): a finished decode leg's blocks stay held for other engines to read.
    peer_hold_seconds: float = field(
        default=300.0,
        metadata=flag(
            "seconds a finished turn's KV blocks stay held for other engines to read (the next turn's prefill), "
            "renewed by each read; 0: serve no peer reads",
            name="kv-peer-hold-seconds",
        ),
    )
    peer_hold_fraction: float = field(
        default=0.25,
        metadata=flag(
            "share of the KV cache held for peer reads at most; running requests that need room drop the oldest "
            "holds first",
            name="kv-peer-hold-fraction",
        ),
    )
    peer_always_read: bool = field(
        default=False,
        metadata=flag(
            "read a prompt's blocks from a peer whenever one holds them, even when recomputing them is measured faster",
            name="kv-peer-always-read",
        ),
    )
    # This engine's identity for one run: new at every start, so a restarted engine is another engine to its
    # peers (a message sealed for the old one is refused by the new).
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    # The deployment's key folder (pdserve/api/keys.py): with one, the side channel accepts only messages
    # sealed with its engine.key, and hands its memory's whereabouts only to peers that prove they have it.
    # Each process that needs a key reads it from there (and again when the file changes: a rollover).
    keys_dir: str | None = None
    # Use NIXL even over UCX transports that do not bound a peer's access to the registration
    # (pdserve/kvtransfer/nixl_policy.py): every peer may then read and write this process.
    nixl_unbounded: bool = field(
        default=False,
        metadata=flag(
            "use NIXL even over UCX transports that do not bound a peer's access (tcp, shared memory): EVERY "
            "PEER THAT HAND-SHAKES CAN THEN READ AND WRITE THIS PROCESS'S MEMORY (docs/faults.md)",
            name="kv-nixl-unbounded",
        ),
    )
    # Hands this engine's blocks (and, with NIXL, its agent metadata and addresses) to peers that
    # ask: the prefill role. A decode-role engine only pulls, so it tells no peer where its memory is.
    serves_blocks: bool = True
    faults: KVFaults = field(default_factory=KVFaults.from_env)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """The flags of the KV transfer (the side channel's address and the key folder are the process's:
        the CLI's)."""
        add_flags(parser, KVTransferConfig)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, host: str, keys_dir: str | None) -> KVTransferConfig:
        return cls(host=host, keys_dir=keys_dir, **flag_values(args, cls))

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"kv transport must be one of {', '.join(TRANSPORTS)}, got {self.transport!r}")
        if self.load_failure not in LOAD_FAILURE_POLICIES:
            raise ValueError(
                f"kv load failure policy must be one of {', '.join(LOAD_FAILURE_POLICIES)}, got {self.load_failure!r}"
            )
        if self.lease_seconds <= 0 or self.transfer_timeout <= 0:
            raise ValueError("kv lease and transfer timeout must be positive")
        if not 0 < self.max_held_fraction <= 1:
            raise ValueError(f"the held KV fraction must be in (0, 1], got {self.max_held_fraction}")
        if self.peer_hold_seconds < 0 or not 0 <= self.peer_hold_fraction <= 1:
            raise ValueError(
                f"--kv-peer-hold-seconds must be >= 0 and --kv-peer-hold-fraction in [0, 1], got "
                f"{self.peer_hold_seconds} and {self.peer_hold_fraction}"
            )
