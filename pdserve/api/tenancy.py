"""Whose cached KV a request may share: the cache salt that every block hash of its prompt takes
(``engine.block_hash``), so prompts of different tenants never hit each other's blocks, in an engine's pool
or in any KV tier, even when their text is the same.

A tenant is named by the router (``TENANT_HEADER``, set by the router from its tenant table or a trusted gateway's
header, never passed on from a client) or else is the API key a request presents (``Authorization: Bearer ...``,
which the router then passes on to the engines unchanged): requests of the same tenant share cached blocks,
requests of different tenants never do. An engine takes the header from whoever reaches it: with an API key, only
holders of the key (the router) do. A request's own ``cache_salt`` (vLLM's field) divides its tenant's
cache further and never reaches into another tenant's: it is appended to the key's salt, not put in its
place. Without a key (a local deployment) the salt is the request's ``cache_salt`` alone, as in vLLM.

The router derives the same salt from the same header, so its prefix-cache predictions hash what the
engines hash. The key itself is not kept: the salt is a one-way digest of it.
"""

from __future__ import annotations

import hashlib

_BEARER = "Bearer "
TENANT_HEADER = "X-PDServe-Tenant"
# "1": the router's flow control found the request's tenant with nothing in flight while other tenants of its
# priority had requests in flight; an engine scheduling by priority runs it before the others of its priority
# (preempting one if it must). Set by the router (or the gateway's picker), never passed on from a client.
AHEAD_HEADER = "X-PDServe-Ahead"


def request_cache_salt(authorization: str | None, cache_salt: str | None, tenant: str | None = None) -> str | None:
    """The cache salt of a request that carries ``authorization`` (its header, or None), ``cache_salt`` and the
    router's ``tenant`` header (which wins over the key)."""
    if tenant is not None:
        digest = hashlib.sha256(b"pdserve-cache-named-tenant\0" + tenant.encode()).hexdigest()[:32]
    elif authorization is not None and authorization.startswith(_BEARER):
        digest = hashlib.sha256(b"pdserve-cache-tenant\0" + authorization[len(_BEARER) :].encode()).hexdigest()[:32]
    else:
        return cache_salt
    return f"tenant:{digest}" if cache_salt is None else f"tenant:{digest}:{cache_salt}"
