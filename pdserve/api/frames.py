"""Decoding frames that arrive from the network (ZMQ side channel, KV-event stream): one definition
of "bounded, typed, never raises", so every socket gets the same protection."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec


def frame_decoder(message_type: Any, max_bytes: int) -> Callable[[bytes], Any]:
    """A msgpack decoder into ``message_type`` that answers None for anything oversized or malformed."""
    decoder = msgspec.msgpack.Decoder(message_type)

    def decode(frame: bytes) -> Any:
        if len(frame) > max_bytes:
            return None
        try:
            return decoder.decode(frame)
        except (msgspec.DecodeError, RecursionError):  # RecursionError: nesting beyond Python's limit
            return None

    return decode
