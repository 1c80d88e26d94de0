"""Status computation: pool summaries, the Ready condition and its transition time, PDPool status."""

from pdserve.operator import status

DESIRED = {"router": 1, "prefill": 2, "decode": 1}


def test_pools_and_router_url():
    got = status.service_status("llm", "ns", [], DESIRED, {"router": 1, "prefill": 1, "decode": 0}, {})
    assert got["pools"]["prefill"] == {"replicas": 2, "readyReplicas": 1, "summary": "1/2"}
    assert got["pools"]["decode"]["summary"] == "0/1"
    assert got["routerURL"] == "http://llm-router.ns.svc:8000"
    (ready,) = got["conditions"]
    assert (ready["type"], ready["status"], ready["reason"]) == ("Ready", "False", "PoolsNotReady")
    assert ready["message"] == "waiting for ready pods: prefill 1/2, decode 0/1"


def test_ready_when_every_wanted_pod_is_ready_and_empty_pools_do_not_count():
    got = status.service_status("llm", "ns", [], {**DESIRED, "decode": 0}, {"router": 1, "prefill": 2, "decode": 0}, {})
    assert got["conditions"][0]["status"] == "True"
    assert got["conditions"][0]["reason"] == "AllPoolsReady"


def test_an_invalid_spec_is_not_ready_whatever_runs():
    got = status.service_status("llm", "ns", ["spec.image is required"], DESIRED, DESIRED, {})
    assert got["conditions"][0]["status"] == "False"
    assert got["conditions"][0]["reason"] == "InvalidSpec"
    assert got["conditions"][0]["message"] == "spec.image is required"


def test_transition_time_moves_only_when_the_status_flips():
    old = {"conditions": [{"type": "Ready", "status": "False", "lastTransitionTime": "2020-01-01T00:00:00Z"}]}
    same = status.service_status("llm", "ns", [], DESIRED, {"router": 0, "prefill": 0, "decode": 0}, old)
    assert same["conditions"][0]["lastTransitionTime"] == "2020-01-01T00:00:00Z"
    flipped = status.service_status("llm", "ns", [], DESIRED, DESIRED, old)
    assert flipped["conditions"][0]["lastTransitionTime"] != "2020-01-01T00:00:00Z"


def test_pool_status_is_what_the_scale_subresource_reads():
    deployment = {"status": {"replicas": 3, "readyReplicas": 2}}
    assert status.pool_status("llm", "decode", deployment) == {
        "replicas": 3,
        "readyReplicas": 2,
        "selector": "app.kubernetes.io/instance=llm,pdserve.io/role=decode",
    }
    assert status.pool_status("llm", "decode", None)["replicas"] == 0
