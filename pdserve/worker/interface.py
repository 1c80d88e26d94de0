"""What crosses between the EngineCore and a worker each step: the scheduler's work order in,
the sampled tokens out.

The worker sits below the engine (imports point down), so it reads requests through the small
read-only protocols here rather than the engine's Request and SamplingParams classes, which
satisfy them. Plain slotted data classes, built once per step; lists are parallel (index i is the
i-th scheduled request) so the hot loops touch no per-request wrapper objects.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

from pdserve.kvtransfer.base import KVConnectorOutput

# A runner's "sampled token" for a request whose scheduled chunk did not reach the end of its
# known tokens (a partial prefill chunk): nothing was sampled.
NO_TOKEN = -1


class SamplingOptions(Protocol):
    """The sampling settings a worker reads (pdserve.engine.sampling_params.SamplingParams)."""

    @property
    def temperature(self) -> float: ...
    @property
    def top_p(self) -> float: ...
    @property
    def top_k(self) -> int: ...
    @property
    def min_p(self) -> float: ...
    @property
    def seed(self) -> int | None: ...
    @property
    def presence_penalty(self) -> float: ...
    @property
    def frequency_penalty(self) -> float: ...
    @property
    def repetition_penalty(self) -> float: ...
    @property
    def logprobs(self) -> int | None: ...
    @property
    def prompt_logprobs(self) -> int | None: ...
    @property
    def is_greedy(self) -> bool: ...


class ScheduledRequest(Protocol):
    """The request state a worker reads (pdserve.engine.request.Request); it never writes it."""

    @property
    def request_id(self) -> str: ...
    @property
    def prompt_token_ids(self) -> list[int]: ...
    @property
    def output_token_ids(self) -> list[int]: ...
    @property
    def all_token_ids(self) -> list[int]: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def sampling_params(self) -> SamplingOptions: ...


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


class StepGrammar:
    """A step's structured-output constraint: the scheduled requests (``rows``, indices into the
    step's requests, ascending) whose sampled token a grammar constrains, and their packed token
    bitmask (int32 ``[len(rows), ceil(vocab / 32)]``, bit t of a row set where token t is allowed).

    The bitmask is filled while the forward runs, so it comes apart from the step: the core calls
    :meth:`set_bitmask` (a pipelined executor forwards it through ``on_bitmask``), the runner takes
    it with :meth:`bitmask` just before sampling, waiting if it must. A worker in another process
    builds its copy with ``fetch``: the function that reads the bitmask the core sent after the step.
    """

    __slots__ = ("_bitmask", "_error", "_fetch", "_ready", "on_bitmask", "rows")

    def __init__(self, rows: list[int], fetch: Callable[[], np.ndarray] | None = None) -> None:
        self.rows = rows
        self._fetch = fetch
        self._bitmask: np.ndarray | None = None
        self._error: BaseException | None = None
        self._ready = threading.Event()
        self.on_bitmask: Callable[[np.ndarray], None] | None = None

    def set_bitmask(self, bitmask: np.ndarray) -> None:
        self._bitmask = bitmask
        self._ready.set()
        if self.on_bitmask is not None:
            self.on_bitmask(bitmask)

    def set_error(self, error: BaseException) -> None:
        """Filling failed: the runner's :meth:`bitmask` raises it (the step fails, not hangs)."""
        self._error = error
        self._ready.set()

    def bitmask(self) -> np.ndarray:
        if self._bitmask is not None:
            return self._bitmask
        if self._fetch is not None:
            self._bitmask = self._fetch()
            return self._bitmask
        self._ready.wait()
        if self._error is not None:
            raise RuntimeError("the step's grammar bitmask could not be filled") from self._error
        assert self._bitmask is not None
        return self._bitmask


# The scheduler's own request class; the worker reads it as a ScheduledRequest.
RequestT = TypeVar("RequestT", bound=ScheduledRequest, covariant=True)


@dataclass(slots=True)
class SchedulerOutput(Generic[RequestT]):
    # Scheduled requests in running order, with the tokens each computes this step.
    requests: Sequence[RequestT]
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
    # The grammar constraint on this step's samples, if any request under a grammar samples.
    grammar: StepGrammar | None = None
    # Hybrid models: each request's state slot (its linear-attention layers' state). A request
    # scheduled from position 0 starts from a zeroed slot; later steps continue from the slot.
    state_slots: list[int] | None = None
    # Slots whose state this step must leave as it found them: a P/D prefill leg's last prompt token,
    # run alone so that the state it hands over is as of the token before (the decode engine
    # computes the last token again, and a linear layer's state must not see it twice).
    state_restores: list[int] | None = None


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
    # A CPU runner that follows contention: the compute threads it runs with now (None: fixed, or not a CPU).
    compute_threads: int | None = None


class ModelExecutor(Protocol):
    """What the EngineCore drives: one step of the scheduled work on the device(s)."""

    def execute_model(self, scheduler_output: SchedulerOutput[ScheduledRequest]) -> ModelRunnerOutput:
        """Compute the scheduled tokens' KV and sample one token for each request that reached
        the end of its known tokens (NO_TOKEN for a partial prompt chunk)."""
        ...

    def close(self) -> None:
        """Release the device memory and the KV connector's worker side."""
        ...


class PipelinedModelExecutor(ModelExecutor, Protocol):
    """An executor whose devices run in other processes: a step can be sent before the previous
    one's output is taken, so the core schedules while the devices compute (async scheduling)."""

    def submit(self, scheduler_output: SchedulerOutput[ScheduledRequest]) -> None:
        """Start a step; steps run in the order submitted."""
        ...

    def receive(self) -> ModelRunnerOutput:
        """The output of the oldest submitted step not yet received (blocks until it is done)."""
        ...
