"""Tokenizer loading and chat templates, one definition for every component that tokenizes.

Uses transformers' AutoTokenizer (tokenizer files only; no model code) so a model folder's own
tokenizer and chat template are honoured exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(path))


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of a completions prompt given as text (special tokens as the tokenizer adds them)."""
    return tokenizer.encode(text)


# Arguments of the rendering itself: a client's chat_template_kwargs may only add template variables.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tokenize",
        "add_generation_prompt",
        "chat_template",
        "return_dict",
        "return_tensors",
        "tokenizer_kwargs",
        "padding",
        "truncation",
        "max_length",
        "continue_final_message",
    }
)


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
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS.intersection(template_kwargs))
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}")
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
        )
    except (TemplateError, TypeError) as error:  # the template raised, or a variable has the wrong type
        raise ValueError(f"the chat template could not be rendered: {error}") from error
    # The template already wrote any special tokens it wants (BOS included).
    return tokenizer.encode(text, add_special_tokens=False)
