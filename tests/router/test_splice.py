"""StreamSplice: a stream cut anywhere by TCP reaches the client as whole events, router-only comments taken out;
a choice's tokens count once their data event passed; a failed engine's error event is held back."""

from __future__ import annotations

import json
import random

import pytest

from pdserve.api.continuation import StreamTokens, tokens_comment
from pdserve.api.protocol import SSE_DONE
from pdserve.api.report import Report, comment
from pdserve.router.splice import StreamSplice


def _data(index: int, text: str, finish: str | None = None) -> bytes:
    chunk = {"id": "cmpl-7", "created": 42, "choices": [{"index": index, "text": text, "finish_reason": finish}]}
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def _stream() -> tuple[bytes, bytes]:
    """An engine's stream with token comments and a report, and what the client must get of it."""
    engine, client = [], []
    for step in range(6):
        for index in (0, 1):
            finish = "length" if step == 5 else None
            event = _data(index, f"<{index}.{step}>", finish)
            engine.append(tokens_comment(StreamTokens(index, [100 * index + step], finish)) + event)
            client.append(event)
    engine.append(comment(Report(5, 12)))
    engine.append(SSE_DONE)
    client.append(SSE_DONE)
    return b"".join(engine), b"".join(client)


def _cut(data: bytes, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    points = sorted(rng.sample(range(1, len(data)), 40))
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]


@pytest.mark.parametrize("seed", range(5))
def test_any_cut_gives_the_client_the_events_without_the_comments(seed):
    engine, client = _stream()
    splice = StreamSplice()
    out = b"".join(splice.feed(chunk) for chunk in _cut(engine, seed))
    assert out == client
    assert splice.done and splice.report == Report(5, 12)
    assert (splice.id, splice.created) == ("cmpl-7", 42)
    continuation = splice.continuation()
    assert continuation is not None
    assert [(c.index, c.token_ids, c.finish_reason) for c in continuation.choices] == [
        (0, [0, 1, 2, 3, 4, 5], "length"),
        (1, [100, 101, 102, 103, 104, 105], "length"),
    ]


def test_tokens_whose_event_did_not_come_whole_do_not_count():
    engine, _ = _stream()
    splice = StreamSplice()
    first_event_end = engine.index(b"\n\n", engine.index(b"data: ")) + 2
    # The first event, then the second's comment and half its data: the break.
    second_data = engine.index(b"data: ", first_event_end)
    out = splice.feed(engine[: second_data + 10])
    assert out == _data(0, "<0.0>")
    continuation = splice.continuation()
    assert continuation is not None and [(c.index, c.token_ids) for c in continuation.choices] == [(0, [0])]
    splice.start_leg()  # the continuation's bytes come next: the half event is gone
    assert splice.feed(_data(1, "<1.0>")) == _data(1, "<1.0>")


def test_a_stream_without_an_event_cannot_be_continued():
    splice = StreamSplice()
    assert splice.feed(b'data: {"id": "cm') == b""
    assert splice.continuation() is None


def test_a_server_error_event_is_held_back_and_a_client_error_passes():
    server_error = b'data: {"error": {"message": "engine died", "type": "service_unavailable", "code": 503}}\n\n'
    splice = StreamSplice()
    assert splice.feed(_data(0, "a") + server_error + SSE_DONE) == _data(0, "a")
    assert splice.failed_engine and not splice.done
    client_error = b'data: {"error": {"message": "bad", "type": "invalid_request_error", "code": 400}}\n\n'
    splice = StreamSplice()
    assert splice.feed(client_error + SSE_DONE) == client_error + SSE_DONE
    assert not splice.failed_engine and splice.done


def test_a_handoff_ends_the_leg_and_the_next_leg_starts_clean():
    splice = StreamSplice()
    handoff = b": pdserve-handoff\n\n"
    assert splice.feed(_data(0, "a") + handoff) == _data(0, "a")
    assert splice.handed_off
    splice.start_leg()
    assert not splice.handed_off and not splice.failed_engine
    assert splice.feed(_data(0, "b") + SSE_DONE) == _data(0, "b") + SSE_DONE
    assert splice.done


def test_a_long_stream_counts_every_token_and_an_unreadable_comment_none():
    """Token comments are read in batches (READ_BATCH): across batches every passed token counts, in order; an
    unreadable comment counts nowhere and leaves the rest of its batch read."""
    splice = StreamSplice()
    out = []
    for step in range(150):
        comment_line = tokens_comment(StreamTokens(0, [step]))
        if step == 70:
            comment_line = b": pdserve-tokens [0, [oops\n\n"
        out.append(splice.feed(comment_line + _data(0, f"<{step}>")))
    assert b"".join(out) == b"".join(_data(0, f"<{step}>") for step in range(150))
    continuation = splice.continuation()
    assert continuation is not None
    assert continuation.choices[0].token_ids == [step for step in range(150) if step != 70]
