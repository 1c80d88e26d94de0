"""The offline API on the built-in demo model: vLLM's shapes for prompts and outputs, chat, n,
seeds, stop strings, logprobs, and clear errors that leave the engine usable."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pdserve import LLM, SamplingParams
from pdserve.api.tokenizer import apply_chat_template
from pdserve.engine.sampling_params import SamplingParamsError
from pdserve.models.demo import ensure_demo_model
from pdserve.testing.processes import engine_executor


@pytest.fixture(scope="module")
def llm():
    return LLM(
        str(ensure_demo_model()),
        kv_cache_memory=64 << 20,
        max_model_len=512,
        **engine_executor(),
    )


GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def test_prompt_forms(llm):
    text = llm.generate("Hello there", GREEDY)
    assert len(text) == 1 and text[0].prompt == "Hello there"
    assert text[0].prompt_token_ids == llm.tokenizer.encode("Hello there")
    ids = text[0].prompt_token_ids
    same = [
        llm.generate(ids, GREEDY)[0],
        llm.generate({"prompt_token_ids": ids}, GREEDY)[0],
        llm.generate({"prompt": "Hello there"}, GREEDY)[0],
    ]
    assert all(o.outputs[0].token_ids == text[0].outputs[0].token_ids for o in same)
    two = llm.generate([[1, 2], [3]], GREEDY)
    assert [o.prompt_token_ids for o in two] == [[1, 2], [3]]
    mixed = llm.generate(["a", [5, 6, 7]], [GREEDY, SamplingParams(max_tokens=2)])
    assert len(mixed[1].outputs[0].token_ids) == 2
    out = text[0].outputs[0]
    assert out.finish_reason == "length" and out.text == llm.tokenizer.decode(out.token_ids)


def test_chat_applies_the_template(llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    (out,) = llm.chat(messages, GREEDY)
    assert out.prompt_token_ids == apply_chat_template(llm.tokenizer, messages)
    assert llm.tokenizer.decode(out.prompt_token_ids).endswith("<|im_start|>assistant\n")
    assert len(llm.chat([messages, messages[1:]], GREEDY)) == 2


def test_n_seeds_and_reproducibility(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    (first,) = llm.generate("Once", params)
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1
    # Same seed, alone or in a bigger batch: same tokens.
    again = llm.generate(["Once", "Other", "Third prompt"], params)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in first.outputs]


def test_stop_strings_cut_the_text(llm):
    (full,) = llm.generate("Stop here", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    text = full.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    (cut,) = llm.generate("Stop here", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop]))
    out = cut.outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    (kept,) = llm.generate(
        "Stop here",
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop], include_stop_str_in_output=True),
    )
    assert kept.outputs[0].text == text[: text.index(stop) + len(stop)]


def test_logprobs_and_prompt_logprobs_shapes(llm):
    (out,) = llm.generate(
        [4, 5, 6, 7], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    )
    completion = out.outputs[0]
    assert len(completion.logprobs) == 5
    for token, step in zip(completion.token_ids, completion.logprobs, strict=True):
        assert token in step and step[token].rank == 1  # greedy picks the top token
        assert len(step) == 2
    assert completion.cumulative_logprob == pytest.approx(
        sum(s[t].logprob for t, s in zip(completion.token_ids, completion.logprobs, strict=True))
    )
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == 4
    for token, step in zip([5, 6, 7], out.prompt_logprobs[1:], strict=True):
        assert token in step


def test_bad_input_raises_clearly_and_leaves_the_engine_usable(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], GREEDY)
    with pytest.raises(ValueError, match="out of the vocabulary"):
        llm.generate([[1, 2, 10**6]], GREEDY)
    with pytest.raises(ValueError, match="context length is 512"):
        llm.generate(["fine", [1] * 600], GREEDY)
    with pytest.raises(SamplingParamsError, match="logprobs"):
        llm.generate("x", SamplingParams(logprobs=21))
    with pytest.raises(ValueError, match="sampling params for"):
        llm.generate(["a", "b"], [GREEDY])
    with pytest.raises(ValueError, match="a prompt is"):
        llm.generate([1.5], GREEDY)
    assert not llm.engine.has_work()
    assert llm.generate("still fine", GREEDY)[0].outputs[0].finish_reason == "length"


def test_import_sets_how_openmp_threads_wait_unless_the_user_did():
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    code = "import os, pdserve; print(os.environ['OMP_WAIT_POLICY'], os.environ['GOMP_SPINCOUNT'])"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["PASSIVE", "100000"]
    mine = subprocess.run(
        [sys.executable, "-c", code], env={**env, "GOMP_SPINCOUNT": "0"}, capture_output=True, text=True, check=True
    )
    assert mine.stdout.split() == ["PASSIVE", "0"]
    late = subprocess.run(
        [sys.executable, "-W", "always", "-c", "import torch, pdserve"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert "OMP_WAIT_POLICY, GOMP_SPINCOUNT cannot take effect" in late.stderr


def test_seeded_choices_at_the_int64_edge_are_built_before_anything_is_queued(llm):
    # The second choice's seed (2**63) wraps to stay a signed 64-bit integer instead of failing
    # after the first choice was already queued.
    params = SamplingParams(n=2, seed=2**63 - 1, temperature=1.0, max_tokens=4, ignore_eos=True)
    outputs = llm.generate("edge", params)[0].outputs
    assert [len(o.token_ids) for o in outputs] == [4, 4]
    assert llm.generate("edge", params)[0].outputs[1].token_ids == outputs[1].token_ids  # seeded: reproducible
    # A call that fails on any input queues none of its prompts.
    with pytest.raises(ValueError):
        llm.generate(["fine", [1] * 600], params)
    assert not llm.engine.has_work()
