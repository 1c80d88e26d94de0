"""Incremental detokenization: multi-byte characters split across tokens, stop strings that never
leak to the stream, and agreement with decoding everything at once."""

from __future__ import annotations

import pytest

from pdserve.api.tokenizer import load_tokenizer
from pdserve.models.demo import ensure_demo_model
from pdserve.server.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ensure_demo_model())


def _stream(tokenizer, text, stop=(), include=False, step=1):
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(
        tokenizer.backend_tokenizer, [1, 2, 3], list(stop), include_stop_str_in_output=include
    )
    pieces = [detok.add_tokens(ids[i : i + step]) for i in range(0, len(ids), step)]
    pieces.append(detok.finish())
    return pieces, detok


@pytest.mark.parametrize("step", [1, 3])
def test_streamed_text_equals_full_decode_even_across_multibyte_characters(tokenizer, step):
    text = "héllo 😀 wörld, 你好 — the end"
    pieces, detok = _stream(tokenizer, text, step=step)
    assert "".join(pieces) == tokenizer.decode(tokenizer.encode(text)) == detok.text
    assert all("\ufffd" not in piece for piece in pieces)


def test_stop_string_is_cut_and_never_streamed(tokenizer):
    pieces, detok = _stream(tokenizer, "one two STOP three four", stop=["STOP", "zzz"])
    assert "".join(pieces) == "one two "
    assert detok.stop_string == "STOP"
    assert all("S" not in piece for piece in pieces)  # not even a prefix of it leaked
    kept, _ = _stream(tokenizer, "one two STOP three", stop=["STOP"], include=True)
    assert "".join(kept) == "one two STOP"


def test_tokens_after_a_stop_are_ignored(tokenizer):
    detok = IncrementalDetokenizer(tokenizer.backend_tokenizer, [], ["b"])
    assert detok.add_tokens(tokenizer.encode("a b c")) == "a "
    assert detok.add_tokens(tokenizer.encode(" more")) == ""
    assert detok.finish() == "" and detok.text == "a "


def test_a_character_cut_by_the_end_of_output_is_flushed_like_a_full_decode(tokenizer):
    ids = tokenizer.encode("ok 😀")
    detok = IncrementalDetokenizer(tokenizer.backend_tokenizer, [], [])
    streamed = detok.add_tokens(ids[:-1])  # the emoji's last byte never comes
    streamed += detok.finish()
    assert streamed == tokenizer.decode(ids[:-1]) and streamed.endswith("\ufffd")


def test_a_prompt_ending_inside_a_character_adds_nothing_to_the_output():
    tokenizer = load_tokenizer(str(ensure_demo_model())).backend_tokenizer
    euro = tokenizer.encode("€", add_special_tokens=False).ids  # three bytes: byte-level BPE may split them
    prompt = tokenizer.encode("price: ", add_special_tokens=False).ids + euro[:1]
    if not tokenizer.decode(prompt).endswith("\ufffd"):
        prompt = prompt + [tokenizer.token_to_id("Ã")]  # any lone lead byte of a two-byte character
    assert tokenizer.decode(prompt).endswith("\ufffd")
    output = tokenizer.encode(" ok", add_special_tokens=False).ids
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, [])
    text = detokenizer.add_tokens(output) + detokenizer.finish()
    assert text == tokenizer.decode(output)
