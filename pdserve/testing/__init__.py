"""Helpers shared by the tests and the benchmarks (a bench must not import from tests/): ``fake_runner``
replaces the model with a deterministic function of the KV cache's contents; ``hf_models`` builds tiny
seeded Hugging Face models (the oracle); ``processes`` starts `pdserve` servers and waits for them;
``metrics`` reads a server's /metrics; ``scripted_runner`` is the real model runner with scripted logits;
``deferred`` is a pipelined in-process executor (async scheduling without worker processes); ``schemas``
holds JSON schemas for structured-output tests."""
