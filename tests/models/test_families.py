"""The model-family registry: every supported architecture has one family, an unknown one is refused
naming them all, the demo families are families, and reading a config needs no torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.models import families, llama
from pdserve.models.config import ModelConfig, UnsupportedModelError

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


def test_each_architecture_has_one_family_and_an_unknown_one_is_refused_naming_them():
    rows = [name for names in families.FAMILIES for name in names]
    assert len(rows) == len(set(rows)) == len(families.ARCHITECTURES)
    assert len({family.name for family in families.FAMILIES.values()}) == len(families.FAMILIES)
    assert ModelConfig.from_dict(LLAMA).family is llama.FAMILY
    with pytest.raises(UnsupportedModelError) as refused:
        ModelConfig.from_dict({**LLAMA, "architectures": ["GPT2LMHeadModel"]})
    assert "GPT2LMHeadModel" in str(refused.value)
    assert all(name in str(refused.value) for name in families.ARCHITECTURES)


def test_each_demo_family_is_the_family_of_its_architecture():
    by_name = {family.name: family for family in families.FAMILIES.values()}
    for name, (architecture, _, _) in families.DEMO_FAMILIES.items():
        assert families.ARCHITECTURES[architecture] is by_name[name]


def test_reading_a_config_imports_no_torch():
    # The API process reads the model's config, and the CLI lists the demo families, without torch.
    code = (
        "import sys\n"
        "from pdserve.models.config import ModelConfig\n"
        "from pdserve.models.families import DEMO_FAMILIES, FAMILIES\n"
        f"config = ModelConfig.from_dict({LLAMA!r})\n"
        "assert config.family.name == 'llama' and FAMILIES and DEMO_FAMILIES\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
