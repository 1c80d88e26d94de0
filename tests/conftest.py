"""Shared test settings. HYPOTHESIS_PROFILE=thorough runs the property tests 20x longer."""

import os

from hypothesis import settings

settings.register_profile("pdserve", max_examples=200)
settings.register_profile("thorough", max_examples=4000, stateful_step_count=100)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "pdserve"))
