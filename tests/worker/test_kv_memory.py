"""The CPU KV cache's memory starts on a page boundary, whatever its size (numpy's own data start 16
bytes into an allocation: rows straddling cache lines made vector loads several times slower), and
comes zeroed."""

from __future__ import annotations

import pytest
import torch

from pdserve.worker.kv_cache import allocate_kv_memory


@pytest.mark.parametrize("shape", [(3, 5), (64, 1024), (4, 2, 2, 4, 16, 64), (513, 4097)], ids=str)
def test_kv_memory_starts_on_a_page_and_is_zero(shape):
    memory = allocate_kv_memory(shape, torch.float32, torch.device("cpu"))
    assert memory.shape == shape and memory.is_contiguous()
    assert memory.data_ptr() % 4096 == 0
    assert not memory.any()
