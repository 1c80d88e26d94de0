"""The built-in demo model: written by the CLI, deterministic, built atomically by racing
processes, loadable by transformers, and our greedy output equals transformers' on it."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.models.demo import DEMO_MODEL_NAME


def _digest(folder) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_cli_writes_a_deterministic_model(tmp_path):
    for name in ("a", "b"):
        subprocess.run(
            [sys.executable, "-m", "pdserve.cli", "demo-model", str(tmp_path / name)], check=True, capture_output=True
        )
    assert (tmp_path / "a" / "config.json").is_file()
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b")


def test_processes_racing_to_build_the_cache_all_succeed(tmp_path):
    code = (
        "import sys; from pathlib import Path; from pdserve.models.demo import ensure_demo_model; "
        "print(ensure_demo_model(Path(sys.argv[1])))"
    )
    racers = [
        subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    paths = {racer.communicate(timeout=120)[0].strip() for racer in racers}
    assert all(racer.returncode == 0 for racer in racers)
    assert paths == {str(tmp_path / DEMO_MODEL_NAME)}
    assert [p.name for p in tmp_path.iterdir()] == [DEMO_MODEL_NAME]  # no temporary folders left


def _assert_matches_transformers(folder) -> LLM:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    llm = LLM(str(folder), kv_cache_memory=32 << 20, max_model_len=256)
    prompts = ["Hello, world!", "The router sends the request to a prefill pod", "x"]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    for prompt, output in zip(prompts, outputs, strict=True):
        ids = torch.tensor([llm.tokenizer.encode(prompt)])
        with torch.no_grad():
            expected = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=10,
                min_new_tokens=10,
                do_sample=False,
                pad_token_id=0,
            )[0, ids.shape[1] :].tolist()
        assert output.outputs[0].token_ids == expected
    return llm


def test_demo_model_matches_transformers(demo_model_path):
    llm = _assert_matches_transformers(demo_model_path)
    assert llm.processor.eos_token_id == llm.tokenizer.convert_tokens_to_ids("<|im_end|>")


@pytest.mark.parametrize(
    ("family", "layout"),
    [
        ("qwen3-moe", lambda config: (config.num_experts, config.moe_layers) == (8, (0, 1, 2, 3))),
        ("qwen3.5", lambda config: (config.linear_layers, config.attention_layers) == ((0, 1, 2), (3,))),
    ],
)
def test_the_other_families_demo_models_match_transformers(family, layout, tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "demo-model", "--family", family, str(tmp_path)],
        check=True,
        capture_output=True,
    )
    llm = _assert_matches_transformers(tmp_path)
    assert layout(llm.model_config)
