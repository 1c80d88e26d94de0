"""Continuing a stream on another engine (docs/faults.md, "Streams that survive a decode pod"): what the router
learns of a stream as it relays it, and what it sends the engine that continues it. Both are the router's only.

- **Token comments.** A leg sent with the request header ``TOKENS_HEADER: 1`` has, before each data event of its
  stream and in the same write, one SSE comment line ``: pdserve-tokens {...}`` (:class:`StreamTokens`): the
  choice's index, the token ids the event's text came from, and once the choice ended its finish and stop reasons.
  SSE clients skip comments; the router takes them out anyway.
- **Hand-off.** A draining engine ends each such stream still running after its hand-off time with
  ``HANDOFF_COMMENT`` instead of waiting for its end: the router continues it on another engine.
- **``kv_transfer_params.continue``** (:class:`Continuation`): continue the request whose answer so far had this
  ``id`` and ``created`` and these tokens per choice. The engine runs each unfinished choice with its tokens as
  output already generated (``max_tokens``, ``min_tokens``, penalties and the seed's draws count them; the grammar
  is replayed over them; stop strings see the text across the splice) and streams only what follows them: no
  role chunk, no text of the old tokens, the same ``id``/``created``, one usage over the whole output.
"""

from __future__ import annotations

from typing import Any

import msgspec

TOKENS_HEADER = "X-PDServe-Tokens"
# On a continued stream's answer: the engine continued it (one that ignored ``continue`` would answer it all again).
CONTINUED_HEADER = "X-PDServe-Continued"
TOKENS_COMMENT = b": pdserve-tokens "
# A draining engine ends a stream the router relays with this comment (after its last data event): the router
# continues the stream elsewhere, as if it broke, without counting the engine as failed.
HANDOFF_COMMENT = b": pdserve-handoff\n\n"
MAX_CONTINUED_CHOICES = 4096  # prompts x n, as an engine's in-flight bound allows


class StreamTokens(msgspec.Struct, omit_defaults=True, array_like=True):
    """One data event's tokens: choice ``index``'s ``token_ids``; ``finish_reason``/``stop_reason`` the engine's
    (before a chat parser renames it, say to ``tool_calls``) once the choice ended with this event; ``seed``, on
    a sampled choice's first event, the seed its draws come from (the engine picks one for a request without)."""

    index: int
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    seed: int | None = None


class ContinuedChoice(msgspec.Struct, omit_defaults=True):
    """A choice's answer so far: its tokens, and its end if it had ended (then it only counts in usage); the seed
    its draws came from (the continuation draws from it too: the same tokens as the first engine would)."""

    index: int
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    seed: int | None = None


class Continuation(msgspec.Struct):
    id: str
    created: int
    choices: list[ContinuedChoice]

    def of(self, index: int) -> ContinuedChoice | None:
        for choice in self.choices:
            if choice.index == index:
                return choice
        return None


def tokens_comment(tokens: StreamTokens) -> bytes:
    return TOKENS_COMMENT + msgspec.json.encode(tokens) + b"\n\n"


def read_tokens_comment(event: bytes) -> StreamTokens | None:
    """The tokens of one SSE event (without its blank line) if it is a token comment; None otherwise."""
    if not event.startswith(TOKENS_COMMENT):
        return None
    try:
        return msgspec.json.decode(event[len(TOKENS_COMMENT) :], type=StreamTokens)
    except msgspec.MsgspecError:
        return None


_FINISH_REASONS = ("stop", "length")


def parse_continuation(params: dict[str, Any] | None) -> Continuation | None:
    """The ``continue`` field of a request's params (None: absent). Raises ValueError naming what is wrong."""
    if not params or params.get("continue") is None:
        return None
    try:
        continuation = msgspec.convert(params["continue"], Continuation)
    except msgspec.ValidationError as error:
        raise ValueError(f"kv_transfer_params.continue: {error}") from None
    if len(continuation.choices) > MAX_CONTINUED_CHOICES:
        raise ValueError(f"kv_transfer_params.continue.choices must hold at most {MAX_CONTINUED_CHOICES} choices")
    indexes = [choice.index for choice in continuation.choices]
    if len(set(indexes)) != len(indexes) or min(indexes, default=0) < 0:
        raise ValueError("kv_transfer_params.continue.choices must name each choice index (>= 0) once")
    for choice in continuation.choices:
        if choice.seed is not None and not -(2**63) <= choice.seed < 2**63:
            raise ValueError("kv_transfer_params.continue.choices[].seed must be a signed 64-bit integer")
        if any(token < 0 for token in choice.token_ids):
            raise ValueError("kv_transfer_params.continue.choices[].token_ids must be token ids")
        if choice.finish_reason is not None and choice.finish_reason not in _FINISH_REASONS:
            raise ValueError(f"kv_transfer_params.continue.choices[].finish_reason must be one of {_FINISH_REASONS}")
    return continuation
