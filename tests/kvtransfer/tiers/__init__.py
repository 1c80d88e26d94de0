import pdserve  # noqa: F401  (before any test module imports torch: pdserve sets OpenMP's environment first)
