"""Fixtures for model tests: tiny seeded Hugging Face models, built once per session."""

from __future__ import annotations

import pytest

from pdserve.models.demo import ensure_demo_model
from pdserve.testing.hf_models import SHAPES, build_hf_model


@pytest.fixture(scope="session")
def demo_model_path(tmp_path_factory):
    return ensure_demo_model(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    """name -> (folder, the transformers model)."""
    built = {}
    for name, (family, overrides) in SHAPES.items():
        folder = tmp_path_factory.mktemp(name)
        built[name] = (folder, build_hf_model(family, overrides, folder))
    return built
