"""InputProcessor: what a caller sends (prompts in every accepted form, sampling settings) turned
into what the core takes (token ids, one SamplingParams per choice), checked before anything is
queued. One definition for the HTTP server and the offline ``LLM``, so both accept and refuse
exactly the same inputs.

Every refusal is a ``ValueError`` naming the field: ``InputError`` for prompts and lengths,
``SamplingParamsError`` for sampling settings. The HTTP layer answers both with a 400.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.api.protocol import ResponseFormat, StructuredOutputs
from pdserve.api.tokenizer import TemplateKwargsError, apply_chat_template, encode_prompt
from pdserve.engine.grammar import check_grammar, grammar_spec
from pdserve.engine.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputsParams

MAX_LOGPROBS = 20

# A prompt: text, token ids, or {"prompt_token_ids": [...]} / {"prompt": "..."} (vLLM's forms).
PromptInput = str | list[int] | dict[str, Any]


class InputError(ValueError):
    """A prompt or length the engine cannot take; ``param`` names the request field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class Prompt:
    token_ids: list[int]
    text: str | None = None  # as given, when it was given as text


class InputProcessor:
    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        max_model_len: int,
        eos_token_ids: Sequence[int],
        max_logprobs: int = MAX_LOGPROBS,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_logprobs = max_logprobs
        # The first end-of-sequence id is the request's EOS; every other one is a stop token too.
        self.eos_token_id = eos_token_ids[0] if eos_token_ids else None
        self.extra_eos_ids = list(eos_token_ids[1:])

    # ----- prompts ------------------------------------------------------------------------------

    def prompts(self, prompts: PromptInput | Sequence[Any], param: str = "prompt") -> list[Prompt]:
        """One prompt or a list of them, each checked; ``[1, 2]`` is one prompt, ``[[1, 2], [3]]`` two."""
        single = isinstance(prompts, str | dict) or (
            isinstance(prompts, list) and bool(prompts) and all(_is_token_id(t) for t in prompts)
        )
        items = [prompts] if single else list(prompts)
        if not items:
            raise InputError(param, "no prompts given")
        result = [self._prompt(item, param) for item in items]
        for prompt in result:
            self.check_prompt(prompt.token_ids, param)
        return result

    def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> Prompt:
        """A conversation rendered by the model's chat template, checked like any prompt."""
        if not messages:
            raise InputError("messages", "messages must not be empty")
        try:
            token_ids = apply_chat_template(self.tokenizer, messages, add_generation_prompt, chat_template_kwargs)
        except TemplateKwargsError as error:
            raise InputError("chat_template_kwargs", str(error)) from error
        except ValueError as error:
            raise InputError("messages", str(error)) from error
        self.check_prompt(token_ids, "messages")
        return Prompt(token_ids)

    def _prompt(self, item: Any, param: str) -> Prompt:
        if isinstance(item, str):
            return Prompt(encode_prompt(self.tokenizer, item), item)
        if isinstance(item, dict) and "prompt_token_ids" in item:
            token_ids = item["prompt_token_ids"]
            if isinstance(token_ids, list) and all(_is_token_id(t) for t in token_ids):
                return Prompt(list(token_ids), item.get("prompt"))
        elif isinstance(item, dict) and isinstance(item.get("prompt"), str):
            return Prompt(encode_prompt(self.tokenizer, item["prompt"]), item["prompt"])
        elif isinstance(item, list) and all(_is_token_id(t) for t in item):
            return Prompt(list(item))
        raise InputError(
            param,
            f"a prompt is a string, a list of token ids or a dict with prompt_token_ids; got {type(item).__name__}",
        )

    def check_prompt(self, token_ids: list[int], param: str = "prompt") -> None:
        if not token_ids:
            raise InputError(param, "a prompt is empty")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InputError(param, f"prompt token ids out of the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        if len(token_ids) >= self.max_model_len:
            raise InputError(
                param,
                f"the prompt has {len(token_ids)} tokens, but the context length is "
                f"{self.max_model_len}: at most {self.max_model_len - 1} prompt tokens leave "
                "room for output",
            )

    def check_max_tokens(self, prompt: list[int], max_tokens: int | None, param: str = "max_tokens") -> None:
        """The HTTP API refuses a max_tokens the context cannot hold (the offline API caps it instead)."""
        if max_tokens is not None and len(prompt) + max_tokens > self.max_model_len:
            raise InputError(
                param,
                f"{param} ({max_tokens}) plus the prompt's {len(prompt)} tokens exceed "
                f"the context length {self.max_model_len}",
            )

    # ----- sampling -----------------------------------------------------------------------------

    def check_params(self, params: SamplingParams) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.max_logprobs:
                raise SamplingParamsError(name, f"at most {self.max_logprobs} are allowed, got {value}")
        if params.structured_outputs is not None:
            check_grammar(grammar_spec(params.structured_outputs))

    def choice_params(self, params: SamplingParams) -> list[SamplingParams]:
        """One SamplingParams per choice (``n`` of them), all built before any is queued.

        Each choice of a seeded request gets its own seed (wrapped to stay a signed 64-bit
        integer), and every end-of-sequence id of the model stops generation, not only the first.
        """
        self.check_params(params)
        base = params
        if self.extra_eos_ids and not params.ignore_eos:
            base = dataclasses.replace(params, stop_token_ids=params.stop_token_ids + self.extra_eos_ids)
        if params.n == 1 or params.seed is None:
            return [base] * params.n
        return [dataclasses.replace(base, seed=_wrap_int64(params.seed + choice)) for choice in range(params.n)]


def structured_outputs_from(
    response_format: ResponseFormat | None, structured_outputs: StructuredOutputs | None
) -> tuple[StructuredOutputsParams | None, str]:
    """The constraint an HTTP request asks for, from OpenAI's ``response_format`` or vLLM's
    ``structured_outputs`` (not both), and the field that names it in errors."""
    wants_format = response_format is not None and response_format.type != "text"
    if wants_format and structured_outputs is not None:
        raise InputError("response_format", "give response_format or structured_outputs, not both")
    if structured_outputs is not None:
        fields = {name: getattr(structured_outputs, name) for name in structured_outputs.__struct_fields__}
        return StructuredOutputsParams(**fields), "structured_outputs"
    if not wants_format:
        return None, ""
    assert response_format is not None
    if response_format.type == "json_object":
        return StructuredOutputsParams(json_object=True), "response_format"
    if response_format.json_schema is None:
        raise InputError("response_format.json_schema", "a json_schema response format needs its json_schema")
    schema = response_format.json_schema.schema
    if schema is None:
        return StructuredOutputsParams(json_object=True), "response_format.json_schema"
    return StructuredOutputsParams(json=schema), "response_format.json_schema.schema"


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _wrap_int64(value: int) -> int:
    return (value + (1 << 63)) % (1 << 64) - (1 << 63)
