"""What the deployment's keys (pdserve/api/keys.py) authenticate, and how (docs/faults.md, "Trust model").

- The router's P/D legs and release calls to engines: the ``X-PDServe-Router-Auth`` header
  (:class:`RouterSigner` / :class:`RouterVerifier`), an Ed25519 signature with the router's key over the
  method, the path, the body's digest, the time, a nonce and the **target engine's id**. An engine checks it
  with the router's public key: it cannot sign a leg itself, and a leg signed for one engine is refused by
  every other (a restarted engine has a new id).
- Peer reads of held blocks (pdserve/kvtransfer/served.py): a capability the router mints
  (:meth:`RouterSigner.capability`), an Ed25519 signature over the reading engine's id, the holding engine's
  id, the hold's handle and an expiry, which the holder checks (:func:`capability_problem`).
- Side-channel messages between transfer agents (pdserve/kvtransfer/messages.py) and KV-event batches
  (pdserve/api/kv_events.py): HMAC-SHA256 (:class:`Signer`) with ``engine.key`` and ``events.key``, each
  signed value naming its receiver or its publisher.

Each signed value carries the wall-clock time it was made and a random nonce; a receiver accepts it within
:data:`MAX_CLOCK_SKEW_S` of its own clock and only once (:class:`ReplayGuard`).

Without keys nothing is authenticated; :func:`exposure_problem` allows that only on loopback addresses, or
when the operator of the process said ``--kv-insecure``.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
import time
from collections import OrderedDict

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from pdserve.api.keys import KeyRing

# The client API key of `pdserve` servers (`--api-key` reads it by default; the operator sets it from a Secret).
API_KEY_ENV = "PDSERVE_API_KEY"
# How far a signed value's time may be from the receiver's clock (cluster clocks are NTP-synced).
MAX_CLOCK_SKEW_S = 30.0
# Nonces remembered per receiver: beyond this many fresh ones inside the window, new values are
# refused (fail closed) rather than forgetting nonces that could then be replayed.
MAX_REMEMBERED_NONCES = 1 << 18
NONCE_BYTES = 16

SIDE_CHANNEL = "side-channel"
KV_EVENTS = "kv-events"
ROUTER_LEG = "router-leg"
PREFIX_READ = "prefix-read"
# The longest a peer-read capability may be valid for (an older or longer one is refused).
MAX_CAPABILITY_S = 300.0

ROUTER_AUTH_HEADER = "X-PDServe-Router-Auth"
# What an engine answers to a leg signed for another engine (or a previous run of itself): 403, the error's
# ``type``, with its own id in ENGINE_ID_HEADER; the router then signs for that id, once.
WRONG_TARGET = "router_auth_target"
ENGINE_ID_HEADER = "X-PDServe-Engine-Id"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def exposure_problem(component: str, hosts: list[str], keyed: bool, insecure: bool) -> str | None:
    """Why ``component`` must not start listening on ``hosts`` as configured, or None.

    Without keys only loopback is allowed (one machine's processes trust each other), unless ``insecure``
    (``--kv-insecure``) says the network is trusted by other means."""
    exposed = [host for host in hosts if not is_loopback(host)]
    if keyed or insecure or not exposed:
        return None
    return (
        f"{component}: listening on {', '.join(exposed)} without keys would let anyone on that network "
        f"read and write the KV cache; give --kv-keys DIR (make one with `pdserve keys DIR`), or --kv-insecure "
        f"to accept that"
    )


def _framed(*parts: bytes) -> bytes:
    """Length-prefixed parts: no two different part lists frame alike."""
    return b"".join(len(part).to_bytes(8, "big") + part for part in parts)


class Signer:
    """HMAC-SHA256 with one key file's keys, for one purpose (``side-channel``, ``kv-events``): the current
    key signs, every accepted key verifies (a rollover)."""

    def __init__(self, keys: KeyRing[bytes], purpose: str) -> None:
        self.keys = keys
        self._purpose = b"pdserve/" + purpose.encode()

    def _mac(self, key: bytes, parts: tuple[bytes, ...]) -> bytes:
        return hmac.new(key, self._purpose + _framed(*parts), hashlib.sha256).digest()

    def sign(self, *parts: bytes) -> bytes:
        return self._mac(self.keys.current, parts)

    def verify(self, mac: bytes, *parts: bytes) -> bool:
        return any(hmac.compare_digest(mac, self._mac(key, parts)) for key in self.keys.accepted)


class ReplayGuard:
    """Accepts each (time, nonce) once, and only within the clock-skew window."""

    def __init__(self, window: float = MAX_CLOCK_SKEW_S, capacity: int = MAX_REMEMBERED_NONCES) -> None:
        self.window = window
        self.capacity = capacity
        self._seen: OrderedDict[bytes, float] = OrderedDict()  # nonce -> when it may be forgotten

    def stale(self, sent_at: float, now: float | None = None) -> bool:
        """Outside the window (checked before anything costly: a stale value is refused unverified)."""
        return abs((time.time() if now is None else now) - sent_at) > self.window

    def problem(self, sent_at: float, nonce: bytes, now: float | None = None) -> str | None:
        """None if fresh (and now remembered), else why it is refused."""
        now = time.time() if now is None else now
        if self.stale(sent_at, now):
            return "stale"  # or a clock far off
        while self._seen and next(iter(self._seen.values())) <= now:
            self._seen.popitem(last=False)
        if nonce in self._seen:
            return "replayed"
        if len(self._seen) >= self.capacity:
            return "too many"
        # Kept until it could no longer pass the time check; times only grow, so the order holds.
        self._seen[nonce] = now + 2 * self.window
        return None


def _leg_message(sent_at: str, nonce: str, method: str, path: str, target: str, body: bytes) -> bytes:
    digest = hashlib.sha256(body).digest()
    return _framed(
        ROUTER_LEG.encode(),
        sent_at.encode(),
        nonce.encode(),
        method.upper().encode(),
        path.encode(),
        target.encode(),
        digest,
    )


class RouterSigner:
    """The router's side of ``X-PDServe-Router-Auth``."""

    def __init__(self, keys: KeyRing[Ed25519PrivateKey]) -> None:
        self.keys = keys

    def header(self, method: str, path: str, body: bytes, target: str, now: float | None = None) -> str:
        """``TIME NONCE TARGET SIGNATURE`` for one HTTP request to the engine whose id is ``target``."""
        sent_at = f"{time.time() if now is None else now:.6f}"
        nonce = secrets.token_hex(NONCE_BYTES)
        signature = self.keys.current.sign(_leg_message(sent_at, nonce, method, path, target, body))
        return f"{sent_at} {nonce} {target} {signature.hex()}"

    def capability(self, reader: str, holder: str, handle: str, expires_at: float) -> str:
        """Let engine ``reader`` read what engine ``holder`` holds under ``handle``, until ``expires_at``."""
        return self.keys.current.sign(_capability_message(reader, holder, handle, expires_at)).hex()


def _capability_message(reader: str, holder: str, handle: str, expires_at: float) -> bytes:
    return _framed(PREFIX_READ.encode(), reader.encode(), holder.encode(), handle.encode(), repr(expires_at).encode())


def capability_problem(
    keys: KeyRing[Ed25519PublicKey] | None,
    capability: str,
    reader: str,
    holder: str,
    handle: str,
    expires_at: float,
    now: float | None = None,
) -> str | None:
    """None if the router let ``reader`` read ``holder``'s hold ``handle`` until ``expires_at`` (and that is not
    past, nor too far ahead), else why not. Without keys (``keys`` None) only the times are checked."""
    now = time.time() if now is None else now
    if expires_at + MAX_CLOCK_SKEW_S < now:
        return "expired"
    if expires_at > now + MAX_CAPABILITY_S + MAX_CLOCK_SKEW_S:
        return "valid for too long"
    if keys is None:
        return None
    try:
        signature = bytes.fromhex(capability)
    except ValueError:
        return "malformed"
    message = _capability_message(reader, holder, handle, expires_at)
    if not any(_valid(key, signature, message) for key in keys.accepted):
        return "bad signature"
    return None


class RouterVerifier:
    """Checks ``X-PDServe-Router-Auth`` values on the engine whose id is ``engine_id`` (one replay guard a
    process)."""

    def __init__(self, keys: KeyRing[Ed25519PublicKey], engine_id: str) -> None:
        self.keys = keys
        self.engine_id = engine_id
        self.replays = ReplayGuard()

    def problem(self, header: str | None, method: str, path: str, body: bytes) -> str | None:
        """None if ``header`` proves the router made this request for this engine, else why not (the
        :data:`WRONG_TARGET` reason when it was made for another)."""
        parsed = _parse_leg_header(header)
        if isinstance(parsed, str):
            return parsed
        sent_at, nonce, target, signature = parsed
        if target != self.engine_id:
            return WRONG_TARGET
        problem = self._signature_problem(sent_at, nonce, target, signature, method, path, body)
        return problem or self.replays.problem(float(sent_at), nonce.encode())

    def made_for_another(self, header: str | None, method: str, path: str, body: bytes) -> str | None:
        """None if ``header`` proves the router made this request, recently, for whichever engine it names (which
        checks it again, and takes its nonce): a decode engine asked to send a prefill leg the picker signed
        sends only what the router made. Else why not."""
        parsed = _parse_leg_header(header)
        if isinstance(parsed, str):
            return parsed
        return self._signature_problem(*parsed, method, path, body)

    def _signature_problem(
        self, sent_at: str, nonce: str, target: str, signature: bytes, method: str, path: str, body: bytes
    ) -> str | None:
        if self.replays.stale(float(sent_at)):
            return "stale"
        message = _leg_message(sent_at, nonce, method, path, target, body)
        if not any(_valid(key, signature, message) for key in self.keys.accepted):
            return "bad signature"
        return None


def _parse_leg_header(header: str | None) -> tuple[str, str, str, bytes] | str:
    """(time, nonce, target, signature) of an ``X-PDServe-Router-Auth`` value, or why it is none."""
    if not header:
        return "missing"
    try:
        sent_at, nonce, target, signature_hex = header.split(" ")
        signature = bytes.fromhex(signature_hex)
        float(sent_at)
    except ValueError:
        return "malformed"
    return sent_at, nonce, target, signature


def _valid(key: Ed25519PublicKey, signature: bytes, message: bytes) -> bool:
    try:
        key.verify(signature, message)
    except InvalidSignature:
        return False
    return True
