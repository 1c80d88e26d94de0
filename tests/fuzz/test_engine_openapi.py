"""Schemathesis against a live colocated engine server (real core process): every operation of its
/openapi.json with schema-valid, schema-invalid and within-limits requests, each answer checked (no 5xx,
documented status and content type, body conforming to the document, OpenAI error shape, well-formed streams);
the engine healthy and idle afterwards."""

from __future__ import annotations

import pytest
from schemathesis import GenerationMode

from pdserve.engine.engine_args import EngineArgs
from pdserve.models.demo import ensure_demo_model
from tests.fuzz.openapi_fuzz import RUNS, fuzz, get_json, load_schema, load_schema_within_limits
from tests.pd.cluster import metrics, wait_for
from tests.server.helpers import ServerThread

# Generation requests fuzz fields the engine must bound itself (n, max_tokens, logprobs); a 64-token context keeps
# even the largest accepted request (16 choices of up to 63 tokens) cheap on a CPU.
MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model = str(ensure_demo_model(tmp_path_factory.mktemp("cache")))
    thread = ServerThread(EngineArgs(model=model, max_model_len=MAX_MODEL_LEN, kv_cache_memory=16 << 20, device="cpu"))
    yield thread
    thread.close()


@pytest.fixture(scope="module")
def schemas(engine):
    url = engine.running.url
    vocab_size = len(engine.running.server.tokenizer)
    return {
        "plain": load_schema(url),
        "within_limits": load_schema_within_limits(url, "demo", vocab_size),
        "streaming": load_schema_within_limits(url, "demo", vocab_size, streaming=True),
    }


@pytest.mark.parametrize(
    ("path", "method", "document", "mode", "examples"), RUNS, ids=[f"{m} {p} {d} {g.value}" for p, m, d, g, _ in RUNS]
)
def test_operation(schemas, path, method, document, mode, examples):
    statuses = fuzz(schemas[document], path, method, mode, examples, whole_floats_as_ints=document != "plain")
    print(f"{method} {path} {document} {mode.value}: {dict(statuses)}")  # shown with -s: what the run exercised
    assert statuses["overloaded"] == 0, f"503 overload answers from an idle engine: {statuses}"
    if document != "plain":
        # The narrowed document describes requests the engine serves; mostly refusing them means it drifted.
        assert statuses[200] >= examples // 2, statuses
        assert document != "streaming" or statuses["streams"] == statuses[200], statuses
    elif method == "POST" and mode is GenerationMode.POSITIVE:
        assert statuses[200] > 0, statuses


def test_engine_healthy_and_idle_after_fuzzing(engine):
    url = engine.running.url
    assert get_json(f"{url}/health")[0] == 200
    # Every request ended (finished, rejected or aborted), so nothing may run, wait or own KV blocks.
    idle = {"pdserve_num_requests_running": 0, "pdserve_num_requests_waiting": 0, "pdserve_kv_cache_usage_ratio": 0}
    wait_for(
        lambda: all(metrics(url).get(name) == value for name, value in idle.items()),
        10,
        f"the engine is not idle: {metrics(url)}",
    )
