"""LLM: the offline API, shaped like vLLM's so user code ports over.

    from pdserve import LLM, SamplingParams
    llm = LLM(model="path/to/hf-folder")          # no model: the built-in demo model
    outputs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
    outputs[0].outputs[0].text

A prompt is a string, a list of token ids, or ``{"prompt_token_ids": [...]}`` (or
``{"prompt": "..."}``); ``prompts`` is one prompt or a list of them, so ``[[1, 2], [3]]`` is two
prompts. Runs an EngineCore in this process.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from pdserve.api.tokenizer import load_tokenizer
from pdserve.engine.build import build_engine_core, model_folder
from pdserve.engine.engine_args import EngineArgs
from pdserve.engine.outputs import EngineCoreOutput, TokenLogprobs
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.structured_outputs import DEFAULT_COMPILE_TIMEOUT_S
from pdserve.kvtransfer.tiers.config import KVTierConfig
from pdserve.server.input_processor import InputProcessor, Prompt, PromptInput

logger = logging.getLogger(__name__)


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int = 0


@dataclass
class _Pending:
    """One child request (one of n) while it runs."""

    request: Request
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_text_end: int | None = None  # where the text is cut after a stop string
    num_cached_tokens: int = 0


class LLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        tokenizer: str | None = None,
        dtype: str = "auto",
        kv_cache_dtype: str = "auto",
        device: str | None = None,
        block_size: int = 16,
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        kv_cache_memory: int | None = None,
        gpu_memory_utilization: float = 0.9,
        enforce_eager: bool = False,
        cuda_graph_sizes: str | None = None,
        num_kv_blocks: int | None = None,
        enable_prefix_caching: bool = True,
        max_logprobs: int = 20,
        distributed_executor_backend: str = "uni",
        tensor_parallel_size: int = 1,
        async_scheduling: bool = False,
        structured_outputs_compile_timeout: float = DEFAULT_COMPILE_TIMEOUT_S,
        structured_outputs_any_whitespace: bool = False,
        reasoning_parser: str | None = None,
        kv_tiers: KVTierConfig | None = None,
    ) -> None:
        args = EngineArgs(
            model=model,
            tokenizer=tokenizer,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            device=device,
            block_size=block_size,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            kv_cache_memory=kv_cache_memory,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            cuda_graph_sizes=cuda_graph_sizes,
            num_kv_blocks=num_kv_blocks,
            enable_prefix_caching=enable_prefix_caching,
            distributed_executor_backend=distributed_executor_backend,
            tensor_parallel_size=tensor_parallel_size,
            async_scheduling=async_scheduling,
            structured_outputs_compile_timeout=structured_outputs_compile_timeout,
            structured_outputs_any_whitespace=structured_outputs_any_whitespace,
            reasoning_parser=reasoning_parser,
            kv_tiers=kv_tiers,
        )
        self.engine, self.model_config, _ = build_engine_core(args)
        self.tokenizer = load_tokenizer(tokenizer or model_folder(args))
        eos_ids = self.model_config.eos_token_ids or (
            [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []
        )
        self.processor = InputProcessor(
            self.tokenizer, self.model_config.vocab_size, self.engine.config.max_model_len, eos_ids, max_logprobs
        )
        self._next_id = 0

    # ----- public API ---------------------------------------------------------------------

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run the prompts to completion. Everything is checked, and every choice's parameters
        built, before anything is queued: a call that raises leaves no request behind."""
        normalised = self.processor.prompts(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(normalised)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(normalised):
                raise ValueError(f"{len(params_list)} sampling params for {len(normalised)} prompts")
        choices = [self.processor.choice_params(params) for params in params_list]
        groups = [
            (prompt, params, self._add(prompt.token_ids, per_choice))
            for prompt, params, per_choice in zip(normalised, params_list, choices, strict=True)
        ]
        self._run([pending for *_, children in groups for pending in children])
        return [self._request_output(prompt, params, children) for prompt, params, children in groups]

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or several; each through the chat template."""
        single = bool(messages) and isinstance(messages[0], dict)
        conversations = cast(list[list[dict[str, Any]]], [messages] if single else messages)
        prompts: list[PromptInput] = [
            {"prompt_token_ids": self.processor.chat_prompt(c, add_generation_prompt, chat_template_kwargs).token_ids}
            for c in conversations
        ]
        return self.generate(prompts, sampling_params)

    # ----- internals ----------------------------------------------------------------------

    def close(self) -> None:
        """Stop the engine (its worker process, with ``distributed_executor_backend="mp"``)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _add(self, token_ids: list[int], per_choice: list[SamplingParams]) -> list[_Pending]:
        children = []
        for params in per_choice:
            request = Request(str(self._next_id), token_ids, params, self.processor.eos_token_id)
            self._next_id += 1
            self.engine.add_request(request)
            children.append(_Pending(request))
        return children

    def _run(self, pending: list[_Pending]) -> None:
        by_id = {p.request.request_id: p for p in pending}
        # Until its requests are answered: blocks that stay out of use longer (a hung load's quarantine) are
        # released by later steps.
        while self.engine.has_work() and any(p.finish_reason is None for p in pending):
            for output in self.engine.step():
                child = by_id.get(output.request_id)
                if child is not None:
                    self._absorb(child, output)
                    if child.finish_reason is None and child.request.sampling_params.stop:
                        self._check_stop_strings(child)

    @staticmethod
    def _absorb(child: _Pending, output: EngineCoreOutput) -> None:
        if output.new_logprobs:
            child.logprobs.extend(output.new_logprobs)
        if output.prompt_logprobs is not None:
            child.prompt_logprobs = output.prompt_logprobs
        if output.finish_reason is not None:
            child.finish_reason = output.finish_reason
            child.num_cached_tokens = output.num_cached_tokens

    def _text(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens))

    def _check_stop_strings(self, child: _Pending) -> None:
        request = child.request
        params = request.sampling_params
        text = self._text(request.output_token_ids, params.skip_special_tokens)
        found = [(text.find(stop), stop) for stop in params.stop if stop in text]
        if not found:
            return
        position, stop = min(found)
        child.stop_text_end = position + len(stop) if params.include_stop_str_in_output else position
        request.stop_reason = stop
        child.finish_reason = "stop"
        child.num_cached_tokens = max(request.num_cached_tokens, 0)
        self.engine.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)

    def _logprob_dict(self, entry: TokenLogprobs) -> dict[int, Logprob]:
        result = {
            token_id: Logprob(logprob, rank + 1, self._text([token_id]))
            for rank, (token_id, logprob) in enumerate(zip(entry.top_token_ids, entry.top_logprobs, strict=True))
        }
        if entry.token_id not in result:
            result[entry.token_id] = Logprob(entry.logprob, entry.rank, self._text([entry.token_id]))
        return result

    def _request_output(self, prompt: Prompt, params: SamplingParams, children: list[_Pending]) -> RequestOutput:
        completions = []
        for index, child in enumerate(children):
            request = child.request
            output_text = self._text(request.output_token_ids, params.skip_special_tokens)
            if child.stop_text_end is not None:
                output_text = output_text[: child.stop_text_end]
            logprobs = [self._logprob_dict(e) for e in child.logprobs] if params.logprobs is not None else None
            completions.append(
                CompletionOutput(
                    index=index,
                    text=output_text,
                    token_ids=list(request.output_token_ids),
                    cumulative_logprob=sum(e.logprob for e in child.logprobs) if logprobs is not None else None,
                    logprobs=logprobs,
                    finish_reason=child.finish_reason,
                    stop_reason=request.stop_reason,
                )
            )
        first = children[0]
        prompt_logprobs = None
        if params.prompt_logprobs is not None:
            # The first prompt token has nothing before it, so no logprob (vLLM's None).
            prompt_logprobs = [None] + [self._logprob_dict(e) for e in first.prompt_logprobs or []]
        return RequestOutput(
            request_id=first.request.request_id,
            prompt=prompt.text,
            prompt_token_ids=prompt.token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=completions,
            num_cached_tokens=first.num_cached_tokens,
        )
