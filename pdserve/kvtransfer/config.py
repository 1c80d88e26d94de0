"""KVTransferConfig: how an engine takes part in P/D transfers, and the fault-injection hook.

One config serves both roles: an engine hands out its blocks when a request asks for
``do_remote_decode`` and pulls blocks when a request carries ``do_remote_prefill``. Which of the
two happens is decided by the requests the router sends, not by a role switch here.

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

import os
import uuid
from dataclasses import dataclass, field

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
    transport: str = "nixl"  # nixl | tcp
    host: str = "127.0.0.1"  # the address decode engines reach this engine's side channel on
    side_channel_port: int = 0  # 0: a free port, advertised in remote_port
    lease_seconds: float = 30.0
    transfer_timeout: float = 10.0  # bounds a handshake and each transfer
    load_failure: str = "recompute"  # recompute | fail
    max_held_fraction: float = 0.5  # of the KV cache, held for remote readers at once (beyond: no hold)
    # This engine's identity for one run: new at every start, so a restarted engine is another engine to its
    # peers (a message sealed for the old one is refused by the new).
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    # The deployment's key folder (pdserve/api/keys.py): with one, the side channel accepts only messages
    # sealed with its engine.key, and hands its memory's whereabouts only to peers that prove they have it.
    # Each process that needs a key reads it from there (and again when the file changes: a rollover).
    keys_dir: str | None = None
    # Use NIXL even over UCX transports that do not bound a peer's access to the registration
    # (pdserve/kvtransfer/nixl_policy.py): every peer may then read and write this process.
    nixl_unbounded: bool = False
    # Hands this engine's blocks (and, with NIXL, its agent metadata and addresses) to peers that
    # ask: the prefill role. A decode-role engine only pulls, so it tells no peer where its memory is.
    serves_blocks: bool = True
    faults: KVFaults = field(default_factory=KVFaults.from_env)

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
