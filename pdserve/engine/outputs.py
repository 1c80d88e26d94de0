"""The data passed around one engine step: scheduler → model runner → scheduler → caller.

Plain slotted data classes, built once per step; lists are parallel (index i is the i-th
scheduled request) so the hot loops touch no per-request wrapper objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.request import Request
from pdserve.kvtransfer.base import KVConnectorOutput

# A runner's "sampled token" for a request whose scheduled chunk did not reach the end of its
# known tokens (a partial prefill chunk): nothing was sampled.
NO_TOKEN = -1


@dataclass(slots=True)
class TokenLogprobs:
    """One position's logprobs: the chosen (sampled, or next prompt) token and the top-n alternatives.

    Logprobs are of the model's raw distribution (log-softmax of the logits, before penalties,
    temperature or top-k/top-p), as vLLM reports them by default.
    """

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True)
class SchedulerOutput:
    # Scheduled requests in running order, with the tokens each computes this step.
    requests: list[Request]
    num_scheduled_tokens: list[int]
    # Position of each request's first scheduled token (its num_computed_tokens before this step).
    start_positions: list[int]
    # Each request's block table. These are the KV-cache manager's live lists, passed without a
    # copy: read them during this step only, never modify them.
    block_ids: list[list[int]]
    total_num_scheduled_tokens: int
    # Requests whose blocks were released since the previous step: a runner drops any state it
    # keeps for them (preempted ones come back later as new, from position 0).
    preempted_req_ids: set[str] = field(default_factory=set)
    finished_req_ids: set[str] = field(default_factory=set)
    # Opaque work order for the worker side of the KV connector (loads to start, ...).
    kv_connector_metadata: Any = None


@dataclass(slots=True)
class ModelRunnerOutput:
    # One per scheduled request, parallel to SchedulerOutput.requests; NO_TOKEN where nothing was sampled.
    sampled_token_ids: list[int]
    kv_connector_output: KVConnectorOutput | None = None
    # Parallel to sampled_token_ids when any request asked for logprobs (None entries elsewhere).
    logprobs: list[TokenLogprobs | None] | None = None
    # request id -> (first prompt position covered, entries): entry i is the logprob of prompt
    # token (position + i + 1) given the tokens before it.
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] | None = None


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
