"""A chat answer's text split into thinking (``reasoning_content``) and answer (``content``), streamed
or all at once with the same result, by the reasoning parser the engine runs with
(``pdserve.engine.reasoning``: where the thinking starts, from the prompt's end, as the engine core
decides it).
"""

from __future__ import annotations

from pdserve.engine.reasoning import ReasoningParser, ReasoningStart


def held_marker_prefix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker`` (the marker, cut by the stream)."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


class ReasoningStream:
    def __init__(self, parser: ReasoningParser, start: ReasoningStart) -> None:
        self.parser = parser
        self.state = start
        self._held = ""  # text that may be the start of a marker
        self._first = True  # nothing read yet: an opening start marker is dropped

    def feed(self, text: str) -> tuple[str, str]:
        """(thinking, answer) that ``text`` adds."""
        return self._read(self._held + text, final=False)

    def finish(self) -> tuple[str, str]:
        return self._read(self._held, final=True)

    def _read(self, text: str, final: bool) -> tuple[str, str]:
        self._held = ""
        start, end = self.parser.start, self.parser.end
        if self._first and self.state is not ReasoningStart.ANSWER:
            if start.startswith(text) and not final:  # too short to tell
                self._held = text
                return "", ""
            self._first = False
            if text.startswith(start):
                text = text[len(start) :]
                self.state = ReasoningStart.THINKING
            elif self.state is ReasoningStart.OPTIONAL:
                self.state = ReasoningStart.ANSWER
        if self.state is ReasoningStart.ANSWER:
            return "", text
        at = text.find(end)
        if at >= 0:
            self.state = ReasoningStart.ANSWER
            return text[:at], text[at + len(end) :]
        keep = 0 if final else held_marker_prefix(text, end)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep], ""
