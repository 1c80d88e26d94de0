"""``kv_transfer_params``: what a prefill engine hands back and a decode engine reads.

The field names are vLLM's P/D convention (a contract: docs/contracts.md), so one proxy
drives either system. pdserve adds fields of its own, all prefixed ``remote_`` or ``kv_``; a
proxy passes the whole object through unchanged:

- ``remote_block_generations``: each held block's generation, checked after the pull;
- ``remote_num_tokens`` and ``remote_prompt_hash``: the tokens whose KV the blocks hold, so a
  decode engine that tokenized the prompt differently never reads KV of another text;
- ``kv_compat_hash``: model, dtype, block size and cache layout of the prefill engine;
- ``remote_lease_seconds``: how long the blocks stay held without a renewal;
- ``remote_ports``: every tensor-parallel rank's side channel, in rank order (``remote_port`` is
  rank 0's): their number is the prefill engine's TP size;
- ``remote_hold_token``: the hold's capability, random: the prefill engine reads, renews and releases the
  hold only for a peer that names it (request ids are no secret; clients choose some).

The peer-read fields (``kv_peer_hold``, ``kv_prefix_source``) are the router's too: ``pdserve.api.peer_kv``.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from array import array
from typing import TYPE_CHECKING, Any

import msgspec

from pdserve.api.kv_fields import MAX_TP_SIZE, field_value, id_value, int_list_value

if TYPE_CHECKING:
    from pdserve.models.config import ModelConfig

HOLD_TOKEN_BYTES = 16


def new_hold_token() -> str:
    return secrets.token_hex(HOLD_TOKEN_BYTES)


def kv_compat_hash(**fields: object) -> str:
    """A digest of what must match for one engine's KV blocks to be valid in another's cache."""
    text = ";".join(f"{name}={fields[name]}" for name in sorted(fields))
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def model_compat_hash(
    model: ModelConfig,
    weights: str,
    dtype: str,
    block_size: int,
    tp_size: int,
    cache_layout: str,
    state_layout: str,
    kv_dtype: str | None = None,
) -> str:
    """The compatibility hash of an engine's KV blocks: exactly what determines a token's KV. The weights
    (``weights``: their fingerprint), rope and window, the model's dtype (``dtype``: it computes the KV) and
    the cache's (``kv_dtype``, when it stores another: the hash of a cache in the model's dtype is what it
    was before the cache could differ), block size, shape and layout
    (``cache_layout``: the worker's name for it). Not the tensor-parallel size: engines of one model at
    different TP sizes may pair (each rank's head ranges are a handshake matter), except hybrid models, whose
    state slots (laid out as ``state_layout`` says) are split by rank."""
    stored = {"kv_dtype": kv_dtype} if kv_dtype is not None and kv_dtype != dtype else {}
    return kv_compat_hash(
        **stored,
        weights=weights,
        architecture=model.architecture,
        routing=model.routing,
        rope_theta=model.rope_theta,
        rope_scaling=json.dumps(model.rope_scaling, sort_keys=True),
        sliding_window=model.sliding_window,
        layers=model.num_layers,
        kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        dtype=dtype,
        block_size=block_size,
        layout=cache_layout,
        layer_types=",".join(model.layer_types),
        state_layout=f"{state_layout};tp={tp_size}" if model.is_hybrid else "",
    )


def prompt_hash(token_ids: list[int]) -> str:
    return hashlib.blake2b(array("q", token_ids).tobytes(), digest_size=16).hexdigest()


class RemotePrefill(msgspec.Struct, frozen=True):
    """Where a decode engine finds a request's prefilled blocks: a decode leg's ``do_remote_prefill`` params,
    parsed and screened once by the API process (pdserve/server/pd_gate.py) and carried to the core, to its
    connector and to the transfer agent as this value."""

    engine_id: str
    request_id: str
    host: str
    port: int
    block_ids: list[int]
    generations: list[int]
    num_tokens: int
    prompt_hash: str
    compat_hash: str
    lease_seconds: float
    # Each prefill rank's side-channel port, in rank order (one: TP 1); ``port`` is rank 0's.
    ports: tuple[int, ...] = ()
    hold_token: str = ""  # the hold's capability (``remote_hold_token``)

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    @property
    def tp_size(self) -> int:
        return len(self.ports) or 1

    def rank_address(self, rank: int) -> tuple[str, int]:
        return self.host, self.ports[rank] if self.ports else self.port


def parse_remote_prefill(params: dict[str, Any] | None) -> RemotePrefill | None:
    """The remote blocks a request's params point at; None unless ``do_remote_prefill`` is true.

    Raises ValueError naming the bad field: params are client input, checked before admission.
    """
    if not params or params.get("do_remote_prefill") is not True:
        return None
    block_ids = int_list_value(params, "remote_block_ids")
    generations = int_list_value(params, "remote_block_generations")
    if len(generations) != len(block_ids):
        raise ValueError("kv_transfer_params.remote_block_generations must have one entry per remote block")
    port = field_value(params, "remote_port", int)
    if not 0 < port < 65536:
        raise ValueError("kv_transfer_params.remote_port must be a TCP port")
    ports = [port]
    if "remote_ports" in params:
        ports = int_list_value(params, "remote_ports")
        if not 0 < len(ports) <= MAX_TP_SIZE or not all(0 < p < 65536 for p in ports) or ports[0] != port:
            raise ValueError(
                f"kv_transfer_params.remote_ports must be 1 to {MAX_TP_SIZE} TCP ports, the first remote_port"
            )
    num_tokens = field_value(params, "remote_num_tokens", int)
    lease_seconds = field_value(params, "remote_lease_seconds", (int, float))
    if not lease_seconds > 0:
        raise ValueError("kv_transfer_params.remote_lease_seconds must be positive")
    return RemotePrefill(
        engine_id=id_value(params, "remote_engine_id"),
        request_id=id_value(params, "remote_request_id"),
        host=id_value(params, "remote_host"),
        port=port,
        block_ids=block_ids,
        generations=generations,
        num_tokens=num_tokens,
        prompt_hash=field_value(params, "remote_prompt_hash", str),
        compat_hash=field_value(params, "kv_compat_hash", str),
        lease_seconds=float(lease_seconds),
        ports=tuple(ports),
        hold_token=id_value(params, "remote_hold_token"),
    )


def wants_remote_decode(params: dict[str, Any] | None) -> bool:
    return bool(params) and params.get("do_remote_decode") is True  # type: ignore[union-attr]


def remote_prefill_params(
    *,
    engine_id: str,
    request_id: str,
    host: str,
    ports: list[int],
    block_ids: list[int],
    generations: list[int],
    num_tokens: int,
    prompt: list[int],
    compat_hash: str,
    lease_seconds: float,
    hold_token: str,
) -> dict[str, Any]:
    """What a prefill engine returns for a request whose blocks it now holds (``ports``: each rank's
    side channel, in rank order; ``hold_token``: the hold's capability)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_block_ids": block_ids,
        "remote_host": host,
        "remote_port": ports[0],
        "remote_ports": ports,
        "remote_block_generations": generations,
        "remote_num_tokens": num_tokens,
        "remote_prompt_hash": prompt_hash(prompt),
        "kv_compat_hash": compat_hash,
        "remote_lease_seconds": lease_seconds,
        "remote_hold_token": hold_token,
    }
