"""Schemathesis against a live colocated engine server (real core process): every operation of its
/openapi.json with schema-valid, schema-invalid and within-limits requests, each answer checked (no 5xx,
documented status and content type, body conforming to the document, OpenAI error shape, well-formed streams);
the engine healthy and idle afterwards."""

from __future__ import annotations

import pytest

from pdserve.engine.engine_args import EngineArgs
from pdserve.models.demo import ensure_demo_model
from pdserve.testing.metrics import scrape as metrics
from tests.fuzz.openapi_fuzz import RUN_IDS, RUNS, get_json, load_schemas, run_operation
from tests.pd.cluster import wait_for
from tests.server.helpers import ServerThread

# Generation requests fuzz fields the engine must bound itself (n, max_tokens, logprobs); a 64-token context keeps
# even the largest accepted request (16 choices of up to 63 tokens) cheap on a CPU.
MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def engine():
    model = str(ensure_demo_model())
    thread = ServerThread(EngineArgs(model=model, max_model_len=MAX_MODEL_LEN, kv_cache_memory=16 << 20, device="cpu"))
    yield thread
    thread.close()


@pytest.fixture(scope="module")
def schemas(engine):
    return load_schemas(engine.running.url)


@pytest.mark.parametrize(("path", "method", "document", "mode", "examples"), RUNS, ids=RUN_IDS)
def test_operation(schemas, path, method, document, mode, examples):
    run_operation(schemas, path, method, document, mode, examples, "engine")


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
