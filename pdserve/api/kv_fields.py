"""Checked reads of ``kv_transfer_params`` fields: the params are client input until the router's signature says
otherwise, so every field is type- and bound-checked, and a bad one is a ValueError naming it (a 400 at the door).
Used by the P/D params (``pdserve.kvtransfer.params``) and the peer-read ones (``pdserve.api.peer_kv``)."""

from __future__ import annotations

from typing import Any

MAX_TP_SIZE = 64
# Bounds on the identifiers an engine puts in its side-channel messages: a message naming many holds stays far
# below the side channel's frame bound.
MAX_ID_CHARS = 256


def field_value(params: dict[str, Any], name: str, kind: type | tuple[type, ...], where: str = "") -> Any:
    """``params[name]`` if it is a ``kind`` (never a bool); ``where``: the object's path, for the message."""
    value = params.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        kinds = kind if isinstance(kind, tuple) else (kind,)
        raise ValueError(f"kv_transfer_params.{where}{name} must be a {' or '.join(k.__name__ for k in kinds)}")
    return value


def id_value(params: dict[str, Any], name: str, where: str = "") -> str:
    value = field_value(params, name, str, where)
    if not 0 < len(value) <= MAX_ID_CHARS:
        raise ValueError(f"kv_transfer_params.{where}{name} must be 1 to {MAX_ID_CHARS} characters")
    return str(value)


def int_list_value(params: dict[str, Any], name: str, where: str = "") -> list[int]:
    value = field_value(params, name, list, where)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise ValueError(f"kv_transfer_params.{where}{name} must be a list of non-negative integers")
    return list(value)
