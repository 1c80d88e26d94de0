"""SamplingParams: how one request samples and when it stops, validated on construction.

Field names and defaults follow vLLM's ``SamplingParams`` so user code ports over unchanged.
Bad values raise :class:`SamplingParamsError` naming the offending field; the HTTP layer turns
that into an OpenAI-style 400 with ``param`` set.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

# Below this temperature sampling is greedy (vLLM's threshold): dividing logits by a tiny
# temperature would overflow long before it changed the argmax.
GREEDY_TEMPERATURE_EPS = 1e-5


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range or of the wrong type."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


_INT32 = 1 << 31
_INT64 = 1 << 63


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass
class StructuredOutputsParams:
    """The constraint on a request's output (vLLM's ``StructuredOutputsParams``): exactly one of a
    JSON schema, any JSON object, a regex, a list of choices or an EBNF grammar (xgrammar's dialect).

    ``disable_any_whitespace``: JSON without free whitespace between tokens (None: the engine's
    default, which is to disable it: a model trained on compact JSON can otherwise wander into
    endless whitespace).
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise SamplingParamsError(
                "structured_outputs",
                f"exactly one of json, regex, choice, grammar or json_object must be given, got {given or 'none'}",
            )
        kind = given[0]
        value = getattr(self, kind)
        checks = {
            "json": isinstance(value, str | dict),
            "regex": isinstance(value, str),
            "grammar": isinstance(value, str),
            "choice": isinstance(value, list) and bool(value) and all(isinstance(c, str) for c in value),
            "json_object": value is True,
        }
        if not checks[kind]:
            raise SamplingParamsError(f"structured_outputs.{kind}", f"has the wrong type: {type(value).__name__}")
        if self.disable_any_whitespace is not None and not isinstance(self.disable_any_whitespace, bool):
            raise SamplingParamsError("structured_outputs.disable_any_whitespace", "must be a boolean")
        if isinstance(self.json, dict):
            # Carried as text: a schema is arbitrary JSON, integers of any size among it, which the msgpack
            # channel to the engine core cannot carry as values (beyond 64 bits it raised: an HTTP 500).
            self.json = json.dumps(self.json)

    @property
    def kind(self) -> str:
        """Which constraint: json, regex, choice, grammar or json_object."""
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"


@dataclass
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    logprobs: int | None = None  # number of top alternatives per sampled token
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.top_k == -1:
            self.top_k = 0
        self._validate()
        # A frozenset makes the per-token stop check O(1) in the scheduler's hot loop.
        self.stop_token_id_set = frozenset(self.stop_token_ids)

    def _validate(self) -> None:
        def require(ok: bool, param: str, message: str) -> None:
            if not ok:
                raise SamplingParamsError(param, f"{message}, got {getattr(self, param)!r}")

        # Integers cross to the core as msgpack (64-bit) and into torch tensors: bound them there.
        require(_is_int(self.n) and 1 <= self.n < _INT32, "n", "must be an integer >= 1")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            require(_is_number(value) and -2.0 <= value <= 2.0, name, "must be a number in [-2, 2]")
        require(
            _is_number(self.repetition_penalty) and self.repetition_penalty > 0,
            "repetition_penalty",
            "must be a number > 0",
        )
        require(_is_number(self.temperature) and self.temperature >= 0, "temperature", "must be a number >= 0")
        require(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be a number in (0, 1]")
        require(
            _is_int(self.top_k) and 0 <= self.top_k < _INT32,
            "top_k",
            "must be -1 or 0 (disabled) or a positive integer below 2^31",
        )
        require(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be a number in [0, 1]")
        require(
            self.seed is None or (_is_int(self.seed) and -_INT64 <= self.seed < _INT64),
            "seed",
            "must be a 64-bit signed integer or None",
        )
        require(
            isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop),
            "stop",
            "must be a non-empty string or a list of non-empty strings",
        )
        require(
            isinstance(self.stop_token_ids, list) and all(_is_int(t) and 0 <= t < _INT32 for t in self.stop_token_ids),
            "stop_token_ids",
            "must be a list of non-negative token ids",
        )
        require(
            self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
            "max_tokens",
            "must be an integer >= 1 or None",
        )
        require(_is_int(self.min_tokens) and 0 <= self.min_tokens < _INT32, "min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamsError("min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            require(value is None or (_is_int(value) and value >= 0), name, "must be an integer >= 0 or None")
        for name in (
            "ignore_eos",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "include_stop_str_in_output",
        ):
            require(isinstance(getattr(self, name), bool), name, "must be a boolean")
        require(
            self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
            "structured_outputs",
            "must be a StructuredOutputsParams",
        )

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS
