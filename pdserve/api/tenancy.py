"""Whose cached KV a request may share: the cache salt that every block hash of its prompt takes
(``engine.block_hash``), so prompts of different tenants never hit each other's blocks, in an engine's pool
or in any KV tier, even when their text is the same.

Until tenants are named by a gateway, a tenant is the API key a request presents (``Authorization: Bearer
...``, which the router passes on to the engines unchanged): requests with the same key share cached blocks,
requests with different keys never do. A request's own ``cache_salt`` (vLLM's field) divides its tenant's
cache further and never reaches into another tenant's: it is appended to the key's salt, not put in its
place. Without a key (a local deployment) the salt is the request's ``cache_salt`` alone, as in vLLM.

The router derives the same salt from the same header, so its prefix-cache predictions hash what the
engines hash. The key itself is not kept: the salt is a one-way digest of it.
"""

from __future__ import annotations

import hashlib

_BEARER = "Bearer "


def request_cache_salt(authorization: str | None, cache_salt: str | None) -> str | None:
    """The cache salt of a request that carries ``authorization`` (its header, or None) and ``cache_salt``."""
    if authorization is None or not authorization.startswith(_BEARER):
        return cache_salt
    digest = hashlib.sha256(b"pdserve-cache-tenant\0" + authorization[len(_BEARER) :].encode()).hexdigest()[:32]
    return f"tenant:{digest}" if cache_salt is None else f"tenant:{digest}:{cache_salt}"
