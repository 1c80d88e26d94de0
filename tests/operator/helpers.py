"""Helpers of the operator tests: manifests of test PDServices and a running operator."""

import contextlib
from collections.abc import Iterator
from typing import Any

from kopf.testing import KopfRunner

PDSERVICES = "pdserve.io/v1alpha1/pdservices"
PDPOOLS = "pdserve.io/v1alpha1/pdpools"
DEPLOYMENTS = "apps/v1/deployments"
SERVICES = "v1/services"
SECRETS = "v1/secrets"
NETWORK_POLICIES = "networking.k8s.io/v1/networkpolicies"


@contextlib.contextmanager
def running_operator(namespace: str | None, *options: str) -> Iterator[KopfRunner]:
    """The operator's handlers under kopf, standalone, serving one namespace (None: all), until the block ends."""
    where = ["--namespace", namespace] if namespace else ["--all-namespaces"]
    args = ["run", "--standalone", *where, *options, "--module", "pdserve.operator.handlers"]
    with KopfRunner(args, timeout=30) as runner:
        yield runner
    assert runner.exit_code == 0, runner.output
    assert runner.exception is None


def spec(**fields: Any) -> dict[str, Any]:
    """A minimal valid PDService spec (a PVC model, a test image) with the given fields on top."""
    return {"image": "pdserve:test", "model": {"source": "pvc", "claimName": "models"}, **fields}


def pdservice(name: str = "llm", **fields: Any) -> dict[str, Any]:
    return {
        "apiVersion": "pdserve.io/v1alpha1",
        "kind": "PDService",
        "metadata": {"name": name},
        "spec": spec(**fields),
    }
