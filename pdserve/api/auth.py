"""The cluster secret and what it authenticates (docs/faults.md, "Trust model").

One shared secret per deployment (a PDService's Secret, or the one ``pdserve serve`` makes for its
children) authenticates three things, each with its own key derived from it, so that a value
signed for one purpose is never accepted for another:

- ``side-channel``: every message between transfer agents (pdserve/kvtransfer/messages.py);
- ``router``: the router's P/D legs and release calls to engines (the ``X-PDServe-Router-Auth``
  header, :func:`sign_request` / :class:`RequestVerifier`): only the router may make an engine hold
  KV for others or pull KV from a peer;
- ``kv-events``: the KV-event stream an engine publishes for routers.

Each signed value carries the wall-clock time it was made and a random nonce; a receiver accepts
it within :data:`MAX_CLOCK_SKEW_S` of its own clock and only once (:class:`ReplayGuard`).

Without a secret nothing is authenticated; :func:`exposure_problem` allows that only on loopback
addresses, or when the operator of the process said ``--kv-insecure``.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets
import time
from collections import OrderedDict
from pathlib import Path

SECRET_ENV = "PDSERVE_KV_SECRET"
# The client API key of `pdserve` servers (`--api-key` reads it by default; the operator sets it from a Secret).
API_KEY_ENV = "PDSERVE_API_KEY"
MIN_SECRET_BYTES = 16
# How far a signed value's time may be from the receiver's clock (cluster clocks are NTP-synced).
MAX_CLOCK_SKEW_S = 30.0
# Nonces remembered per receiver: beyond this many fresh ones inside the window, new values are
# refused (fail closed) rather than forgetting nonces that could then be replayed.
MAX_REMEMBERED_NONCES = 1 << 18
NONCE_BYTES = 16

SIDE_CHANNEL = "side-channel"
ROUTER = "router"
KV_EVENTS = "kv-events"

ROUTER_AUTH_HEADER = "X-PDServe-Router-Auth"


class SecretError(ValueError):
    """The secret cannot be read or is unusable; the message says which and why."""


def read_secret(path: str | None = None) -> bytes | None:
    """The cluster secret from ``path`` (``--kv-secret-file``) or else the environment
    (``PDSERVE_KV_SECRET``); None when neither gives one. Surrounding whitespace is not part of it."""
    if path:
        try:
            value = Path(path).read_bytes().strip()
        except OSError as error:
            raise SecretError(f"cannot read the KV secret file {path}: {error.strerror or error}") from None
        source = path
    else:
        text = os.environ.get(SECRET_ENV, "").strip()
        if not text:
            return None
        value, source = text.encode(), f"${SECRET_ENV}"
    if len(value) < MIN_SECRET_BYTES:
        raise SecretError(f"the KV secret in {source} is {len(value)} bytes; at least {MIN_SECRET_BYTES} are needed")
    return value


def new_secret() -> str:
    """A fresh secret (64 hex characters)."""
    return secrets.token_hex(32)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def exposure_problem(component: str, hosts: list[str], secret: bytes | None, insecure: bool) -> str | None:
    """Why ``component`` must not start listening on ``hosts`` as configured, or None.

    Without a secret only loopback is allowed (one machine's processes trust each other), unless
    ``insecure`` (``--kv-insecure``) says the network is trusted by other means."""
    exposed = [host for host in hosts if not is_loopback(host)]
    if secret is not None or insecure or not exposed:
        return None
    return (
        f"{component}: listening on {', '.join(exposed)} without a KV secret would let anyone on that network "
        f"read and write the KV cache; give --kv-secret-file (or ${SECRET_ENV}), or --kv-insecure to accept that"
    )


class Signer:
    """HMAC-SHA256 with the key for one purpose (``side-channel``, ``router``, ``kv-events``)."""

    def __init__(self, secret: bytes, purpose: str) -> None:
        self._key = hmac.new(secret, b"pdserve/" + purpose.encode(), hashlib.sha256).digest()

    def sign(self, *parts: bytes) -> bytes:
        mac = hmac.new(self._key, digestmod=hashlib.sha256)
        for part in parts:  # length-prefixed: no two different part lists sign alike
            mac.update(len(part).to_bytes(8, "big"))
            mac.update(part)
        return mac.digest()

    def verify(self, mac: bytes, *parts: bytes) -> bool:
        return hmac.compare_digest(mac, self.sign(*parts))


class ReplayGuard:
    """Accepts each (time, nonce) once, and only within the clock-skew window."""

    def __init__(self, window: float = MAX_CLOCK_SKEW_S, capacity: int = MAX_REMEMBERED_NONCES) -> None:
        self.window = window
        self.capacity = capacity
        self._seen: OrderedDict[bytes, float] = OrderedDict()  # nonce -> when it may be forgotten

    def problem(self, sent_at: float, nonce: bytes, now: float | None = None) -> str | None:
        """None if fresh (and now remembered), else why it is refused."""
        now = time.time() if now is None else now
        if abs(now - sent_at) > self.window:
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


def _request_parts(sent_at: str, nonce: str, method: str, path: str, body: bytes) -> tuple[bytes, ...]:
    return sent_at.encode(), nonce.encode(), method.upper().encode(), path.encode(), body


def sign_request(signer: Signer, method: str, path: str, body: bytes, now: float | None = None) -> str:
    """The ``X-PDServe-Router-Auth`` value for one HTTP request: ``TIME NONCE MAC`` (hex), the MAC
    covering the method, the path and the exact body bytes."""
    sent_at = f"{time.time() if now is None else now:.6f}"
    nonce = secrets.token_hex(NONCE_BYTES)
    return f"{sent_at} {nonce} {signer.sign(*_request_parts(sent_at, nonce, method, path, body)).hex()}"


class RequestVerifier:
    """Checks ``X-PDServe-Router-Auth`` values on one engine (one replay guard per process)."""

    def __init__(self, secret: bytes) -> None:
        self.signer = Signer(secret, ROUTER)
        self.replays = ReplayGuard()

    def problem(self, header: str | None, method: str, path: str, body: bytes) -> str | None:
        """None if ``header`` proves the router made this request, else why not."""
        if not header:
            return "missing"
        try:
            sent_at, nonce, mac_hex = header.split(" ")
            mac = bytes.fromhex(mac_hex)
            when = float(sent_at)
        except ValueError:
            return "malformed"
        if not self.signer.verify(mac, *_request_parts(sent_at, nonce, method, path, body)):
            return "bad signature"
        return self.replays.problem(when, nonce.encode())
