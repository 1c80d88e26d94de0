"""The peer-read fields of ``kv_transfer_params`` (docs/kv-cache.md, "Peers"; docs/contracts.md), both the
router's only: what they hold, how the router writes them and how an engine reads them.

- ``kv_peer_hold`` (a decode leg's): when the request ends, keep its blocks for peers under this handle (random,
  the router's: :func:`new_peer_handle`);
- ``kv_prefix_source`` (a prefill leg's): the prompt's leading ``num_tokens`` are held by engine ``engine_id``
  (side channel ``host``/``ports``) under ``handle``, and ``capability`` (the router's Ed25519 signature over the
  reader's and the holder's ids, the handle and ``expires_at``; ``pdserve.api.auth``) lets engine ``reader``, and
  no other, read them until then.
"""

from __future__ import annotations

import secrets
from typing import Any

import msgspec

from pdserve.api.kv_fields import MAX_TP_SIZE, field_value, id_value, int_list_value

PEER_HANDLE_BYTES = 16
PEER_HANDLE_CHARS = 2 * PEER_HANDLE_BYTES  # hex
MAX_CAPABILITY_CHARS = 512
WHERE = "kv_prefix_source."


def new_peer_handle() -> str:
    return secrets.token_hex(PEER_HANDLE_BYTES)


class PrefixSource(msgspec.Struct, frozen=True):
    """A prefill leg's ``kv_prefix_source``: where its prompt's leading tokens' KV may be read, and the router's
    capability to read it (checked by the holder, never by the reader)."""

    engine_id: str  # the holder
    host: str
    ports: tuple[int, ...]  # the holder's side channel, per rank
    handle: str
    num_tokens: int  # whole blocks of the prompt the holder is expected to hold
    reader: str  # the engine the capability is for
    expires_at: float  # wall clock
    capability: str = ""  # hex signature (empty without keys)

    @property
    def tp_size(self) -> int:
        return len(self.ports)


class PeerKV(msgspec.Struct, frozen=True):
    """A request's part in peer reads: hold its blocks for peers when it ends (``hold``: the handle), or read its
    prompt's leading blocks from a peer (``source``)."""

    hold: str = ""
    source: PrefixSource | None = None


def _handle(value: Any, name: str) -> str:
    if not isinstance(value, str) or len(value) != PEER_HANDLE_CHARS or not all(c in "0123456789abcdef" for c in value):
        raise ValueError(f"kv_transfer_params.{name} must be {PEER_HANDLE_CHARS} lowercase hex digits")
    return value


def parse_peer_kv(params: dict[str, Any] | None) -> PeerKV | None:
    """The peer-read part of a request's params (None: none). Raises ValueError naming the bad field."""
    if not params:
        return None
    raw_hold = params.get("kv_peer_hold")
    source = params.get("kv_prefix_source")
    if raw_hold is None and source is None:
        return None
    hold = "" if raw_hold is None else _handle(raw_hold, "kv_peer_hold")
    if source is None:
        return PeerKV(hold=hold)
    if not isinstance(source, dict):
        raise ValueError("kv_transfer_params.kv_prefix_source must be an object")
    ports = int_list_value(source, "ports", WHERE)
    if not 0 < len(ports) <= MAX_TP_SIZE or not all(0 < port < 65536 for port in ports):
        raise ValueError(f"kv_transfer_params.kv_prefix_source.ports must be 1 to {MAX_TP_SIZE} TCP ports")
    num_tokens = field_value(source, "num_tokens", int, WHERE)
    if num_tokens <= 0:
        raise ValueError("kv_transfer_params.kv_prefix_source.num_tokens must be positive")
    capability = source.get("capability", "")
    if not isinstance(capability, str) or len(capability) > MAX_CAPABILITY_CHARS:
        raise ValueError(
            f"kv_transfer_params.kv_prefix_source.capability must be a string of at most {MAX_CAPABILITY_CHARS}"
        )
    return PeerKV(
        hold=hold,
        source=PrefixSource(
            engine_id=id_value(source, "engine_id", WHERE),
            host=id_value(source, "host", WHERE),
            ports=tuple(ports),
            handle=_handle(source.get("handle"), "kv_prefix_source.handle"),
            num_tokens=num_tokens,
            reader=id_value(source, "reader", WHERE),
            expires_at=float(field_value(source, "expires_at", (int, float), WHERE)),
            capability=capability,
        ),
    )


def prefix_source_params(source: PrefixSource) -> dict[str, Any]:
    """A prefill leg's ``kv_prefix_source`` (the router's)."""
    return {
        "engine_id": source.engine_id,
        "host": source.host,
        "ports": list(source.ports),
        "handle": source.handle,
        "num_tokens": source.num_tokens,
        "reader": source.reader,
        "expires_at": source.expires_at,
        "capability": source.capability,
    }
