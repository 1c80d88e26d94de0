"""A worker's start-up in named phases: each is logged as it begins (a pod stuck in one says which) and
as it ends, with its time; the list travels with the worker's ready report to the engine's ``/metrics``
(``pdserve_startup_phase_seconds``), so a user sees why a pod is not ready yet and where its start went.

The phases, in order (a phase that does not apply to a device is not listed):

- ``load_weights``: read the checkpoint onto the device, and on CPU lay it out for the kernels (packed);
- ``profile_memory``: size the KV cache (GPU: a forward pass at the largest step measures the activations'
  peak; CPU: the cgroup's memory limit and what the process holds);
- ``allocate_kv_cache``: allocate and zero it, and register it with the KV connectors;
- ``warm_up``: one small mixed step through the model (a prefill chunk and a decode), so kernels compile
  (Triton) and first-touch costs land here instead of in the first request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


@dataclass
class StartupPhases:
    phases: list[tuple[str, float]] = field(default_factory=list)  # (name, seconds), in order

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        logger.info("start-up: %s", name)
        start = time.perf_counter()
        yield
        seconds = time.perf_counter() - start
        self.phases.append((name, seconds))
        logger.info("start-up: %s done in %.2f s", name, seconds)
