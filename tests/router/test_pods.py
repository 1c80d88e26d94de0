"""Pod choice: least-loaded, round-robin among ties, failed pods only when nothing healthy is left."""

from __future__ import annotations

from pdserve.router.pods import PodSet


def test_ties_go_round_robin():
    pods = PodSet("decode", ["http://a", "http://b/", "http://c"])
    assert [pods.choose().url for _ in range(6)] == ["http://a", "http://b", "http://c"] * 2


def test_least_loaded_wins():
    pods = PodSet("decode", ["http://a", "http://b", "http://c"])
    pods.pods[0].in_flight = 2
    pods.pods[1].in_flight = 1
    assert pods.choose().url == "http://c"
    pods.pods[2].in_flight = 3
    assert pods.choose().url == "http://b"


def test_unhealthy_pods_are_last_resort():
    pods = PodSet("prefill", ["http://a", "http://b"])
    assert pods.mark(pods.pods[0], False, "test")  # an ejection
    assert not pods.mark(pods.pods[0], False, "test")  # already out: not another one
    pods.pods[1].in_flight = 5
    assert {pods.choose().url for _ in range(4)} == {"http://b"}
    pods.mark(pods.pods[1], False, "test")
    assert pods.choose().url == "http://a"  # all down: still try, least loaded
    assert pods.choose(exclude=[pods.pods[0]]).url == "http://b"
    assert PodSet("decode", ["http://a"]).choose() is not None
    single = PodSet("decode", ["http://a"])
    assert single.choose(exclude=[single.pods[0]]) is None
    assert not pods.mark(pods.pods[0], True)  # back: not an ejection
    assert pods.any_healthy()
