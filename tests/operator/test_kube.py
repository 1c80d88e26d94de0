"""Create-or-patch against the emulated API server: creates once, writes only what differs."""

import base64

import kubernetes
import pytest

from pdserve.api.keys import new_bundle, rotate
from pdserve.operator import manifests
from pdserve.operator.kube import Kube, is_subset, without_nulls
from pdserve.operator.spec import with_defaults
from tests.operator.helpers import DEPLOYMENTS, PDPOOLS, SECRETS, spec


def test_is_subset_ignores_server_defaults_and_reads_null_as_absent():
    assert is_subset({"a": {"b": 1}}, {"a": {"b": 1, "c": 2}, "d": 3})
    assert is_subset({"a": [{"b": 1}]}, {"a": [{"b": 1, "defaulted": True}]})
    assert not is_subset({"a": [{"b": 1}]}, {"a": [{"b": 1}, {"b": 2}]})
    assert is_subset({"a": None}, {})
    assert not is_subset({"a": None}, {"a": 1})
    assert not is_subset({"a": 1}, {})


def test_without_nulls():
    assert without_nulls({"a": None, "b": [{"c": None, "d": 1}]}) == {"b": [{"d": 1}]}


@pytest.fixture()
def kube(kube_cluster):
    return Kube(kubernetes.client.ApiClient())


def deployment(namespace, image="pdserve:1", replicas=2):
    full = with_defaults(spec(image=image))
    objects = manifests.owned_objects("llm", namespace, full, {"prefill": replicas, "decode": 1})
    return next(obj for obj in objects if obj["kind"] == "Deployment" and obj["metadata"]["name"] == "llm-prefill")


def test_apply_creates_then_writes_nothing_when_unchanged(kube, kube_cluster, kube_namespace):
    created = kube.apply(deployment(kube_namespace))
    assert created["metadata"]["name"] == "llm-prefill"
    assert "nodeSelector" not in created["spec"]["template"]["spec"]  # nulls are not sent on create
    writes = len(kube_cluster.requests())
    again = kube.apply(deployment(kube_namespace))
    assert again["metadata"]["resourceVersion"] == created["metadata"]["resourceVersion"]
    assert [method for method, _ in kube_cluster.requests()[writes:]] == ["GET"]


def test_apply_patches_what_differs(kube, kube_cluster, kube_namespace):
    kube.apply(deployment(kube_namespace))
    kube.apply(deployment(kube_namespace, image="pdserve:2", replicas=5))
    stored = kube_cluster.get(DEPLOYMENTS, "llm-prefill", kube_namespace)
    assert stored["spec"]["template"]["spec"]["containers"][0]["image"] == "pdserve:2"
    assert stored["spec"]["replicas"] == 5


def test_create_only_fields_are_never_patched(kube, kube_cluster, kube_namespace):
    kube.apply(manifests.pool("llm", kube_namespace, "decode", 1), create_only=manifests.POOL_CREATE_ONLY)
    kube_cluster.patch(PDPOOLS, "llm-decode", {"spec": {"replicas": 4}}, kube_namespace)
    pool = manifests.pool("llm", kube_namespace, "decode", 1)
    pool["metadata"]["labels"]["extra"] = "yes"
    stored = kube.apply(pool, create_only=manifests.POOL_CREATE_ONLY)
    assert stored["spec"]["replicas"] == 4
    assert stored["metadata"]["labels"]["extra"] == "yes"


def test_the_kv_keys_are_never_patched(kube, kube_cluster, kube_namespace):
    def apply(bundle):
        secret = manifests.kv_keys("llm", kube_namespace, with_defaults(spec()), bundle)
        return kube.apply(secret, create_only=manifests.KV_KEYS_CREATE_ONLY)

    first = new_bundle()
    created = apply(first)
    assert base64.b64decode(created["data"]["engine.key"]).decode() == first["engine.key"]
    writes = len(kube_cluster.requests())
    assert apply(new_bundle())["metadata"]["resourceVersion"] == created["metadata"]["resourceVersion"]
    assert [method for method, _ in kube_cluster.requests()[writes:]] == ["GET"]
    # The user rotates them; the operator keeps their keys and still maintains the labels.
    rotated = {name: base64.b64encode(text.encode()).decode() for name, text in rotate(first, "add").items()}
    kube_cluster.patch(SECRETS, "llm-kv-keys", {"data": rotated}, kube_namespace)
    kube_cluster.patch(SECRETS, "llm-kv-keys", {"metadata": {"labels": {"pdserve.io/service": None}}}, kube_namespace)
    stored = apply(new_bundle())
    assert stored["data"] == rotated
    assert stored["metadata"]["labels"]["pdserve.io/service"] == "llm"


def test_get_returns_none_for_missing_objects(kube, kube_namespace):
    assert kube.get("Deployment", kube_namespace, "nothing") is None
    assert kube.get("PDPool", kube_namespace, "nothing") is None
