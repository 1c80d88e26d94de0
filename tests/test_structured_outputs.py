"""Structured outputs through the engine (offline LLM and EngineCore) on the built-in demo model,
whose gibberish never forms valid JSON by chance: every output must come from the grammar.

Runs on the tests' executor (PDSERVE_TEST_EXECUTOR: in-process, worker process, async scheduling),
so the bitmask's path through each executor is covered by make test-slow's passes."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.grammar import GrammarError
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampling_params import StructuredOutputsParams
from pdserve.engine.structured_outputs import COMPILE_THREADS
from pdserve.models.demo import ensure_demo_model
from pdserve.testing.processes import engine_executor
from pdserve.testing.schemas import SCHEMAS

MAX_TOKENS = 512


@pytest.fixture(scope="module")
def llm():
    with LLM(str(ensure_demo_model()), kv_cache_memory=64 << 20, max_model_len=1024, **engine_executor()) as engine:
        yield engine


def _json(schema, **fields) -> SamplingParams:
    fields.setdefault("temperature", 1.0)
    fields.setdefault("max_tokens", MAX_TOKENS)
    return SamplingParams(structured_outputs=StructuredOutputsParams(json=schema), **fields)


def test_fifty_requests_over_ten_schemas_all_stop_and_validate(llm):
    prompts = [f"Request {i}: tell me something." for i in range(50)]
    params = [_json(SCHEMAS[i % 10], seed=i) for i in range(50)]
    outputs = llm.generate(prompts, params)
    for i, output in enumerate(outputs):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", (i, completion.text)  # "length" would be a failure
        jsonschema.validate(json.loads(completion.text), SCHEMAS[i % 10])


def test_greedy_json_object_regex_choice_and_grammar(llm):
    arithmetic = """
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")"
number ::= [1-9] [0-9]{0,3}
"""
    constraints = [
        StructuredOutputsParams(json_object=True),
        StructuredOutputsParams(regex=r"[a-z]{3,8}-[0-9]{2}"),
        StructuredOutputsParams(choice=["yes", "no", "maybe later"]),
        StructuredOutputsParams(grammar=arithmetic),
    ]
    outputs = llm.generate(
        ["Say something."] * len(constraints),
        [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=c) for c in constraints],
    )
    texts = [output.outputs[0].text for output in outputs]
    # Any JSON object: its keys are free strings, which a gibberish model (greedy) never closes.
    assert outputs[0].outputs[0].finish_reason == "length"
    assert texts[0].startswith('{"') and not re.search(r"[\x00-\x1f]", texts[0])
    assert all(output.outputs[0].finish_reason == "stop" for output in outputs[1:]), texts
    assert re.fullmatch(r"[a-z]{3,8}-[0-9]{2}", texts[1])
    assert texts[2] in ("yes", "no", "maybe later")
    assert re.fullmatch(r"[0-9+\-*/()]+", texts[3])
    eval(compile(texts[3], "<grammar output>", "eval"), {"__builtins__": {}})  # parses as arithmetic


def test_n_seeds_and_logprobs(llm):
    params = _json(SCHEMAS[0], n=2, seed=7, logprobs=2)
    first, again = llm.generate(["Seeded."], params)[0], llm.generate(["Seeded."], params)[0]
    assert [c.text for c in first.outputs] == [c.text for c in again.outputs]
    assert first.outputs[0].text != first.outputs[1].text  # each choice its own seed
    for completion in first.outputs:
        jsonschema.validate(json.loads(completion.text), SCHEMAS[0])
        # Logprobs are the raw model's (before the grammar's mask), one per token.
        assert len(completion.logprobs) == len(completion.token_ids)


def test_a_grammar_that_cannot_finish_ends_by_length(llm):
    output = llm.generate(["Long."], _json(SCHEMAS[1], max_tokens=5, seed=1))[0].outputs[0]
    assert output.finish_reason == "length" and len(output.token_ids) == 5


def test_bad_specs_are_refused_before_anything_is_queued(llm):
    with pytest.raises(GrammarError) as error:
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(regex="(unclosed")))
    assert error.value.param == "structured_outputs.regex"
    assert not llm.engine.has_work()
    assert llm.generate(["x"], _json(SCHEMAS[4], seed=3))[0].outputs[0].finish_reason == "stop"


def test_preemption_mid_grammar_leaves_the_same_valid_outputs(tmp_path):
    prompts = [f"Preempt {i}: " + "words " * 20 for i in range(6)]
    params = [_json(SCHEMAS[i % 10], seed=100 + i) for i in range(6)]
    demo = str(ensure_demo_model())
    with LLM(demo, max_model_len=256, num_kv_blocks=256, **engine_executor()) as roomy:
        expected = [o.outputs[0].text for o in roomy.generate(prompts, params)]
    # 6 requests of ~30 prompt and ~100-200 output tokens in 24 blocks of 16: they preempt each other.
    with LLM(demo, max_model_len=256, num_kv_blocks=24, **engine_executor()) as tight:
        outputs = tight.generate(prompts, params)
        assert tight.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].text for o in outputs] == expected
    for i, output in enumerate(outputs):
        jsonschema.validate(json.loads(output.outputs[0].text), SCHEMAS[i % 10])


def _blocked_compiles(llm: LLM) -> threading.Event:
    """Occupy every compile thread of the engine's grammar pool until the event is set."""
    manager = llm.engine.structured_outputs
    release = threading.Event()
    warm_up = Request("warm-up", [1], _json({"type": "integer"}))
    manager.add_request(warm_up)  # makes the pool and the compiler
    warm_up.structured_output.future.result(timeout=60)
    manager.forget(warm_up.request_id)  # not the engine's: it must not count as waiting
    for _ in range(COMPILE_THREADS):
        manager._pool.submit(release.wait, 30)
    return release


def test_a_request_waits_for_its_grammar_while_others_run(tmp_path):
    with LLM(str(ensure_demo_model()), kv_cache_memory=32 << 20, max_model_len=512) as llm:
        release = _blocked_compiles(llm)
        try:
            waiting = Request("waits", [5, 6, 7], _json(SCHEMAS[2], seed=1), llm.processor.eos_token_id)
            free = Request("free", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
            llm.engine.add_request(waiting)
            llm.engine.add_request(free)
            for _ in range(4):
                llm.engine.step()
            assert waiting.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
            assert waiting.num_computed_tokens == 0 and free.status == RequestStatus.FINISHED_LENGTH_CAPPED
            assert llm.engine.make_stats().num_waiting_for_grammar == 1
        finally:
            release.set()
        while not waiting.is_finished:
            llm.engine.step()
        assert waiting.status == RequestStatus.FINISHED_STOPPED
        jsonschema.validate(
            json.loads(llm.tokenizer.decode(waiting.output_token_ids, skip_special_tokens=True)), SCHEMAS[2]
        )


def test_a_compile_that_fails_or_times_out_ends_only_its_request():
    with LLM(str(ensure_demo_model()), kv_cache_memory=32 << 20, max_model_len=512) as llm:
        core = llm.engine
        # Unchecked on purpose (the API refuses it first): the core must survive what slips through.
        bad = Request("bad", [5, 6], SamplingParams(structured_outputs=StructuredOutputsParams(regex="(x")))
        good = Request("good", [5, 6], _json(SCHEMAS[3], seed=2), llm.processor.eos_token_id)
        core.add_request(bad)
        core.add_request(good)
        outputs = []
        while core.has_work():
            outputs += core.step()
        failed = [o for o in outputs if o.request_id == "bad"]
        assert failed[0].finish_reason == "error" and failed[0].error_status == 400
        assert "structured_outputs.regex" in failed[0].stop_reason
        assert good.status == RequestStatus.FINISHED_STOPPED
        assert core.make_stats().grammar_compile_failures == 1

        core.structured_outputs.compile_timeout = 0.2
        release = _blocked_compiles(llm)
        try:
            slow = Request("slow", [5, 6], _json(SCHEMAS[5], seed=3), llm.processor.eos_token_id)
            core.add_request(slow)
            outputs = []
            while core.has_work():
                outputs += core.step()
        finally:
            release.set()
        assert [o.finish_reason for o in outputs if o.request_id == "slow"] == ["error"]
        assert "did not compile within 0.2 s" in slow.stop_reason
        assert core.scheduler.kv_cache_manager.usage == 0  # nothing held
