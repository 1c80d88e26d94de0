"""What the EngineCore hands its caller each step: one ``EngineCoreOutput`` per request that
produced something (new tokens, a finish), as sent to the API process."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.worker.interface import TokenLogprobs

__all__ = ["EngineCoreOutput", "TokenLogprobs"]


@dataclass(slots=True)
class EngineCoreOutput:
    """What one request produced in one step, as sent to the API process."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" once finished
    stop_reason: int | str | None = None  # the stop token id that ended it, if one did
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (set when finished)
    kv_transfer_params: dict[str, Any] | None = None  # what a prefill hands to its decode
    new_logprobs: list[TokenLogprobs] | None = None  # one per new token, when asked for
    # With the first output token: one entry per prompt token after the first.
    prompt_logprobs: list[TokenLogprobs] | None = None
    # With finish_reason "error": the HTTP status its caller gets (None: 503, the engine failed it;
    # 400: its input could not be served, e.g. a grammar that did not compile).
    error_status: int | None = None
