"""The deployment's keys and what they authenticate (pdserve/api/keys.py, pdserve/api/auth.py): key folders and
their rollover, the exposure rule, HMAC parts, the replay guard, the router's Ed25519 signature and its leg MAC
(X25519 between router and engine, under a delegation the router signs), each bound to its target engine, and
KV-event signatures."""

from __future__ import annotations

import os
import time

import pytest

from pdserve.api import auth, keys
from pdserve.api.auth import KV_EVENTS, SIDE_CHANNEL, ReplayGuard, RouterSigner, RouterVerifier, Signer
from pdserve.api.kv_events import EventSigner


@pytest.fixture
def bundle(tmp_path):
    keys.write_bundle(tmp_path, keys.new_bundle())
    return tmp_path


def _ring(value: bytes) -> keys.KeyRing[bytes]:
    return keys.KeyRing([value])


def test_a_key_folder_holds_each_kind_of_key_and_secret_ones_are_private(bundle):
    assert sorted(os.listdir(bundle)) == sorted(keys.ALL_FILES)
    for name in keys.SECRET_FILES:
        assert os.stat(bundle / name).st_mode & 0o077 == 0, f"{name} is readable by others"
    keys.check_folder(bundle, keys.ENGINE_FILES, "engine")
    keys.check_folder(bundle, keys.ROUTER_FILES, "router")
    # The router's public key is the public half of its signing key.
    private = keys.load_router_signing(bundle).current
    public = keys.load_router_public(bundle).current
    public.verify(private.sign(b"m"), b"m")


def test_a_folder_missing_a_roles_key_or_holding_a_bad_one_is_refused_with_its_name(tmp_path):
    bundle = keys.new_bundle()
    keys.write_bundle(tmp_path, bundle, keys.ROUTER_FILES)  # a router's folder
    keys.check_folder(tmp_path, keys.ROUTER_FILES, "router")
    with pytest.raises(keys.KeyFileError, match=r"router\.pub, engine\.key"):
        keys.check_folder(tmp_path, keys.ENGINE_FILES, "pdserve decode")
    (tmp_path / "events.key").write_text("not hex\n")
    with pytest.raises(keys.KeyFileError, match=r"events\.key:1: not a hex key"):
        keys.check_folder(tmp_path, keys.ROUTER_FILES, "router")
    (tmp_path / "events.key").write_text("abcd\n")
    with pytest.raises(keys.KeyFileError, match="32 bytes"):
        keys.check_folder(tmp_path, keys.ROUTER_FILES, "router")
    with pytest.raises(keys.KeyFileError, match="does not exist"):
        keys.check_folder(tmp_path / "absent", keys.ROUTER_FILES, "router")


def test_a_rollover_keeps_the_old_and_the_new_key_valid_until_its_last_step(bundle, monkeypatch):
    monkeypatch.setattr(keys, "RELOAD_INTERVAL_S", 0.0)  # read the files at every use
    ring = keys.load_secret(bundle, keys.ENGINE_KEY)
    old = ring.current
    keys.write_bundle(bundle, keys.rotate(keys.read_bundle(bundle), "add"))
    assert ring.current == old and len(ring.accepted) == 2  # the new key is accepted, not used yet
    new = ring.accepted[1]
    keys.write_bundle(bundle, keys.rotate(keys.read_bundle(bundle), "promote"))
    assert ring.current == new and ring.accepted == (new, old)
    keys.write_bundle(bundle, keys.rotate(keys.read_bundle(bundle), "retire"))
    assert ring.accepted == (new,)
    # The router's pair stays line for line.
    private, public = keys.load_router_signing(bundle).accepted, keys.load_router_public(bundle).accepted
    assert len(private) == len(public) == 1
    public[0].verify(private[0].sign(b"m"), b"m")
    with pytest.raises(ValueError, match="rotation step"):
        keys.rotate(keys.read_bundle(bundle), "rewind")


def test_a_broken_key_file_keeps_the_keys_that_worked(bundle, monkeypatch):
    monkeypatch.setattr(keys, "RELOAD_INTERVAL_S", 0.0)
    ring = keys.load_secret(bundle, keys.EVENTS_KEY)
    before = ring.accepted
    (bundle / keys.EVENTS_KEY).write_text("half a key\n")
    assert ring.accepted == before


def test_only_loopback_runs_without_keys_unless_told_insecure():
    assert auth.exposure_problem("x", ["127.0.0.1", "::1", "localhost", "127.0.0.2"], False, False) is None
    problem = auth.exposure_problem("pdserve prefill", ["127.0.0.1", "0.0.0.0"], False, False)
    assert problem is not None and "0.0.0.0" in problem and "--kv-keys" in problem
    assert auth.exposure_problem("x", ["10.0.0.5", "pod.example"], False, True) is None
    assert auth.exposure_problem("x", ["10.0.0.5"], True, False) is None
    assert auth.exposure_problem("x", ["engine.local"], False, False) is not None  # a name may resolve anywhere


def test_macs_differ_per_purpose_and_parts_are_unambiguous():
    key = _ring(b"k" * 32)
    side, events = Signer(key, SIDE_CHANNEL), Signer(key, KV_EVENTS)
    assert side.sign(b"a") != events.sign(b"a")
    assert side.sign(b"ab", b"c") != side.sign(b"a", b"bc")
    assert side.verify(side.sign(b"x", b"y"), b"x", b"y")
    assert not side.verify(side.sign(b"x", b"y"), b"x", b"z")
    assert not Signer(_ring(b"o" * 32), SIDE_CHANNEL).verify(side.sign(b"x"), b"x")
    # During a rollover a MAC made with any accepted key verifies; the current key makes new ones.
    both = Signer(keys.KeyRing([b"n" * 32, b"k" * 32]), SIDE_CHANNEL)
    assert both.verify(side.sign(b"x"), b"x") and both.sign(b"x") != side.sign(b"x")


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


def test_a_router_signature_covers_method_path_body_and_its_engine_and_is_taken_once(bundle):
    signer = RouterSigner(keys.load_router_signing(bundle))
    verifier = RouterVerifier(keys.load_router_public(bundle), "engine-a")
    body = b'{"prompt":"hi","kv_transfer_params":{"do_remote_decode":true}}'
    header = signer.header("POST", "/v1/completions", body, "engine-a")
    assert verifier.problem(header, "POST", "/v1/chat/completions", body) == "bad signature"
    assert verifier.problem(header, "POST", "/v1/completions", body.replace(b"hi", b"ho")) == "bad signature"
    # Signed for engine-a, presented to engine-b (or to a restart of engine-a, which has a new id): refused there.
    # (Before dbd1dc4's successor, a captured leg replayed against any other engine was taken.)
    assert (
        RouterVerifier(keys.load_router_public(bundle), "engine-b").problem(header, "POST", "/v1/completions", body)
        == auth.WRONG_TARGET
    )
    sent_at, nonce, _, signature = header.split(" ")
    retargeted = f"{sent_at} {nonce} engine-b {signature}"  # the target edited: the signature no longer holds
    assert (
        RouterVerifier(keys.load_router_public(bundle), "engine-b").problem(retargeted, "POST", "/v1/completions", body)
        == "bad signature"
    )
    assert verifier.problem(header, "POST", "/v1/completions", body) is None
    assert verifier.problem(header, "POST", "/v1/completions", body) == "replayed"
    assert verifier.problem(None, "POST", "/v1/completions", body) == "missing"
    assert verifier.problem("garbage", "POST", "/v1/completions", body) == "malformed"
    assert verifier.problem("1 2 engine-a zz", "POST", "/v1/completions", body) == "malformed"
    stale = signer.header("POST", "/v1/completions", body, "engine-a", now=1.0)
    assert verifier.problem(stale, "POST", "/v1/completions", body) == "stale"


def test_an_engine_holds_nothing_that_signs_as_the_router(tmp_path):
    # Before, one secret in every pod derived the router's key too: any engine could sign router legs.
    bundle = keys.new_bundle()
    engine_folder, other = tmp_path / "engine", tmp_path / "other"
    keys.write_bundle(engine_folder, bundle, keys.ENGINE_FILES)
    keys.write_bundle(other, keys.new_bundle())
    assert not (engine_folder / keys.ROUTER_KEY).exists()
    verifier = RouterVerifier(keys.load_router_public(engine_folder), "engine-a")
    body = b'{"kv_transfer_params":{"do_remote_decode":true}}'
    # Everything an engine has, tried as a signing key: the side-channel and event keys as Ed25519 seeds, and
    # another deployment's router key.
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    candidates = [
        Ed25519PrivateKey.from_private_bytes(keys.load_secret(engine_folder, name).current)
        for name in (keys.ENGINE_KEY, keys.EVENTS_KEY)
    ] + [keys.load_router_signing(other).current]
    for candidate in candidates:
        header = RouterSigner(keys.KeyRing([candidate])).header("POST", "/v1/completions", body, "engine-a")
        assert verifier.problem(header, "POST", "/v1/completions", body) == "bad signature"


def test_a_leg_mac_covers_what_a_signature_does_and_only_its_engine_can_check_it(bundle):
    signer = RouterSigner(keys.load_router_signing(bundle))
    verifier = RouterVerifier(keys.load_router_public(bundle), "engine-a")
    other = RouterVerifier(keys.load_router_public(bundle), "engine-b")
    body = b'{"prompt":"hi","kv_transfer_params":{"do_remote_decode":true}}'
    path = "/v1/completions"
    header = signer.leg_header("POST", path, body, "engine-a", verifier.leg_key)
    assert len(header.split(" ")) == 5  # a MAC and the router's delegation of its leg key, not a signature
    assert verifier.problem(header, "POST", "/v1/chat/completions", body) == "bad MAC"
    assert verifier.problem(header, "POST", path, body.replace(b"hi", b"ho")) == "bad MAC"
    assert other.problem(header, "POST", path, body) == auth.WRONG_TARGET
    sent_at, nonce, _, mac, delegation = header.split(" ")
    # Retargeted at engine-b: engine-b's MAC key is another (X25519 with its own leg key), so it fails there.
    assert other.problem(f"{sent_at} {nonce} engine-b {mac} {delegation}", "POST", path, body) == "bad MAC"
    # A decode engine cannot check (nor forward as checked) a MAC made for a prefill engine.
    assert other.made_for_another(header, "POST", path, body) == "a leg MAC, which only its target can check"
    assert verifier.problem(header, "POST", path, body) is None
    assert verifier.problem(header, "POST", path, body) == "replayed"
    stale = signer.leg_header("POST", path, body, "engine-a", verifier.leg_key, now=1.0)
    assert verifier.problem(stale, "POST", path, body) == "stale"
    # The next leg reuses the checked delegation; a second router run delegates its own leg key.
    assert signer.leg_header("POST", path, body, "engine-a", verifier.leg_key).split(" ")[4] == delegation
    second = RouterSigner(keys.load_router_signing(bundle))
    assert (
        verifier.problem(second.leg_header("POST", path, body, "engine-a", verifier.leg_key), "POST", path, body)
        is None
    )
    # No leg key known (an engine before leg keys), or not a key: an Ed25519 signature, which every engine checks.
    for leg_key in (None, "", "zz", "00" * 31):
        fallback = signer.leg_header("POST", path, body, "engine-a", leg_key)
        assert len(fallback.split(" ")) == 4
        assert verifier.problem(fallback, "POST", path, body) is None


def test_a_delegation_is_taken_only_signed_by_the_router_unexpired_and_short(bundle, tmp_path):
    verifier = RouterVerifier(keys.load_router_public(bundle), "engine-a")
    body, path = b"{}", "/v1/completions"
    # Another deployment's router key (or an engine's secrets as a seed) cannot delegate a leg key to an engine.
    foreign = tmp_path / "foreign"
    keys.write_bundle(foreign, keys.new_bundle())
    impostor = RouterSigner(keys.load_router_signing(foreign))
    assert verifier.problem(
        impostor.leg_header("POST", path, body, "engine-a", verifier.leg_key), "POST", path, body
    ) == ("bad delegation")
    signer = RouterSigner(keys.load_router_signing(bundle))
    sent_at, nonce, target, mac, delegation = signer.leg_header(
        "POST", path, body, "engine-a", verifier.leg_key
    ).split()
    leg_key, expires_at, signature = delegation.split(",")
    for edited, why in (
        (f"{leg_key},{int(expires_at) - 60},{signature}", "bad delegation"),  # its expiry edited: the signature fails
        (f"{'11' * 32},{expires_at},{signature}", "bad delegation"),  # another leg key under the router's name
        (f"{leg_key},{expires_at}", "malformed delegation"),
        (f"{leg_key},soon,{signature}", "malformed delegation"),
    ):
        assert verifier.problem(f"{sent_at} {nonce} {target} {mac} {edited}", "POST", path, body) == why
    # Expired, or valid for longer than engines take: refused however well signed (the leg's own time is made
    # fresh: the delegation is checked before the MAC).
    now = time.time()
    for made_at, why in (
        (now - auth.DELEGATION_S - 2 * auth.MAX_CLOCK_SKEW_S, "delegation expired"),
        (now + 2 * auth.DELEGATION_S, "delegation valid for too long"),
    ):
        fields = (
            RouterSigner(keys.load_router_signing(bundle))
            .leg_header("POST", path, body, "engine-a", verifier.leg_key, now=made_at)
            .split(" ")
        )
        fields[0] = f"{now:.6f}"
        assert verifier.problem(" ".join(fields), "POST", path, body) == why
    # A router renews its delegation before it ends.
    renewing = RouterSigner(keys.load_router_signing(bundle))
    early = renewing.leg_header("POST", path, body, "engine-a", verifier.leg_key, now=now).split(" ")[4]
    later = now + auth.DELEGATION_S * 0.8
    assert renewing.leg_header("POST", path, body, "engine-a", verifier.leg_key, now=later).split(" ")[4] != early


def test_a_router_key_rotation_renews_the_delegation_and_a_retired_key_delegates_no_more(bundle, monkeypatch):
    monkeypatch.setattr(keys, "RELOAD_INTERVAL_S", 0.0)
    signer = RouterSigner(keys.load_router_signing(bundle))
    verifier = RouterVerifier(keys.load_router_public(bundle), "engine-a")
    body, path = b"{}", "/v1/completions"
    first = signer.leg_header("POST", path, body, "engine-a", verifier.leg_key)
    assert verifier.problem(first, "POST", path, body) is None
    for step in ("add", "promote"):
        keys.write_bundle(bundle, keys.rotate(keys.read_bundle(bundle), step))
    second = signer.leg_header("POST", path, body, "engine-a", verifier.leg_key)
    assert second.split(" ")[4] != first.split(" ")[4]  # delegated again under the promoted key
    assert verifier.problem(second, "POST", path, body) is None
    keys.write_bundle(bundle, keys.rotate(keys.read_bundle(bundle), "retire"))
    # A leg still carrying the old key's delegation (made before the retirement) is refused once it is retired.
    old = first.split(" ")
    replayable = signer.leg_header("POST", path, body, "engine-a", verifier.leg_key).split(" ")
    assert verifier.problem(" ".join([*replayable[:4], old[4]]), "POST", path, body) == "bad delegation"


def test_kv_events_are_taken_only_signed_fresh_and_whole():
    signer = EventSigner(_ring(b"e" * 32))
    frames = signer.frames(b"batch")
    assert signer.batch(frames) == b"batch"
    assert signer.batch([b"batch"]) is None  # unsigned
    assert signer.batch([b"other", *frames[1:]]) is None
    assert EventSigner(_ring(b"o" * 32)).batch(frames) is None
    assert signer.batch([b"batch", b"not a time", frames[2]]) is None
    old_frames = [b"batch", b"1.0", signer._signer.sign(b"batch", b"1.0")]
    assert signer.batch(old_frames) is None  # signed, but long ago
    assert abs(float(frames[1]) - time.time()) < 5
