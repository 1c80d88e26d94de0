"""Reasoning parsers: how a reasoning model marks its thinking (``--reasoning-parser``), and where a
request's output starts: in the thinking, in the answer, or (Qwen3) in either, as the model's first
token decides.

One definition for the engine core, which keeps a request's grammar off its thinking (a structured
output constrains the answer), and for the API server, which moves the thinking into
``reasoning_content``. Both read the same markers from the prompt's end, so they agree.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass


class ReasoningStart(enum.Enum):
    THINKING = "thinking"  # the output thinks until the end marker
    ANSWER = "answer"  # no thinking: the output is the answer
    OPTIONAL = "optional"  # the output thinks only if it begins with the start marker


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    # Without a marker at the prompt's end, the output thinks from its first token (DeepSeek-R1: the
    # model may leave out the opening marker) or only if it opens with the start marker (Qwen3).
    implicit_start: bool
    start: str = "<think>"
    end: str = "</think>"


REASONING_PARSERS = {
    "qwen3": ReasoningParser("qwen3", implicit_start=False),
    "deepseek_r1": ReasoningParser("deepseek_r1", implicit_start=True),
}
# How far back from the prompt's end a marker counts (past whitespace tokens only).
_TAIL_TOKENS = 8


def reasoning_parser(name: str) -> ReasoningParser:
    parser = REASONING_PARSERS.get(name)
    if parser is None:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(REASONING_PARSERS))}")
    return parser


@dataclass(frozen=True)
class ReasoningMarkers:
    """A parser with its markers' token ids in one tokenizer."""

    parser: ReasoningParser
    start_id: int
    end_id: int

    @classmethod
    def of(cls, parser: ReasoningParser, tokenizer: object) -> ReasoningMarkers:
        """Raises ValueError unless both markers are single tokens of ``tokenizer`` (a HF tokenizer)."""
        ids = []
        for marker in (parser.start, parser.end):
            encoded = tokenizer.encode(marker, add_special_tokens=False)  # type: ignore[attr-defined]
            if len(encoded) != 1:
                raise ValueError(
                    f"the {parser.name} reasoning parser needs {marker} as one token of the model's vocabulary"
                )
            ids.append(encoded[0])
        return cls(parser, ids[0], ids[1])

    def start_of(self, prompt_token_ids: Sequence[int], is_blank: Callable[[int], bool]) -> ReasoningStart:
        """Where the output starts, from the prompt's end: after an open start marker it thinks (a
        template that opens the thinking), after an end marker it answers (a template that closes
        it: Qwen3's ``enable_thinking=False``); ``is_blank``: a token id is whitespace only."""
        for token in reversed(prompt_token_ids[-_TAIL_TOKENS:]):
            if token == self.start_id:
                return ReasoningStart.THINKING
            if token == self.end_id:
                return ReasoningStart.ANSWER
            if not is_blank(token):
                break
        return ReasoningStart.THINKING if self.parser.implicit_start else ReasoningStart.OPTIONAL


def blank_token_test(tokenizer: object) -> Callable[[int], bool]:
    """``is_blank`` for ``ReasoningMarkers.start_of``: the token decodes to whitespace only."""

    def is_blank(token_id: int) -> bool:
        text = tokenizer.decode([token_id])  # type: ignore[attr-defined]
        return bool(text) and text.isspace()

    return is_blank
