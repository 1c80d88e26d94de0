"""``pdserve bench``: the load generator (``loadgen``) behind the serving benchmarks; ``pdserve profile``
(``profile``); timed KV pulls between processes, for the profile and bench/kv_transfer.py (``kv_pull``); and
a stranger's side-channel flood for tests and benchmarks (``flood``)."""
