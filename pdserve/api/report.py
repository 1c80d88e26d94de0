"""The request report an engine adds to its answer when the router asks for it: the request's
prompt and generated token counts and the engine's own timing. With it the router's length and
latency histograms cover every request, streams included (a stream carries a usage event only
when its client asked for one).

Asked for with the request header `REPORT_HEADER: 1`. Answered:
- on a JSON answer, as the response header `REPORT_HEADER`, its value the report as JSON;
- on a stream, as one SSE comment line before the usage event (if any) and `[DONE]`:
  `: pdserve-report {...}`. SSE clients skip comments; the router takes it out anyway.
"""

from __future__ import annotations

import msgspec

REPORT_HEADER = "X-PDServe-Report"
# Bounds of the latency histograms (TTFT, TPOT, end to end) on routers and engines, in seconds.
LATENCY_BUCKETS = tuple(
    [0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
    + [120.0, 300.0, 600.0]
)
# Bounds of the request-length histograms (`pdserve_request_prompt_tokens`, `..._generation_tokens`)
# on routers and engines: 1.25-1.5x apart from 1 to a million tokens, so that a length read back
# from them (uniform within its bucket) is off by at most about 20%, and a spread distribution's
# mean by much less.
TOKEN_BUCKETS = tuple(
    sorted({float(round(mantissa * 10**exponent)) for exponent in range(6) for mantissa in (1, 1.5, 2, 3, 4, 5, 6, 8)})
) + (1e6,)
REPORT_COMMENT = b": pdserve-report "


class Report(msgspec.Struct, omit_defaults=True):
    prompt_tokens: int  # each prompt once, however many choices it has
    completion_tokens: int  # all choices together
    # The engine's time from the request's arrival to its first token, and per token after it; for
    # requests of one choice only (with several, whose times would they be?).
    ttft_s: float | None = None
    tpot_s: float | None = None


def comment(report: Report) -> bytes:
    """The report as the SSE comment line a stream carries."""
    return REPORT_COMMENT + msgspec.json.encode(report) + b"\n\n"


def header_value(report: Report) -> str:
    return msgspec.json.encode(report).decode()


def from_header(value: str | None) -> Report | None:
    """The report in a JSON answer's header; None when absent or unreadable."""
    if not value:
        return None
    try:
        return msgspec.json.decode(value, type=Report)
    except msgspec.MsgspecError:
        return None


def take_comment(chunk: bytes) -> tuple[bytes, Report | None]:
    """A stream chunk without the report comment it holds, and the report (None: it holds none).

    The engine writes the comment in one write, so it arrives whole within a chunk; a comment that
    was cut across chunks is passed on untouched (harmless: clients skip comments) and not read.
    """
    start = chunk.find(REPORT_COMMENT)
    if start < 0:
        return chunk, None
    end = chunk.find(b"\n\n", start)
    if end < 0:
        return chunk, None
    try:
        report = msgspec.json.decode(chunk[start + len(REPORT_COMMENT) : end], type=Report)
    except msgspec.MsgspecError:
        return chunk, None
    return chunk[:start] + chunk[end + 2 :], report
