"""The step's three stages (prepare the inputs, run the model, sample) and the persistent input buffers the
first writes into: every step's inputs are views of the same memory, so nothing on the hot path allocates a
tensor and a captured graph could replay over the same addresses."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.kernels.metadata import InputBuffers, build_attention_metadata


def test_a_hand_checked_batch_lands_where_it_belongs():
    """Two sequences: a 3-token chunk after 5 cached tokens, and a decode at position 9 (block size 4)."""
    buffers = InputBuffers(max_tokens=8, max_seqs=4, max_model_len=32, block_size=4, device=torch.device("cpu"))
    tokens = [list(range(100, 108)), list(range(200, 210))]
    input_ids, positions, metadata = buffers.prepare(tokens, [3, 1], [5, 9], [[7, 3], [1, 4, 6]])
    assert input_ids.tolist() == [105, 106, 107, 209]
    assert positions.tolist() == [5, 6, 7, 9]
    assert metadata.slot_block_ids.tolist() == [3, 3, 3, 6]  # position // 4 in each sequence's table
    assert metadata.slot_offsets.tolist() == [1, 2, 3, 1]
    assert metadata.query_start_loc == [0, 3, 4] and metadata.query_starts.tolist() == [0, 3, 4]
    assert metadata.context_lens == [8, 10] and metadata.context_lens_tensor.tolist() == [8, 10]
    assert metadata.token_seqs.tolist() == [0, 0, 0, 1]
    assert metadata.prefill_seq_indices == [0]
    assert metadata.decode_seq_indices.tolist() == [1] and metadata.decode_token_indices.tolist() == [3]
    assert metadata.decode_context_lens.tolist() == [10] and metadata.decode_block_ids.tolist() == [1, 4, 6]
    assert metadata.block_tables[0, :2].tolist() == [7, 3] and metadata.block_tables[1, :3].tolist() == [1, 4, 6]
    # The same batch through the one-off builder the tests and the memory profile use.
    again = build_attention_metadata([3, 1], [8, 10], [[7, 3], [1, 4, 6]], 4)
    assert again.slot_block_ids.tolist() == metadata.slot_block_ids.tolist()
    assert again.decode_block_ids.tolist() == metadata.decode_block_ids.tolist()


def test_a_step_larger_than_the_buffers_is_refused_by_name():
    buffers = InputBuffers(max_tokens=4, max_seqs=2, max_model_len=8, block_size=4, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="a step of 5 tokens over 1 sequences exceeds the input buffers"):
        buffers.prepare([list(range(5))], [5], [0], [[0, 1]])
    with pytest.raises(ValueError, match="sequence 0 has 3 blocks; the buffers hold 2"):
        buffers.prepare([list(range(9))], [1], [8], [[0, 1, 2]])


def test_every_step_reads_its_inputs_from_the_same_memory():
    llm = LLM(kv_cache_memory=16 << 20, max_num_batched_tokens=64, block_size=4)  # the demo model
    runner = llm.engine.model_executor
    buffers = runner.inputs
    addresses: list[dict[str, int]] = []
    prepare = runner.prepare_inputs

    def recording_prepare(scheduler_output):
        inputs = prepare(scheduler_output)
        metadata = inputs.metadata
        addresses.append(
            {
                "input_ids": inputs.input_ids.data_ptr(),
                "positions": inputs.positions.data_ptr(),
                "slot_block_ids": metadata.slot_block_ids.data_ptr(),
                "slot_offsets": metadata.slot_offsets.data_ptr(),
                "block_tables": metadata.block_tables.data_ptr(),
                "token_seqs": metadata.token_seqs.data_ptr(),
                "query_starts": metadata.query_starts.data_ptr(),
                "context_lens": metadata.context_lens_tensor.data_ptr(),
            }
        )
        return inputs

    runner.prepare_inputs = recording_prepare
    # Chunked prefills (100-token prompts in 64-token steps), mixed steps and decodes of several sizes.
    prompts = [[(i * 7 + j) % 500 for j in range(length)] for i, length in enumerate([100, 3, 40, 9, 1])]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    llm.generate([{"prompt_token_ids": prompts[1]}], params)
    expected = {
        "input_ids": buffers.input_ids.device.data_ptr(),
        "positions": buffers.positions.device.data_ptr(),
        "slot_block_ids": buffers.slot_block_ids.device.data_ptr(),
        "slot_offsets": buffers.slot_offsets.device.data_ptr(),
        "block_tables": buffers.block_tables.device.data_ptr(),
        "token_seqs": buffers.token_seqs.device.data_ptr(),
        "query_starts": buffers.query_start_loc.device.data_ptr(),
        "context_lens": buffers.context_lens.device.data_ptr(),
    }
    assert len(addresses) > 15
    assert all(step == expected for step in addresses)
    # And the buffers' reuse changes nothing: the same prompts alone give the same tokens.
    alone = [llm.generate([{"prompt_token_ids": p}], params)[0] for p in prompts[:3]]
    assert [o.outputs[0].token_ids for o in alone] == [o.outputs[0].token_ids for o in first[:3]]
