"""IncrementalDetokenizer: a request's output text, token by token, for streaming.

Decoding goes through the ``tokenizers`` library's DecodeStream, which holds back the bytes of a
character split across tokens instead of emitting a replacement character, and which is seeded
with the prompt's last tokens so the first output token decodes in context (leading spaces of
SentencePiece-style tokenizers). Stop strings are searched in the text as it grows; the last
``len(longest stop) - 1`` characters are withheld from the stream until they cannot be the start
of a stop string, so a stop string never reaches the client (unless asked for).
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# Prompt tokens fed to the stream before the first output token (enough context for any merge).
_PROMPT_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop: list[str],
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        context = prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]
        if tokenizer.decode(context, skip_special_tokens=skip_special_tokens).endswith("\ufffd"):
            # The prompt ends inside a character: seeded with it, the stream would emit the prompt's
            # dangling bytes with the first output token. Output text is the output's own bytes.
            context = []
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        self._skip_special_tokens = skip_special_tokens
        self._token_ids: list[int] = []
        self._stop = stop
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self._include_stop = include_stop_str_in_output
        self.text = ""  # all text decoded so far (cut at a stop string once one is found)
        self._emitted = 0  # how much of it has been handed out
        self.stop_string: str | None = None

    def add_tokens(self, token_ids: list[int]) -> str:
        """Decode new tokens; return the text that may be streamed now. Once a stop string has
        matched, ``stop_string`` is set, the text is cut there, and later tokens are ignored."""
        if self.stop_string is not None:
            return ""
        self._token_ids.extend(token_ids)
        for token_id in token_ids:
            piece = self._stream.step(self._tokenizer, token_id)
            if not piece:
                continue
            search_from = max(0, len(self.text) - self._holdback)
            self.text += piece
            if self._stop and self._find_stop(search_from):
                return self._take(len(self.text))
        return self._take(len(self.text) - self._holdback)

    def finish(self) -> str:
        """The withheld tail, once the request has finished. Bytes of a character the output cut
        in half are flushed as U+FFFD, as decoding the whole output at once renders them."""
        if self.stop_string is None:
            whole = self._tokenizer.decode(self._token_ids, skip_special_tokens=self._skip_special_tokens)
            if len(whole) > len(self.text) and whole.startswith(self.text):
                self.text = whole
        return self._take(len(self.text))

    def _find_stop(self, search_from: int) -> bool:
        found = [(self.text.find(stop, search_from), stop) for stop in self._stop]
        found = [(position, stop) for position, stop in found if position >= 0]
        if not found:
            return False
        position, stop = min(found)
        self.stop_string = stop
        self.text = self.text[: position + len(stop) if self._include_stop else position]
        return True

    def _take(self, end: int) -> str:
        if end <= self._emitted:
            return ""
        new_text = self.text[self._emitted : end]
        self._emitted = end
        return new_text
