"""A step's work order on the wire, for a worker in another process (``multiproc``).

The core sends each step only what the worker cannot know: requests it has not seen in full
(:class:`NewRequest`), the tokens and block ids each known request gained since it was last sent,
and the step's shape. The tokens a worker samples it appends itself (``StepDecoder.sampled``), so
the core never sends them back, and a step can go out before the previous one's tokens came back
(async scheduling). The worker keeps every scheduled request's state between steps
(:class:`WorkerRequest`, read by the model runner as a ``ScheduledRequest``) and drops it when the
request finishes or is preempted (a preempted request comes back as new, from position 0), as vLLM's
cached request state does. A step whose samples a grammar constrains is followed by a
:class:`GrammarBitmask` frame, sent once the core has filled it (while the workers run the
forward). Encoded with msgspec (msgpack); the answer is the runner's own ``ModelRunnerOutput``
(rank 0), and a :class:`RankReport` from every other rank of a P/D engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from pdserve.kvtransfer.base import KVConnectorOutput
from pdserve.kvtransfer.work import TransferWork
from pdserve.worker.interface import (
    ModelRunnerOutput,
    SamplingOptions,
    ScheduledRequest,
    SchedulerOutput,
    StepGrammar,
)


class WorkerSampling(msgspec.Struct, frozen=True, array_like=True):
    """The sampling settings a worker reads (the ``SamplingOptions`` protocol), as sent."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logprobs: int | None
    prompt_logprobs: int | None
    greedy: bool

    @property
    def is_greedy(self) -> bool:
        return self.greedy

    @classmethod
    def of(cls, params: SamplingOptions) -> WorkerSampling:
        return cls(
            params.temperature,
            params.top_p,
            params.top_k,
            params.min_p,
            params.seed,
            params.presence_penalty,
            params.frequency_penalty,
            params.repetition_penalty,
            params.logprobs,
            params.prompt_logprobs,
            params.is_greedy,
        )


class NewRequest(msgspec.Struct, array_like=True):
    request_id: str
    token_ids: list[int]  # prompt, then every output token so far
    num_prompt_tokens: int
    sampling: WorkerSampling


class Step(msgspec.Struct, array_like=True, tag="step"):
    new_requests: list[NewRequest]
    # Parallel to the scheduled requests, in running order.
    request_ids: list[str]
    new_token_ids: list[list[int]]  # tokens each gained since last sent (empty for a new request)
    new_block_ids: list[list[int]]  # block ids appended to its table since last sent (all, for a new one)
    num_scheduled_tokens: list[int]
    start_positions: list[int]
    total_num_scheduled_tokens: int
    preempted_req_ids: list[str]
    finished_req_ids: list[str]
    kv_connector_metadata: TransferWork | None = None
    grammar_rows: list[int] | None = None  # a GrammarBitmask frame for these rows follows
    state_slots: list[int] | None = None  # hybrid models: each scheduled request's state slot
    state_restores: list[int] | None = None  # slots the step leaves as it found them


class GrammarBitmask(msgspec.Struct, array_like=True, tag="bitmask"):
    """The token bitmask of the step sent just before (``StepGrammar``), as int32 bytes."""

    words_per_row: int
    data: bytes


class Shutdown(msgspec.Struct, array_like=True, tag="shutdown"):
    pass


WorkerInput = Step | GrammarBitmask | Shutdown


def encode_bitmask(bitmask: np.ndarray) -> bytes:
    return msgspec.msgpack.encode(GrammarBitmask(bitmask.shape[1], np.ascontiguousarray(bitmask, np.int32).tobytes()))


class StepEncoder:
    """The core's side: turns each ``SchedulerOutput`` into a :class:`Step`, remembering per request
    how many tokens and block ids the worker has (counting the token a step samples, which the
    worker appends itself)."""

    def __init__(self) -> None:
        self._sent: dict[str, tuple[int, int]] = {}  # request id -> (tokens, block ids) the worker has
        self._encode = msgspec.msgpack.Encoder().encode

    def encode(self, output: SchedulerOutput[ScheduledRequest]) -> bytes:
        sent = self._sent
        for request_id in output.preempted_req_ids | output.finished_req_ids:
            sent.pop(request_id, None)
        new_requests: list[NewRequest] = []
        new_tokens: list[list[int]] = []
        new_blocks: list[list[int]] = []
        for request, block_ids, start, num_new in zip(
            output.requests, output.block_ids, output.start_positions, output.num_scheduled_tokens, strict=True
        ):
            request_id = request.request_id
            known = sent.get(request_id)
            num_tokens = request.num_tokens
            if known is None:
                new_requests.append(
                    NewRequest(
                        request_id,
                        list(request.all_token_ids),
                        request.num_prompt_tokens,
                        WorkerSampling.of(request.sampling_params),
                    )
                )
                new_tokens.append([])
                new_blocks.append(list(block_ids))
                num_worker_tokens = num_tokens
            else:
                # The core may be behind the worker (a sampled token not back yet); it is ahead of it
                # only by tokens it added itself, which are sent.
                num_sent_tokens, num_sent_blocks = known
                new_tokens.append(request.all_token_ids[num_sent_tokens:] if num_tokens > num_sent_tokens else [])
                new_blocks.append(block_ids[num_sent_blocks:])
                num_worker_tokens = max(num_sent_tokens, num_tokens)
            samples = start + num_new == num_worker_tokens  # the worker appends what it samples
            sent[request_id] = (num_worker_tokens + samples, len(block_ids))
        return self._encode(
            Step(
                new_requests,
                [request.request_id for request in output.requests],
                new_tokens,
                new_blocks,
                output.num_scheduled_tokens,
                output.start_positions,
                output.total_num_scheduled_tokens,
                sorted(output.preempted_req_ids),
                sorted(output.finished_req_ids),
                output.kv_connector_metadata,
                output.grammar.rows if output.grammar is not None else None,
                output.state_slots,
                output.state_restores,
            )
        )


@dataclass(slots=True, eq=False)
class WorkerRequest:
    """A request's state as a worker keeps it between steps (a ``ScheduledRequest``)."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: WorkerSampling
    block_ids: list[int]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def all_token_ids(self) -> list[int]:
        return self.token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class StepDecoder:
    """The worker's side: applies each :class:`Step` to the requests it keeps and rebuilds the
    ``SchedulerOutput`` its model runner takes."""

    def __init__(self) -> None:
        self.requests: dict[str, WorkerRequest] = {}
        self._decode = msgspec.msgpack.Decoder(WorkerInput).decode

    def decode(
        self, frame: bytes, next_frame: Callable[[], bytes] | None = None
    ) -> SchedulerOutput[WorkerRequest] | None:
        """The step's work order, or None for a shutdown; ``next_frame`` reads the frame after this
        one (the step's grammar bitmask, when it has one)."""
        message = self._decode(frame)
        if isinstance(message, Shutdown):
            return None
        if not isinstance(message, Step):
            raise ValueError(f"expected a step, got {type(message).__name__}")
        requests = self.requests
        for request_id in (*message.preempted_req_ids, *message.finished_req_ids):
            requests.pop(request_id, None)
        for new in message.new_requests:
            requests[new.request_id] = WorkerRequest(
                new.request_id, new.token_ids, new.num_prompt_tokens, new.sampling, []
            )
        scheduled: list[WorkerRequest] = []
        for request_id, tokens, blocks in zip(
            message.request_ids, message.new_token_ids, message.new_block_ids, strict=True
        ):
            request = requests[request_id]
            request.token_ids.extend(tokens)
            request.block_ids.extend(blocks)
            scheduled.append(request)
        return SchedulerOutput(
            scheduled,
            message.num_scheduled_tokens,
            message.start_positions,
            [request.block_ids for request in scheduled],
            message.total_num_scheduled_tokens,
            set(message.preempted_req_ids),
            set(message.finished_req_ids),
            message.kv_connector_metadata,
            self._grammar(message.grammar_rows, next_frame),
            message.state_slots,
            message.state_restores,
        )

    def _grammar(self, rows: list[int] | None, next_frame: Callable[[], bytes] | None) -> StepGrammar | None:
        if rows is None:
            return None
        if next_frame is None:
            raise ValueError("a step with a grammar needs the frame that follows it")
        read = next_frame

        def fetch() -> np.ndarray:
            message = self._decode(read())
            if not isinstance(message, GrammarBitmask):
                raise ValueError(f"expected the step's grammar bitmask, got {type(message).__name__}")
            return np.frombuffer(message.data, dtype=np.int32).reshape(-1, message.words_per_row).copy()

        return StepGrammar(rows, fetch)

    @staticmethod
    def sampled(work: SchedulerOutput[WorkerRequest], sampled_token_ids: list[int]) -> None:
        """Append each token the step sampled to its request (the core does not send them back)."""
        for request, token in zip(work.requests, sampled_token_ids, strict=True):
            if token >= 0:
                request.token_ids.append(token)


class RankReport(msgspec.Struct, tag="report"):
    """A P/D engine's rank other than 0, each step: what its transfer agent reported (the core joins
    every rank's reports, ``kvtransfer.aggregate``)."""

    kv_connector_output: KVConnectorOutput | None


encode_output = msgspec.msgpack.Encoder().encode
decode_output: Any = msgspec.msgpack.Decoder(ModelRunnerOutput).decode
encode_shutdown = msgspec.msgpack.Encoder().encode(Shutdown())
