"""The planner's EngineShape is the engine's scheduler configuration, field for field: a profiled hybrid
engine (state slots capping its running requests) is simulated with its cap."""

from __future__ import annotations

from dataclasses import fields

from pdserve.engine.scheduler_config import SchedulerConfig
from pdserve.planner.profile import EngineShape


def test_a_hybrid_engines_shape_gives_back_its_scheduler_config():
    config = SchedulerConfig(
        num_blocks=64,
        block_size=16,
        max_model_len=512,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        enable_prefix_caching=False,
        num_state_slots=4,
        rows_per_state_slot=3,
    )
    assert EngineShape.of(config, 1024).scheduler_config() == config


def test_every_scheduler_setting_has_its_twin_in_the_shape():
    assert {item.name for item in fields(SchedulerConfig)} <= {item.name for item in fields(EngineShape)}
