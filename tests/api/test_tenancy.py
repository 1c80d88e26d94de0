"""The cache salt of a request (pdserve/api/tenancy.py): one per API key, a request's own cache_salt kept
inside its key's, and the key never in the salt; the block hashes routers and engines compute follow it."""

from __future__ import annotations

from pdserve.api.tenancy import request_cache_salt
from pdserve.engine.block_hash import hash_prompt_blocks


def test_each_api_key_is_its_own_salt_and_a_requests_salt_stays_inside_it():
    alice, bob = request_cache_salt("Bearer alice", None), request_cache_salt("Bearer bob", None)
    assert alice is not None and bob is not None and alice != bob
    assert request_cache_salt("Bearer alice", None) == alice
    assert "alice" not in alice
    assert request_cache_salt("Bearer alice", "s") != request_cache_salt("Bearer bob", "s")
    assert request_cache_salt("Bearer alice", "s").startswith(alice)
    assert request_cache_salt("Bearer bob", alice) != alice  # a salt text cannot reach another key's cache


def test_without_a_key_the_salt_is_the_requests_own():
    assert request_cache_salt(None, None) is None
    assert request_cache_salt(None, "s") == "s"
    assert request_cache_salt("Basic dXNlcg==", "s") == "s"  # not a bearer key: no tenant


def test_tenants_block_hashes_differ_for_the_same_tokens():
    tokens = list(range(64))
    alice = hash_prompt_blocks(tokens, 16, request_cache_salt("Bearer alice", None))
    bob = hash_prompt_blocks(tokens, 16, request_cache_salt("Bearer bob", None))
    assert not set(alice) & set(bob)
    assert alice == hash_prompt_blocks(tokens, 16, request_cache_salt("Bearer alice", None))


def test_a_tenant_the_router_names_is_the_salt_whatever_key_the_leg_carries():
    alpha = request_cache_salt("Bearer engine-key", None, "alpha")
    assert alpha == request_cache_salt("Bearer other-key", None, "alpha") == request_cache_salt(None, None, "alpha")
    assert alpha != request_cache_salt("Bearer engine-key", None, "beta")
    assert alpha != request_cache_salt("Bearer alpha", None)  # a key and a name never meet
    assert request_cache_salt(None, "s", "alpha").startswith(alpha)
