"""``pdserve bench``: the load generator (``loadgen``) behind the serving benchmarks."""
