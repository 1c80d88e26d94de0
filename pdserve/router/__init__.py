"""The OpenAI-compatible router: sends each request through a prefill pod and a decode pod, chosen by their
cached prefixes (from the engines' KV-cache events) and load, and streams the decode pod's answer back
(docs/architecture.md; its API, flags and metrics: docs/contracts.md). Imports only pdserve.api and
pdserve.engine.block_hash among pdserve's packages."""

from pdserve.router.config import RouterConfig
from pdserve.router.server import Router, RunningRouter, start_router

__all__ = ["Router", "RouterConfig", "RunningRouter", "start_router"]
