"""Reading a server's /metrics (Prometheus text) in tests and benchmarks: ``scrape(url)`` gives
{series: value}, a series written as the text writes it (``name`` or ``name{label="value",...}``);
``metric`` reads one sample by name and labels; ``idle`` says whether an engine runs, waits for or holds nothing."""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Mapping

# A sample line: the series (a name, maybe labels: values may hold "}" and spaces, so up to the last "}"), a
# value, maybe a timestamp.
_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*(?:\{.*\})?)\s+(\S+)(?:\s+-?\d+)?$")


# An engine is idle when all of these are 0: nothing runs, nothing waits (for the scheduler or for remote KV), no
# blocks are held for remote decodes or quarantined, none is owned by a request, nor any state slot.
IDLE_SERIES = (
    "pdserve_num_requests_running",
    "pdserve_num_requests_waiting",
    "pdserve_num_requests_waiting_for_remote_kv",
    "pdserve_kv_blocks_held_for_remote",
    "pdserve_kv_blocks_quarantined",
    "pdserve_kv_cache_usage_ratio",
    "pdserve_state_slots_used",
)


# Router error kinds (pdserve_router_errors_total{kind}) that mean a leg failed. The router hides them
# from the client (a failed prefill leg falls back to decode-only), so per-answer checks cannot see them;
# client disconnects, retries of an overloaded pod and request timeouts are not among them.
ROUTER_LEG_FAILURES = (
    "prefill_unreachable",
    "prefill_5xx",
    "prefill_bad_answer",
    "prefill_timeout",
    "no_prefill",
    "decode_unreachable",
    "no_decode",
    "decode_broken",
    "decode_hung",
)


def parse(text: str) -> dict[str, float]:
    """Prometheus text as {series (with labels): value}; comments and lines that are no sample are skipped."""
    values = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            values[match.group(1)] = float(match.group(2))
    return values


def scrape(url: str, timeout: float = 10.0) -> dict[str, float]:
    """The /metrics of the server at ``url`` (scheme, host and port), parsed."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=timeout) as response:
        return parse(response.read().decode())


def series(name: str, **labels: str) -> str:
    """The series as Prometheus clients write it: labels sorted by name, values escaped."""
    if not labels:
        return name
    text = ",".join(f'{key}="{_escape(str(labels[key]))}"' for key in sorted(labels))
    return f"{name}{{{text}}}"


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def metric(source: str | Mapping[str, float], name: str, **labels: str) -> float:
    """One sample's value (0 when absent) from Prometheus text or from what ``parse`` made of it; the labels
    in any order."""
    values = parse(source) if isinstance(source, str) else source
    return values.get(series(name, **labels), 0.0)


def idle(values: Mapping[str, float]) -> bool:
    """Whether an engine's metrics (from ``scrape``) say it is idle (``IDLE_SERIES``; absent counts as 0)."""
    return all(values.get(name, 0) == 0 for name in IDLE_SERIES)
