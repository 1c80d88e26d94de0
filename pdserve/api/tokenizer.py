"""Tokenizer loading and chat templates, one definition for every component that tokenizes.

Uses transformers' AutoTokenizer (tokenizer files only; no model code) so a model folder's own
tokenizer and chat template are honoured exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

from pdserve.api.protocol import RESERVED_TEMPLATE_KWARGS, TEMPLATE_LIST_KWARGS


class TemplateKwargsError(ValueError):
    """chat_template_kwargs the rendering refuses (a reserved name, a wrong type)."""


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    # Imported here: transformers imports torch (its configuration module does), which a process that only
    # reads settings or the protocol should not pay for.
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of a completions prompt given as text (special tokens as the tokenizer adds them)."""
    return tokenizer.encode(text)


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Token ids of a conversation rendered by the model's chat template, with ``template_kwargs`` as
    extra template variables; ValueError for anything the template or the variables cannot render."""
    template_kwargs = template_kwargs or {}
    if not tokenizer.chat_template:
        raise ValueError("this model's tokenizer has no chat template; send a plain prompt instead")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(template_kwargs))
    if reserved:
        raise TemplateKwargsError(f"chat_template_kwargs may not set {', '.join(reserved)}")
    for name in TEMPLATE_LIST_KWARGS:  # transformers reads these itself, and takes any iterable
        value = template_kwargs.get(name)
        if value is not None and not (isinstance(value, list) and all(isinstance(item, dict) for item in value)):
            raise TemplateKwargsError(f"chat_template_kwargs.{name} must be a list of objects")
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
        )
    except (TemplateError, TypeError) as error:  # the template raised, or a variable has the wrong type
        raise ValueError(f"the chat template could not be rendered: {error}") from error
    # The template already wrote any special tokens it wants (BOS included).
    return tokenizer.encode(text, add_special_tokens=False)
