"""SchedulerConfig: the scheduler's sizes and switches (the block pool's size, the step's budgets, prefix
caching, a hybrid model's state slots, the scheduling policy), checked where they are made. The planner's
EngineShape copies it field for field."""

from __future__ import annotations

from dataclasses import dataclass

# fcfs: arrival order. priority: the request's priority first (lower value first, vLLM's semantics), then arrival;
# a request that cannot start displaces running requests of a larger value.
SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass
class SchedulerConfig:
    num_blocks: int
    block_size: int = 16
    max_model_len: int = 4096
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    num_state_slots: int = 0  # hybrid models: linear-attention state slots (one per running request)
    rows_per_state_slot: int = 0  # cache rows each slot takes, after the pool's blocks
    scheduling_policy: str = "fcfs"  # one of SCHEDULING_POLICIES

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.scheduling_policy!r}"
            )
        capacity = self.num_blocks * self.block_size
        if capacity < self.max_model_len:
            # Otherwise one long request could need more blocks than exist and never finish.
            raise ValueError(
                f"the KV cache holds {capacity} tokens ({self.num_blocks} blocks of {self.block_size}), "
                f"less than max_model_len={self.max_model_len}: give the cache more memory or lower "
                "max_model_len"
            )
