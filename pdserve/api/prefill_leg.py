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

# Request fields that could end the leg before its one token by length: neither side lets them through.
ENDING_FIELDS = ("stop", "stop_token_ids", "min_tokens")
# Request fields of answers the leg does not give (a stream, several choices): the router leaves them out
# (the engine refuses a streamed leg, and a leg of several choices, with a 400).
ANSWER_FIELDS = ("stream_options", "n")
ROUTER_DROPPED = frozenset((*ENDING_FIELDS, *ANSWER_FIELDS))
# What marks a request as a prefill leg.
REMOTE_DECODE = {"do_remote_decode": True}


def leg_body(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """The body of the prefill leg of a request whose body is ``body`` (fields unknown here pass unchanged)."""
    leg = {name: value for name, value in body.items() if name not in ROUTER_DROPPED}
    leg["max_tokens"] = 1
    if chat:
        leg["max_completion_tokens"] = 1
    leg["stream"] = False
    leg["kv_transfer_params"] = REMOTE_DECODE
    return leg


def leg_sampling(fields: dict[str, Any]) -> dict[str, Any]:
    """A prefill leg's sampling parameters (``SamplingParams`` keyword arguments) from those its request asked
    for: one token, ending by length whatever it is."""
    leg = {name: value for name, value in fields.items() if name not in ENDING_FIELDS}
    leg["ignore_eos"] = True
    leg["max_tokens"] = 1
    return leg
