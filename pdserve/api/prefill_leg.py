"""The prefill-leg field contract (docs/contracts.md, "Prefill-leg field contract"): how a client's request
becomes its P/D prefill leg, defined once for the two sides that apply it.

A prefill leg computes the prompt and samples one token nobody reads. It must end by length on that token:
only then does the prefill engine hold the prompt's blocks, and it must answer in one JSON body, whose
``kv_transfer_params`` name them. So the router sends the leg as ``leg_body`` makes it
(``pdserve.router.prefill_leg``), and the prefill engine runs whatever leg it gets, from this router or
another proxy, with ``leg_sampling``'s parameters (``pdserve.server.serving``).
"""

from __future__ import annotations

from typing import Any

import msgspec

# Request fields that could end the leg before its one token by length: neither side lets them through.
ENDING_FIELDS = ("stop", "stop_token_ids", "min_tokens")
# Request fields of answers the leg does not give (a stream, several choices): the router leaves them out
# (the engine refuses a streamed leg, and a leg of several choices, with a 400).
ANSWER_FIELDS = ("stream_options", "n")
ROUTER_DROPPED = frozenset((*ENDING_FIELDS, *ANSWER_FIELDS))
# What marks a request as a prefill leg.
REMOTE_DECODE = {"do_remote_decode": True}
# Behind a gateway (``pdserve epp``) the picker names the prefill pod and signs its leg; the decode engine the
# request goes to sends the leg itself, then decodes with the answer's params (``pdserve.server.gateway_prefill``).
PREFILL_VIA_HEADER = "X-PDServe-Prefill-Via"  # the prefill pod's URL
PREFILL_AUTH_HEADER = "X-PDServe-Prefill-Auth"  # the router's signature of the leg, for the prefill engine

# How long a prefill leg may take when nothing else says: a floor plus a margin over what the prompt needs at an
# assumed speed (a slow CPU engine's order), so that a hung prefill costs seconds, not the request's timeout.
PREFILL_TIMEOUT_FLOOR_S = 2.0
PREFILL_TIMEOUT_MARGIN = 4.0
ASSUMED_PREFILL_TOKENS_PER_S = 500.0


def prefill_timeout_s(prompt_tokens: int, tokens_per_s: float | None = None) -> float:
    """Seconds a prefill leg of ``prompt_tokens`` may take on a pod measured at ``tokens_per_s`` (None: the assumed
    speed)."""
    speed = tokens_per_s or ASSUMED_PREFILL_TOKENS_PER_S
    return PREFILL_TIMEOUT_FLOOR_S + PREFILL_TIMEOUT_MARGIN * prompt_tokens / speed


def leg_body(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """The body of the prefill leg of a request whose body is ``body`` (fields unknown here pass unchanged)."""
    leg = {name: value for name, value in body.items() if name not in ROUTER_DROPPED}
    leg["max_tokens"] = 1
    if chat:
        leg["max_completion_tokens"] = 1
    leg["stream"] = False
    leg["kv_transfer_params"] = REMOTE_DECODE
    return leg


def encoded_leg(raw: bytes, chat: bool) -> bytes:
    """The bytes of the prefill leg of a request whose body is ``raw``. The picker signs them and the decode engine
    sends them: computed by this one function from the same body, they are the same bytes on both sides.
    ValueError when ``raw`` is not a JSON object."""
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as error:
        raise ValueError(f"the body is not JSON: {error}") from None
    if not isinstance(body, dict):
        raise ValueError("the body is not a JSON object")
    return msgspec.json.encode(leg_body(body, chat))


def leg_sampling(fields: dict[str, Any]) -> dict[str, Any]:
    """A prefill leg's sampling parameters (``SamplingParams`` keyword arguments) from those its request asked
    for: one token, ending by length whatever it is."""
    leg = {name: value for name, value in fields.items() if name not in ENDING_FIELDS}
    leg["ignore_eos"] = True
    leg["max_tokens"] = 1
    return leg
