"""pdserve: prefill/decode-disaggregated LLM serving.

``from pdserve import LLM, SamplingParams, StructuredOutputsParams`` gives the offline API. Importing pdserve sets
how torch's OpenMP threads wait between two kernels (``OPENMP_ENV``), each variable only when it is unset.
OpenMP reads them when torch is first imported, so import pdserve before torch, or export them yourself
when torch comes first.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import Any

# Threads that spin without end take the cores from every other process on a small machine
# (generation 5-8x slower was measured on one of our 2-core machines); threads that sleep at once pay
# a wake-up, ~0.1 ms on a VM, at each of a decode step's ~60 parallel kernels (+30% tok/s at batch 64
# and at batch 1 from spinning, see docs/benchmarks.md). So: spin about 4 ms (GNU OpenMP, torch's on
# Linux: ~40-60 ns a spin), then sleep. GOMP_SPINCOUNT=0 makes the threads wait passively at once.
OPENMP_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "100000"}

_unset = [name for name in OPENMP_ENV if name not in os.environ]
for _name in _unset:
    os.environ[_name] = OPENMP_ENV[_name]
if _unset and "torch" in sys.modules:
    warnings.warn(
        f"torch was imported before pdserve, so {', '.join(_unset)} cannot take effect in this process; "
        f"export {' '.join(f'{name}={OPENMP_ENV[name]}' for name in _unset)} before starting Python "
        "(CPU generation can otherwise be several times slower)",
        stacklevel=2,
    )

# Start-up facts (model, dtype, KV blocks, concurrency) should be visible without configuring
# logging, as vLLM's are; PDSERVE_CONFIGURE_LOGGING=0 leaves logging entirely to the application.
_logger = logging.getLogger("pdserve")
if os.environ.get("PDSERVE_CONFIGURE_LOGGING", "1") == "1" and not _logger.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s"))
    _logger.addHandler(_handler)
    _logger.setLevel(logging.INFO)
    _logger.propagate = False

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams"]


def __getattr__(name: str) -> Any:
    # Lazy: components that only need a small piece of pdserve (the router's block hashes) must
    # not pay for importing torch and the model code.
    if name == "LLM":
        from pdserve.llm import LLM

        return LLM
    if name in ("SamplingParams", "StructuredOutputsParams"):
        from pdserve.engine import sampling_params

        return getattr(sampling_params, name)
    raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
