"""Fixtures of the operator tests: the emulated API server (kmock_cluster) and a running operator."""

from collections.abc import Iterator

import pytest
from kopf.testing import KopfRunner

from tests.operator.helpers import running_operator
from tests.operator.kmock_cluster import KubeCluster, kube_cluster, kube_namespace

__all__ = ["kube_cluster", "kube_namespace"]  # fixtures, re-exported for pytest


@pytest.fixture()
def operator(kube_cluster: KubeCluster, kube_namespace: str) -> Iterator[KopfRunner]:
    """The operator running against the emulator, serving this test's namespace."""
    with running_operator(kube_namespace) as runner:
        yield runner
