"""ScriptedModelRunner: the real model runner (weights, KV cache, sampler, grammar bitmask) whose
logits are replaced by a script, so a test can make a served model write what a trained model
would: ``<think>…</think>`` then JSON, ``<tool_call>{…}</tool_call>`` blocks.

The script is the prompt's own: the text after the last ``SCRIPT:`` in it, up to the end of that
message (``<|im_end|>``). At each sampled position the script's next token gets all the
probability, then its end-of-sequence token. The request's grammar still applies on top, as it
would to a model's logits: where the grammar forbids the scripted token, the sampler picks among
the tokens it allows. So a grammar applied where it should not be (to the thinking) shows in the
output. Used with ``EngineArgs(model_runner_cls=SCRIPTED_RUNNER)`` (in-process executor).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pdserve.api.tokenizer import load_tokenizer
from pdserve.worker.interface import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from pdserve.worker.model_runner import ModelRunner

SCRIPTED_RUNNER = "pdserve.testing.scripted_runner:ScriptedModelRunner"
SCRIPT_MARKER = "SCRIPT:"
_SCRIPT_END = "<|im_end|>"
_PEAK = 50.0  # the scripted token's logit over 0 for every other: probability 1 - 1e-19 per token


class ScriptedModelRunner(ModelRunner):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tokenizer = load_tokenizer(self.config.model)
        self.eos_token_id = self.model_config.eos_token_ids[0]
        self.scripts: dict[str, list[int]] = {}
        self._sampling: list[ScheduledRequest] | None = None  # the requests the step's logits are for
        real_logits: Callable[[torch.Tensor], torch.Tensor] = self.model.compute_logits
        self.model.compute_logits = lambda hidden: self._scripted(real_logits(hidden))  # type: ignore[method-assign]

    def execute_model(self, scheduler_output: SchedulerOutput[ScheduledRequest]) -> ModelRunnerOutput:
        for request_id in scheduler_output.finished_req_ids:
            self.scripts.pop(request_id, None)
        # The requests sampled this step, in the order the runner computes their logits (first).
        self._sampling = [
            request
            for request, num_new, start in zip(
                scheduler_output.requests,
                scheduler_output.num_scheduled_tokens,
                scheduler_output.start_positions,
                strict=True,
            )
            if start + num_new == request.num_tokens
        ]
        try:
            return super().execute_model(scheduler_output)
        finally:
            self._sampling = None

    def _scripted(self, logits: torch.Tensor) -> torch.Tensor:
        sampling, self._sampling = self._sampling, None  # later calls (prompt logprobs) keep the model's
        if sampling is None or len(sampling) != logits.shape[0]:
            return logits
        scripted = torch.zeros_like(logits)
        for row, request in enumerate(sampling):
            script = self._script(request)
            position = len(request.output_token_ids)
            scripted[row, script[position] if position < len(script) else self.eos_token_id] = _PEAK
        return scripted

    def _script(self, request: ScheduledRequest) -> list[int]:
        script = self.scripts.get(request.request_id)
        if script is None:
            prompt = str(self.tokenizer.decode(request.prompt_token_ids))
            text = ""
            if SCRIPT_MARKER in prompt:
                text = prompt.rpartition(SCRIPT_MARKER)[2].partition(_SCRIPT_END)[0].strip()
            script = self.scripts[request.request_id] = self.tokenizer.encode(text, add_special_tokens=False)
        return script
