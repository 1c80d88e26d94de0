"""The emulated API server's fixes over plain kmock, as the operator and router tests rely on them."""

import threading

import kubernetes
import pytest

from tests.operator.kmock_cluster import ApiError, wait_for
from tests.operator.kmock_emulator import matches, parse_selector


def pod(name, **labels):
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {"containers": [{"name": "c", "image": "i"}]},
    }


@pytest.mark.parametrize(
    ("selector", "labels", "expected"),
    [
        ("a=1,b!=2", {"a": "1", "b": "3"}, True),
        ("a=1,b!=2", {"a": "1", "b": "2"}, False),
        ("a==1", {"a": "1"}, True),
        ("a in (1, 2),!c", {"a": "2"}, True),
        ("a notin (1,2)", {"a": "1"}, False),
        ("a", {}, False),
        ("!a", {}, True),
    ],
)
def test_selectors(selector, labels, expected):
    assert matches(parse_selector(selector), labels) is expected


def test_create_stamps_metadata_and_generate_name(kube_cluster, kube_namespace):
    created = kube_cluster.create("v1/pods", pod("p1"), kube_namespace)
    meta = created["metadata"]
    assert meta["namespace"] == kube_namespace and meta["uid"] and meta["creationTimestamp"]
    event = {"apiVersion": "v1", "kind": "Event", "metadata": {"generateName": "e-"}, "reason": "X"}
    first = kube_cluster.create("v1/events", event, kube_namespace)
    second = kube_cluster.create("v1/events", event, kube_namespace)
    assert first["metadata"]["name"].startswith("e-") and first["metadata"]["name"] != second["metadata"]["name"]


def test_status_is_written_through_the_subresource_only(kube_cluster, kube_namespace):
    kube_cluster.create("v1/pods", {**pod("p1"), "status": {"phase": "Running"}}, kube_namespace)
    assert "status" not in kube_cluster.get("v1/pods", "p1", kube_namespace)
    kube_cluster.patch(
        "v1/pods", "p1", {"status": {"phase": "Running"}, "spec": {"x": 1}}, kube_namespace, subresource="status"
    )
    stored = kube_cluster.get("v1/pods", "p1", kube_namespace)
    assert stored["status"] == {"phase": "Running"} and "x" not in stored["spec"]


def test_noop_patches_keep_the_resource_version(kube_cluster, kube_namespace):
    created = kube_cluster.create("v1/pods", pod("p1", app="x"), kube_namespace)
    same = kube_cluster.patch("v1/pods", "p1", {"metadata": {"labels": {"app": "x"}}}, kube_namespace)
    assert same["metadata"]["resourceVersion"] == created["metadata"]["resourceVersion"]
    changed = kube_cluster.patch("v1/pods", "p1", {"metadata": {"labels": {"app": "y"}}}, kube_namespace)
    assert int(changed["metadata"]["resourceVersion"]) > int(created["metadata"]["resourceVersion"])


def test_failed_json_patch_test_is_422_and_custom_resources_are_validated(kube_cluster, kube_namespace):
    kube_cluster.create("v1/pods", pod("p1"), kube_namespace)
    with pytest.raises(ApiError) as failed:
        kube_cluster.patch(
            "v1/pods", "p1", [{"op": "test", "path": "/metadata/resourceVersion", "value": "0"}], kube_namespace
        )
    assert failed.value.status == 422
    pool = {
        "apiVersion": "pdserve.io/v1alpha1",
        "kind": "PDPool",
        "metadata": {"name": "x"},
        "spec": {"service": "s", "role": "router", "replicas": 1},
    }
    with pytest.raises(ApiError) as invalid:
        kube_cluster.create("pdserve.io/v1alpha1/pdpools", pool, kube_namespace)
    assert invalid.value.status == 422 and "router" in invalid.value.body


def test_kubernetes_client_lists_and_watches_by_label_from_a_resource_version(kube_cluster, kube_namespace):
    core = kubernetes.client.CoreV1Api()
    kube_cluster.create("v1/pods", pod("old", app="llm"), kube_namespace)
    kube_cluster.create("v1/pods", pod("other", app="web"), kube_namespace)
    listed = core.list_namespaced_pod(kube_namespace, label_selector="app=llm")
    assert [p.metadata.name for p in listed.items] == ["old"]
    seen = []

    def watch():
        stream = kubernetes.watch.Watch().stream(
            core.list_namespaced_pod,
            kube_namespace,
            label_selector="app=llm",
            resource_version=listed.metadata.resource_version,
            timeout_seconds=1,
        )
        seen.extend((event["type"], event["object"].metadata.name) for event in stream)

    watcher = threading.Thread(target=watch)
    watcher.start()
    wait_for(lambda: any(m == "GET" and "watch=true" in p for m, p in kube_cluster.requests()))
    kube_cluster.create("v1/pods", pod("new", app="llm"), kube_namespace)
    kube_cluster.create("v1/pods", pod("ignored", app="web"), kube_namespace)
    kube_cluster.patch("v1/pods", "new", {"status": {"phase": "Running"}}, kube_namespace, subresource="status")
    kube_cluster.delete("v1/pods", "old", kube_namespace)
    watcher.join(5)  # the server ends the watch after timeoutSeconds
    assert not watcher.is_alive()
    assert seen == [("ADDED", "new"), ("MODIFIED", "new"), ("DELETED", "old")]
