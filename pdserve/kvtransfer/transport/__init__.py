"""Transports: how a decode engine's blocks get filled from a prefill engine's memory.

- ``base``: the ``Transport`` every one implements, and the cache seen as blocks of bytes;
  ``cache_layout``: where each KV head lies inside a block;
- ``nixl``: NIXL READs straight from the prefill's registered memory (where ``nixl_policy`` finds it safe);
- ``tcp``: the bytes on the side channel, copied out by the prefill's agent after it checks the hold;
- ``registry``: the table of transports by name (importable without torch or NIXL) and ``make_transport``.
"""
