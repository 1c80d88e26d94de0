"""Fixtures of the transfer-agent tests: the deployment's keys, and another deployment's."""

from __future__ import annotations

import pytest

from pdserve.api.keys import new_bundle, write_bundle


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("keys")
    write_bundle(folder, new_bundle())
    return str(folder)


@pytest.fixture(scope="module")
def wrong_keys(tmp_path_factory) -> str:
    """Another deployment's keys."""
    folder = tmp_path_factory.mktemp("wrong-keys")
    write_bundle(folder, new_bundle())
    return str(folder)
