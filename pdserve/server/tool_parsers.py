"""Tool parsers: a model's tool calls found in its answer text and turned into OpenAI's ``tool_calls``
(``--tool-call-parser``), streamed as the text comes or all at once, with the same result.

A parser also writes the grammar that forces calls in its own format (``tool_choice`` "required" or a
named function), so forced calls look like the calls the model was trained to write, and the same
parser reads them back.

``hermes``: Qwen's and Hermes' format, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
one block per call. Text outside the blocks is the message's content (whitespace next to a block is
dropped); a block whose name cannot be read stays content. The arguments are passed on as the model
wrote them (their JSON text), so streamed fragments join to exactly the non-streamed arguments.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from pdserve.api.protocol import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall
from pdserve.engine.grammar import json_schema_rules
from pdserve.server.reasoning import held_marker_prefix


@dataclass
class ToolDelta:
    """What some more answer text adds: content, and pieces of tool calls."""

    content: str = ""
    calls: list[DeltaToolCall] = field(default_factory=list)


class ToolCallStream(Protocol):
    def feed(self, text: str) -> ToolDelta: ...

    def finish(self) -> ToolDelta:
        """The end of the answer: whatever was held back."""
        ...


CallIds = Callable[[int], str]  # a choice's tool-call id of each call index


class ToolParser(Protocol):
    name: str

    def stream(self, call_ids: CallIds) -> ToolCallStream: ...

    def forced_grammar(self, functions: list[tuple[str, dict[str, Any]]], parallel: bool) -> str:
        """An EBNF grammar of one call (several, if ``parallel``) of these (name, parameters schema)
        functions, in this parser's format."""
        ...


def call_ids(response_id: str, choice: int) -> CallIds:
    """A choice's tool-call ids: a function of the response's id (random), the choice and the call's index, so
    that a stream another engine continues (same id) names its calls as the first engine did."""

    def call_id(index: int) -> str:
        digest = hashlib.blake2b(f"{response_id}/{choice}/{index}".encode(), digest_size=12).hexdigest()
        return f"call_{digest}"

    return call_id


# ----- hermes -------------------------------------------------------------------------------------

_OPEN = "<tool_call>"
_CLOSE = "</tool_call>"
_DECODER = json.JSONDecoder()


def _skip_blank(text: str, at: int) -> int:
    while at < len(text) and text[at] in " \t\r\n":
        at += 1
    return at


def _object_members(text: str) -> dict[str, tuple[int, int | None]] | None:
    """The top-level members of the JSON object ``text`` starts with, as far as it goes: name ->
    (start, end) of the value's text, end None where the value is cut off. None: not an object."""
    at = _skip_blank(text, 0)
    if at == len(text):
        return {}
    if text[at] != "{":
        return None
    members: dict[str, tuple[int, int | None]] = {}
    at += 1
    while True:
        at = _skip_blank(text, at)
        if at < len(text) and text[at] == ",":
            at = _skip_blank(text, at + 1)
        if at >= len(text) or text[at] == "}":
            return members
        try:
            key, at = _DECODER.raw_decode(text, at)
        except ValueError:
            return members  # a key cut off (or not JSON: the caller sees no name)
        at = _skip_blank(text, at)
        if at >= len(text) or text[at] != ":" or not isinstance(key, str):
            return members
        at = _skip_blank(text, at + 1)
        try:
            _, end = _DECODER.raw_decode(text, at)
        except ValueError:
            members[key] = (at, None)
            return members
        if end == len(text) and text[at] not in '{["':
            members[key] = (at, None)  # a number, true, false or null may still go on
            return members
        members[key] = (at, end)
        at = end


class _HermesCall:
    """One ``<tool_call>`` block being read."""

    def __init__(self, index: int, call_id: str) -> None:
        self.index = index
        self.call_id = call_id
        self.body = ""
        self.named = False
        self.arguments_sent = 0

    def advance(self, body: str, final: bool) -> list[DeltaToolCall]:
        """Pieces of the call that ``body`` (the block's text so far) adds; ``final``: the block is whole."""
        self.body = body
        members = _object_members(body) or {}
        deltas: list[DeltaToolCall] = []
        if not self.named:
            name = members.get("name")
            if name is None or name[1] is None:
                return deltas
            value = json.loads(body[name[0] : name[1]])
            if not isinstance(value, str):
                return deltas
            self.named = True
            deltas.append(
                DeltaToolCall(
                    index=self.index,
                    id=self.call_id,
                    type="function",
                    function=DeltaFunctionCall(name=value, arguments=""),
                )
            )
        arguments = members.get("arguments")
        if arguments is None:
            text = "{}" if final and not self.arguments_sent else ""
        else:
            start, end = arguments
            if end is None and final:
                end = len(body.rstrip())
            text = body[start:end][self.arguments_sent :]
        if text:
            self.arguments_sent += len(text)
            deltas.append(DeltaToolCall(index=self.index, function=DeltaFunctionCall(arguments=text)))
        return deltas


class HermesToolCallStream:
    def __init__(self, call_ids: CallIds) -> None:
        self._call_ids = call_ids
        self._pending = ""  # text not yet read
        self._call: _HermesCall | None = None  # the block being read
        self._num_calls = 0
        self._blank = ""  # whitespace of the content, held until it is known not to touch a block
        self._after_call = False

    def feed(self, text: str) -> ToolDelta:
        self._pending += text
        return self._read(final=False)

    def finish(self) -> ToolDelta:
        delta = self._read(final=True)
        if self._call is not None:  # a block the answer never closed
            delta.calls += self._end_call(self._pending, closed=False, delta=delta)
        elif self._pending:
            delta.content += self._content(self._pending)
        if not self._after_call:
            delta.content += self._blank
        self._pending = self._blank = ""
        return delta

    def _read(self, final: bool) -> ToolDelta:
        delta = ToolDelta()
        while True:
            pending = self._pending
            if self._call is None:
                start = pending.find(_OPEN)
                if start < 0:
                    keep = 0 if final else held_marker_prefix(pending, _OPEN)
                    delta.content += self._content(pending[: len(pending) - keep])
                    self._pending = pending[len(pending) - keep :]
                    return delta
                delta.content += self._content(pending[:start])
                self._blank = ""  # whitespace before a block is dropped
                self._call = _HermesCall(self._num_calls, self._call_ids(self._num_calls))
                self._pending = pending[start + len(_OPEN) :]
                continue
            end = pending.find(_CLOSE)
            if end < 0:
                if not final:
                    keep = held_marker_prefix(pending, _CLOSE)
                    delta.calls += self._call.advance(pending[: len(pending) - keep], final=False)
                return delta
            self._pending = pending[end + len(_CLOSE) :]
            delta.calls += self._end_call(pending[:end], closed=True, delta=delta)

    def _end_call(self, body: str, closed: bool, delta: ToolDelta) -> list[DeltaToolCall]:
        call = self._call
        assert call is not None
        self._call = None
        pieces = call.advance(body, final=True)
        if call.named:
            self._num_calls += 1
            self._after_call = True
            self._blank = ""
            return pieces
        # Not a call anyone can make: the block stays text of the answer.
        delta.content += self._content(_OPEN + body + (_CLOSE if closed else ""))
        if not closed:
            self._pending = ""
        return []

    def _content(self, text: str) -> str:
        out: list[str] = []
        start = 0
        for index, char in enumerate(text):
            if not char.isspace():
                continue
            if index > start:
                self._flush_word(out, text[start:index])
            self._blank += char
            start = index + 1
        if start < len(text):
            self._flush_word(out, text[start:])
        return "".join(out)

    def _flush_word(self, out: list[str], word: str) -> None:
        if not self._after_call:
            out.append(self._blank)
        self._blank = ""
        self._after_call = False
        out.append(word)


class HermesToolParser:
    name = "hermes"

    def stream(self, call_ids: CallIds) -> HermesToolCallStream:
        return HermesToolCallStream(call_ids)

    def forced_grammar(self, functions: list[tuple[str, dict[str, Any]]], parallel: bool) -> str:
        call_schema = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "name": {"const": name},
                        "arguments": rebased_refs(parameters, f"#/anyOf/{index}/properties/arguments"),
                    },
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for index, (name, parameters) in enumerate(functions)
            ]
        }
        repeat = ' ("\\n" tool_call)*' if parallel else ""
        return (
            f"root ::= tool_call{repeat}\n"
            'tool_call ::= "<tool_call>\\n" tool_call_json "\\n</tool_call>"\n'
            + json_schema_rules(call_schema, "tool_call_json")
        )


def rebased_refs(schema: Any, base: str) -> Any:
    """``schema`` moved to ``base`` (a JSON pointer) within a larger schema: its local ``$ref``s
    ("#", "#/$defs/...") are rewritten to point where their targets now are."""
    if isinstance(schema, list):
        return [rebased_refs(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    moved = {key: rebased_refs(value, base) for key, value in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        moved["$ref"] = base + ref[1:]
    return moved


TOOL_PARSERS: dict[str, type[HermesToolParser]] = {"hermes": HermesToolParser}


def tool_parser(name: str) -> ToolParser:
    parser_cls = TOOL_PARSERS.get(name)
    if parser_cls is None:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}")
    return parser_cls()


def collect_calls(pieces: Iterable[DeltaToolCall]) -> list[ToolCall]:
    """Whole tool calls from their streamed pieces."""
    calls: list[ToolCall] = []
    for piece in pieces:
        function = piece.function
        assert function is not None
        if piece.id is not None:
            calls.append(ToolCall(id=piece.id, function=FunctionCall(name=function.name or "", arguments="")))
        calls[piece.index].function.arguments += function.arguments or ""
    return calls
