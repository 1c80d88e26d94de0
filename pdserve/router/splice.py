"""StreamSplice: a decode leg's SSE stream read as whole events on its way to the client, so that another engine
can continue it if it breaks (docs/faults.md, "Streams that survive a decode pod").

Each leg's bytes are cut into events (an event ends with a blank line; TCP may cut anywhere); only whole events
reach the client, so a break never leaves half an event there. The router-only comments are taken out: the token
comment before each data event (pdserve/api/continuation.py) is what the choice's record gains once that event is
passed on, and the report comment (pdserve/api/report.py) is kept for the metrics. The first data event gives the
response's ``id`` and ``created``, which a continuation answers under. An error event of a failed engine (5xx) is
held back: the stream is continued elsewhere instead; a client error (4xx) is the answer and passes. A draining
engine's hand-off comment ends its leg the same way.

Token comments are kept as they came and read in batches (one JSON decode per ``READ_BATCH`` of them, or when the
stream is continued): one decode per token was ~7% of the router's instructions per streamed P/D request.
"""

from __future__ import annotations

import contextlib

import msgspec

from pdserve.api.continuation import (
    HANDOFF_COMMENT,
    TOKENS_COMMENT,
    Continuation,
    ContinuedChoice,
    StreamTokens,
    read_tokens_comment,
)
from pdserve.api.protocol import SSE_DONE
from pdserve.api.report import REPORT_COMMENT, Report

_DATA = b"data: "
_ERROR_EVENT = b'data: {"error"'
_DONE = SSE_DONE.strip()
_END = b"\n\n"
_HANDOFF = HANDOFF_COMMENT.strip()
_COLON = ord(":")
READ_BATCH = 64


class _Identity(msgspec.Struct):
    id: str = ""
    created: int = 0


_TOKENS_LIST = msgspec.json.Decoder(list[StreamTokens])


class _ErrorBody(msgspec.Struct):
    code: int | str | None = None


class _ErrorEvent(msgspec.Struct):
    error: _ErrorBody


class StreamSplice:
    def __init__(self) -> None:
        self._partial = b""  # the start of an event whose end has not come yet
        self._tokens: bytes | None = None  # the token comment of the data event that comes next
        self._passed: list[bytes] = []  # token comments whose data event passed, not yet read into ``_choices``
        self._choices: dict[int, ContinuedChoice] = {}  # what the client has of each choice
        self.id = ""
        self.created = 0
        self.report: Report | None = None
        self.last_data = b""  # the last data event before [DONE]: the usage event, if the client asked for one
        self.done = False  # [DONE] passed: the answer is whole
        self.failed_engine = False  # the engine ended the stream with a server error (held back)
        self.handed_off = False  # the engine, draining, handed the stream back

    def start_leg(self) -> None:
        """A new leg's bytes come next: what the broken one left half-sent is dropped."""
        self._partial = b""
        self._tokens = None
        self.failed_engine = self.handed_off = False

    def feed(self, chunk: bytes) -> bytes:
        """The whole events of ``chunk`` (with what came before it) to pass to the client, router-only comments
        taken out; stops at a failed engine's error event (``failed_engine``) or a hand-off (``handed_off``)."""
        data = self._partial + chunk if self._partial else chunk
        end = data.rfind(_END)
        if end < 0:
            self._partial = data
            return b""
        self._partial = data[end + 2 :]
        whole = data[:end]
        errors = _ERROR_EVENT in whole  # one search per chunk, not a check per event
        out: list[bytes] = []
        for event in whole.split(_END):
            if not event:
                continue
            if event[0] == _COLON:
                if event.startswith(TOKENS_COMMENT):
                    self._tokens = event
                    continue
                if event == _HANDOFF:
                    self.handed_off = True
                    self._partial = b""
                    break
                if event.startswith(REPORT_COMMENT):
                    with contextlib.suppress(msgspec.MsgspecError):  # unreadable: it counts nowhere
                        self.report = msgspec.json.decode(event[len(REPORT_COMMENT) :], type=Report)
                    continue
            elif errors and event.startswith(_ERROR_EVENT) and _server_error(event):
                self.failed_engine = True
                self._partial = b""
                break
            elif event.startswith(_DATA):
                if event == _DONE:
                    self.done = True
                else:
                    self.last_data = event
                if not self.id and not self.done:
                    with contextlib.suppress(msgspec.MsgspecError):  # not a chunk: the next one says
                        identity = msgspec.json.decode(event[len(_DATA) :], type=_Identity)
                        self.id, self.created = identity.id, identity.created
                if self._tokens is not None:
                    self._passed.append(self._tokens)
                    self._tokens = None
            out.append(event)
        if len(self._passed) >= READ_BATCH:
            self._read_passed()
        if not out:
            return b""
        out.append(b"")
        return _END.join(out)

    def _read_passed(self) -> None:
        """Fold the token comments whose events passed into ``_choices``, in one decode (where one is unreadable,
        one by one: that one counts nowhere)."""
        start = len(TOKENS_COMMENT)
        try:
            read = _TOKENS_LIST.decode(b"[%s]" % b",".join([event[start:] for event in self._passed]))
        except msgspec.MsgspecError:
            read = [tokens for tokens in map(read_tokens_comment, self._passed) if tokens is not None]
        for tokens in read:
            self._record(tokens)
        self._passed.clear()

    def _record(self, tokens: StreamTokens) -> None:
        choice = self._choices.get(tokens.index)
        if choice is None:
            choice = self._choices[tokens.index] = ContinuedChoice(tokens.index, [])
        choice.token_ids.extend(tokens.token_ids)
        if tokens.seed is not None:
            choice.seed = tokens.seed
        if tokens.finish_reason is not None:
            choice.finish_reason, choice.stop_reason = tokens.finish_reason, tokens.stop_reason

    def continuation(self) -> Continuation | None:
        """What another engine needs to continue the stream (a choice not named had produced nothing); None
        before the stream said its id (nothing of it can be continued: it starts again)."""
        if not self.id:
            return None
        self._read_passed()
        return Continuation(self.id, self.created, list(self._choices.values()))


def _server_error(event: bytes) -> bool:
    try:
        code = msgspec.json.decode(event[len(_DATA) :], type=_ErrorEvent).error.code
    except msgspec.MsgspecError:
        return False
    return isinstance(code, int) and code >= 500
