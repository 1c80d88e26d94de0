"""The operator process: kopf in standalone mode with the pdserve handlers (`pdserve operator`)."""

import kopf

from pdserve.operator import handlers  # noqa: F401  (importing registers the handlers with kopf)


def run(namespace: str | None = None, liveness_port: int = 8080) -> None:
    """Serve PDServices of one namespace, or of all namespaces when `namespace` is None, until stopped.

    Standalone (no peering): run one replica. Liveness: GET http://0.0.0.0:<liveness_port>/healthz.
    """
    kopf.configure(verbose=False)
    kopf.run(
        standalone=True,
        clusterwide=namespace is None,
        namespaces=[namespace] if namespace else [],
        liveness_endpoint=f"http://0.0.0.0:{liveness_port}/healthz",
    )
