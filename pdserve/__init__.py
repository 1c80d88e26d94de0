"""pdserve: prefill/decode-disaggregated LLM serving.

``from pdserve import LLM, SamplingParams, StructuredOutputsParams`` gives the offline API. Importing pdserve sets
``OMP_WAIT_POLICY=PASSIVE`` when it is unset: on small CPUs torch's spinning OpenMP threads
otherwise make generation 5-8x slower. OpenMP reads it when torch is first imported, so import
pdserve before torch, or export the variable yourself when torch comes first.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import Any

if "OMP_WAIT_POLICY" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    if "torch" in sys.modules:
        warnings.warn(
            "torch was imported before pdserve, so OMP_WAIT_POLICY=PASSIVE cannot take effect in "
            "this process; export OMP_WAIT_POLICY=PASSIVE before starting Python (CPU generation "
            "can otherwise be several times slower)",
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
