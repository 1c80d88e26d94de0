"""The cluster secret's primitives: reading it, who may run without it, HMAC keys per purpose, the replay guard,
and the router's signed requests."""

from __future__ import annotations

import pytest

from pdserve.api import auth
from pdserve.api.auth import ROUTER, SIDE_CHANNEL, ReplayGuard, RequestVerifier, Signer, sign_request
from pdserve.api.kv_events import EventSigner

SECRET = b"0123456789abcdef-cluster"


def test_secret_comes_from_the_file_first_then_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    assert auth.read_secret(None) is None
    monkeypatch.setenv(auth.SECRET_ENV, " from-the-environment-0001 \n")
    assert auth.read_secret(None) == b"from-the-environment-0001"
    path = tmp_path / "kv-secret"
    path.write_text(auth.new_secret() + "\n")
    assert auth.read_secret(str(path)) == path.read_bytes().strip() and len(auth.read_secret(str(path))) == 64


@pytest.mark.parametrize("content", ["", "short", "  \n"])
def test_a_short_secret_is_refused_with_its_source(tmp_path, content):
    path = tmp_path / "kv-secret"
    path.write_text(content)
    with pytest.raises(auth.SecretError, match=str(path)):
        auth.read_secret(str(path))


def test_a_missing_secret_file_is_a_clear_error(tmp_path):
    with pytest.raises(auth.SecretError, match="cannot read the KV secret file"):
        auth.read_secret(str(tmp_path / "absent"))


def test_only_loopback_runs_without_a_secret_unless_told_insecure():
    assert auth.exposure_problem("x", ["127.0.0.1", "::1", "localhost", "127.0.0.2"], None, False) is None
    problem = auth.exposure_problem("pdserve prefill", ["127.0.0.1", "0.0.0.0"], None, False)
    assert problem is not None and "0.0.0.0" in problem and "--kv-secret-file" in problem
    assert auth.exposure_problem("x", ["10.0.0.5", "pod.example"], None, True) is None
    assert auth.exposure_problem("x", ["10.0.0.5"], SECRET, False) is None
    assert auth.exposure_problem("x", ["engine.local"], None, False) is not None  # a name may resolve anywhere


def test_keys_differ_per_purpose_and_parts_are_unambiguous():
    side, router = Signer(SECRET, SIDE_CHANNEL), Signer(SECRET, ROUTER)
    assert side.sign(b"a") != router.sign(b"a")
    assert side.sign(b"ab", b"c") != side.sign(b"a", b"bc")
    assert side.verify(side.sign(b"x", b"y"), b"x", b"y")
    assert not side.verify(side.sign(b"x", b"y"), b"x", b"z")
    assert not Signer(b"another-secret-00000", SIDE_CHANNEL).verify(side.sign(b"x"), b"x")


def test_replay_guard_takes_each_nonce_once_and_only_when_fresh():
    guard = ReplayGuard(window=30.0, capacity=3)
    assert guard.problem(1000.0, b"n1", now=1000.0) is None
    assert guard.problem(1000.0, b"n1", now=1001.0) == "replayed"
    assert guard.problem(960.0, b"n2", now=1000.0) == "stale"
    assert guard.problem(1040.0, b"n2", now=1000.0) == "stale"  # from the future: a clock far off
    assert guard.problem(1000.0, b"n2", now=1000.0) is None
    assert guard.problem(1000.0, b"n3", now=1000.0) is None
    assert guard.problem(1000.0, b"n4", now=1000.0) == "too many"  # full: refused, never forgetting early
    # Once a nonce could no longer pass the time check it is forgotten, and room comes back.
    assert guard.problem(1100.0, b"n4", now=1100.0) is None
    assert guard.problem(1100.0, b"n4", now=1100.0) == "replayed"


def test_router_signature_covers_method_path_and_body_and_is_taken_once():
    signer, verifier = Signer(SECRET, ROUTER), RequestVerifier(SECRET)
    body = b'{"prompt":"hi","kv_transfer_params":{"do_remote_decode":true}}'
    header = sign_request(signer, "POST", "/v1/completions", body)
    assert verifier.problem(header, "POST", "/v1/chat/completions", body) == "bad signature"
    assert verifier.problem(header, "POST", "/v1/completions", body.replace(b"hi", b"ho")) == "bad signature"
    assert verifier.problem(header, "POST", "/v1/completions", body) is None
    assert verifier.problem(header, "POST", "/v1/completions", body) == "replayed"
    assert verifier.problem(None, "POST", "/v1/completions", body) == "missing"
    assert verifier.problem("garbage", "POST", "/v1/completions", body) == "malformed"
    assert verifier.problem("1 2 zz", "POST", "/v1/completions", body) == "malformed"
    other = sign_request(Signer(b"another-secret-00000", ROUTER), "POST", "/v1/completions", body)
    assert verifier.problem(other, "POST", "/v1/completions", body) == "bad signature"
    stale = sign_request(signer, "POST", "/v1/completions", body, now=1.0)
    assert verifier.problem(stale, "POST", "/v1/completions", body) == "stale"


def test_kv_events_are_taken_only_signed_fresh_and_whole():
    signer = EventSigner(SECRET)
    frames = signer.frames(b"batch")
    assert signer.batch(frames) == b"batch"
    assert signer.batch([b"batch"]) is None  # unsigned
    assert signer.batch([b"other", *frames[1:]]) is None
    assert EventSigner(b"another-secret-00000").batch(frames) is None
    assert signer.batch([b"batch", b"not a time", frames[2]]) is None
    old = EventSigner(SECRET)
    old_frames = [b"batch", b"1.0", old._signer.sign(b"batch", b"1.0")]
    assert signer.batch(old_frames) is None  # signed, but long ago
