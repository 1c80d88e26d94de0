"""The roles of pdserve's processes, defined once: names, default ports, pod labels.

An engine is one codebase in one of three roles, and a role is configuration of that engine,
not a code tree of its own:

- ``colocated``: one engine prefills and decodes (no KV transfer); the baseline P/D is measured
  against, and the simplest way to serve.
- ``prefill``: computes a prompt's KV and holds the blocks for a decode engine to pull
  (``pdserve.kvtransfer.prefill_side``).
- ``decode``: pulls a prompt's KV from a prefill engine, then generates
  (``pdserve.kvtransfer.decode_side``).

Both P/D roles run the KV connector; the router decides per request which leg an engine serves
(``do_remote_decode`` makes a prefill leg, ``do_remote_prefill`` a decode leg). Only a prefill
engine hands its blocks to peers: a decode engine only pulls, so it refuses prefill legs and tells
no peer where its memory is (with NIXL, a peer holding an engine's agent metadata could read and
write all of it). The roles differ besides in their default port and pod label, which the CLI,
``pdserve serve``, the operator and the router's Kubernetes discovery all read from here.
The router is not an engine role, but its port and label live here too.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Role:
    name: str
    default_port: int  # of `pdserve <name>` and of the role's pods' containers
    kv_transfer: bool  # takes part in P/D KV transfers (runs the KV connector and transfer agent)
    serves_blocks: bool = False  # holds its blocks for peers to pull (serves prefill legs)


COLOCATED = Role("colocated", 8000, kv_transfer=False)
PREFILL = Role("prefill", 8100, kv_transfer=True, serves_blocks=True)
DECODE = Role("decode", 8200, kv_transfer=True)
ENGINE_ROLES = {role.name: role for role in (COLOCATED, PREFILL, DECODE)}
# The engine roles that run as separate pools behind a router.
POOL_ROLES = (PREFILL, DECODE)

ROUTER = "router"
ROUTER_PORT = 8000

# The label every pdserve pod carries, with its role's name (or "router") as value: the router's
# Kubernetes discovery finds engines by it, the operator's selectors and Services use it.
ROLE_LABEL = "pdserve.io/role"
# The side-channel port engines listen on in pods (fixed, so NetworkPolicies and Services can name it).
POD_KV_SIDE_CHANNEL_PORT = 5600


def engine_role(name: str) -> Role:
    """The engine role called ``name``; ValueError naming the valid ones otherwise."""
    try:
        return ENGINE_ROLES[name]
    except KeyError:
        raise ValueError(f"unknown engine role {name!r}; one of {', '.join(ENGINE_ROLES)}") from None
