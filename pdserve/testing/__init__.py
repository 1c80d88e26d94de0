"""Stand-ins shared by the tests and the benchmarks (a bench must not import from tests/):
``fake_runner`` replaces the model with a deterministic function of the KV cache's contents."""
