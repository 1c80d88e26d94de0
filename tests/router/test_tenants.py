"""The tenant table (pdserve/router/tenants.py): keys name tenants, a trusted header may instead, priorities are
clamped into each tenant's range, and a bad table is refused at start, saying why."""

from __future__ import annotations

import hashlib
import json

import pytest

from pdserve.api.protocol import ProtocolError
from pdserve.router.tenants import OTHER, PriorityRange, Tenants, parse_priority_range

TABLE = {
    "tenants": {
        "alpha": {"keys": ["sk-alpha"], "priority": {"default": 0, "min": -5, "max": 5}, "weight": 2},
        "beta": {"key_sha256": [hashlib.sha256(b"sk-beta").hexdigest()], "requests_per_minute": 60},
    }
}


def _load(tmp_path, table, header=None, suffix=".json"):
    path = tmp_path / f"tenants{suffix}"
    path.write_text(json.dumps(table))
    return Tenants.load(str(path), header, PriorityRange())


def test_keys_name_tenants_and_unknown_keys_are_401(tmp_path):
    tenants = _load(tmp_path, TABLE)
    assert tenants.identify({"Authorization": "Bearer sk-alpha"}).name == "alpha"
    assert tenants.identify({"Authorization": "Bearer sk-beta"}).name == "beta"  # by its digest
    for headers in ({}, {"Authorization": "Bearer sk-gamma"}, {"Authorization": "sk-alpha"}):
        with pytest.raises(ProtocolError) as refused:
            tenants.identify(headers)
        assert refused.value.status == 401
    # A client's own tenant header means nothing when keys name tenants.
    assert tenants.identify({"Authorization": "Bearer sk-beta", "X-Tenant": "alpha"}).name == "beta"


def test_priorities_are_clamped_into_the_tenants_range(tmp_path):
    alpha = _load(tmp_path, TABLE).identify({"Authorization": "Bearer sk-alpha"})
    assert [alpha.clamp(p) for p in (None, -(10**9), -5, 3, 10**9)] == [0, -5, -5, 3, 5]
    beta = _load(tmp_path, TABLE).identify({"Authorization": "Bearer sk-beta"})
    assert beta.clamp(-100) == 0  # no range given: priority 0 only


def test_a_trusted_header_names_tenants_and_unlisted_ones_get_the_default_entry(tmp_path):
    tenants = _load(tmp_path, {**TABLE, "default": {"max_queued": 4}}, header="X-Tenant", suffix=".yaml")
    assert tenants.identify({"X-Tenant": "alpha"}).label == "alpha"
    other = tenants.identify({"X-Tenant": "someone"})
    assert (other.name, other.label, other.spec.max_queued) == ("someone", OTHER, 4)
    with pytest.raises(ProtocolError) as refused:
        tenants.identify({"Authorization": "Bearer sk-alpha"})  # the header is what names tenants now
    assert refused.value.status == 401
    strict = _load(tmp_path, TABLE, header="X-Tenant")
    with pytest.raises(ProtocolError) as refused:
        strict.identify({"X-Tenant": "someone"})
    assert refused.value.status == 403


def test_without_a_table_there_is_one_tenant_with_the_configured_range():
    tenants = Tenants.load(None, None, parse_priority_range("-10:10"))
    tenant = tenants.identify({})
    assert tenant.name == "default" and tenant.clamp(-99) == -10 and tenant.clamp(None) == 0
    assert parse_priority_range("2:7").default == 2
    for text in ("7:2", "a:b", "5"):
        with pytest.raises(ValueError, match="priority-range"):
            parse_priority_range(text)


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"tenants": {"a": {"keys": ["k"], "weight": 0}}}, "weight"),
        ({"tenants": {"a": {"keys": ["k"], "priority": {"default": 9, "min": 0, "max": 5}}}}, "priority"),
        ({"tenants": {"a": {"keys": ["k"]}, "b": {"keys": ["k"]}}}, "also"),
        ({"tenants": {"a": {"keys": ["k"], "requests_per_minute": -1}}}, "requests_per_minute"),
        ({"tenants": {"a": {"key_sha256": ["abc"]}}}, "64 hex"),
        ({"tenants": {"a": {"keys": ["k"], "colour": "red"}}}, "colour"),
        ({"tenants": {"a": {}}}, "no keys"),
    ],
)
def test_a_bad_table_is_refused_saying_why(tmp_path, table, message):
    with pytest.raises(ValueError, match=message):
        _load(tmp_path, table)
