"""Tokenizer loading and chat templates, one definition for every component that tokenizes.

Uses transformers' AutoTokenizer (tokenizer files only; no model code) so a model folder's own
tokenizer and chat template are honoured exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(path))


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of a completions prompt given as text (special tokens as the tokenizer adds them)."""
    return tokenizer.encode(text)


def apply_chat_template(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]],
                        add_generation_prompt: bool = True, **template_kwargs: Any) -> list[int]:
    """Token ids of a conversation rendered by the model's chat template."""
    if not tokenizer.chat_template:
        raise ValueError("this model's tokenizer has no chat template; send a plain prompt instead")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **template_kwargs)
    # The template already wrote any special tokens it wants (BOS included).
    return tokenizer.encode(text, add_special_tokens=False)
