"""A chat choice's answer text read as it streams: the thinking apart (reasoning parser), tool calls
apart (tool parser), the rest content. Streamed deltas and a whole answer go through the same reading,
so both give the same result.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdserve.api.protocol import DeltaToolCall, ToolCall
from pdserve.engine.reasoning import ReasoningMarkers, blank_token_test
from pdserve.engine.reasoning import reasoning_parser as reasoning_parser_named
from pdserve.server.reasoning import ReasoningStream
from pdserve.server.tool_parsers import CallIds, ToolCallStream, ToolDelta, ToolParser, collect_calls, tool_parser
from pdserve.server.tools import ToolUse


@dataclass
class ChatPiece:
    reasoning: str = ""
    content: str = ""
    calls: list[DeltaToolCall] = field(default_factory=list)


class ChatOutputReader:
    def __init__(self, reasoning: ReasoningStream | None, tools: ToolCallStream | None) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.called = False  # a tool call was read: the choice finishes with "tool_calls"

    def feed(self, text: str) -> ChatPiece:
        thinking, answer = self.reasoning.feed(text) if self.reasoning is not None else ("", text)
        return self._answer(thinking, self.tools.feed(answer) if self.tools is not None else ToolDelta(answer))

    def finish(self) -> ChatPiece:
        thinking, answer = self.reasoning.finish() if self.reasoning is not None else ("", "")
        if self.tools is None:
            return ChatPiece(thinking, answer)
        return _joined(self._answer(thinking, self.tools.feed(answer)), self._answer("", self.tools.finish()))

    def feed_last(self, text: str) -> ChatPiece:
        """The answer's last text and its end, as one piece."""
        return _joined(self.feed(text), self.finish())

    def _answer(self, thinking: str, delta: ToolDelta) -> ChatPiece:
        self.called = self.called or bool(delta.calls)
        return ChatPiece(thinking, delta.content, delta.calls)

    def finish_reason(self, finish_reason: str | None) -> str | None:
        """An answer that ended by itself after calling tools finishes with "tool_calls"."""
        return "tool_calls" if finish_reason == "stop" and self.called else finish_reason

    def whole(self, text: str) -> tuple[str | None, str | None, list[ToolCall]]:
        """A whole answer's (reasoning_content, content, tool_calls); None where there is none."""
        piece = self.feed_last(text)
        calls = collect_calls(piece.calls)
        return piece.reasoning or None, piece.content or (None if calls else piece.content), calls


def _joined(first: ChatPiece, second: ChatPiece) -> ChatPiece:
    return ChatPiece(first.reasoning + second.reasoning, first.content + second.content, first.calls + second.calls)


@dataclass(frozen=True)
class ChatParsers:
    """The server's reasoning parser (with its markers in the model's vocabulary) and tool parser."""

    reasoning: ReasoningMarkers | None = None
    is_blank: Callable[[int], bool] | None = None
    tools: ToolParser | None = None

    @classmethod
    def of(cls, tokenizer: Any, reasoning_parser: str | None, tool_call_parser: str | None) -> ChatParsers:
        markers = None
        if reasoning_parser is not None:
            markers = ReasoningMarkers.of(reasoning_parser_named(reasoning_parser), tokenizer)
        return cls(
            markers,
            blank_token_test(tokenizer),
            tool_parser(tool_call_parser) if tool_call_parser is not None else None,
        )

    def reader(self, prompt: list[int], tool_use: ToolUse, call_ids: CallIds) -> ChatOutputReader | None:
        """How a choice's answer to ``prompt`` is read (``call_ids``: its tool calls' ids); None: all of it is
        content."""
        reasoning = None
        if self.reasoning is not None:
            assert self.is_blank is not None
            reasoning = ReasoningStream(self.reasoning.parser, self.reasoning.start_of(prompt, self.is_blank))
        tools = tool_use.parser.stream(call_ids) if tool_use.parser is not None else None
        if reasoning is None and tools is None:
            return None
        return ChatOutputReader(reasoning, tools)
