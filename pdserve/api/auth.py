"""What the deployment's keys (pdserve/api/keys.py) authenticate, and how (docs/faults.md, "Trust model").

- The router's P/D legs and release calls to engines: the ``X-PDServe-Router-Auth`` header
  (:class:`RouterSigner` / :class:`RouterVerifier`) over the method, the path, the body's digest, the time, a
  nonce and the **target engine's id**, in one of two forms:

  - a **leg MAC** (what the router sends an engine whose leg key it knows): HMAC-SHA256 with a key only the
    router and that engine can compute, X25519 between the router's leg key (made at its start) and the
    engine's (made at its start, told in its /health), plus the router's **delegation** of its leg key: an
    Ed25519 signature with ``router.key`` over that key and an expiry, checked once per engine and cached. An
    engine cannot make another engine's MAC key (it lacks both private halves), so it cannot act as the router
    towards a peer; a router told a wrong engine key (a forged /health) makes MACs no real engine accepts.
    Why: an Ed25519 signature per leg cost ~40 µs on the router and ~100 µs on the engine, a third of the
    router's CPU per P/D request; an HMAC costs a few.
  - an **Ed25519 signature** of the same message with ``router.key``: for an engine whose leg key the router
    does not know yet, and for what another party must check before it forwards it (a picker's prefill leg,
    which the decode engine checks and sends on: :meth:`RouterVerifier.made_for_another`).

  A leg made for one engine is refused by every other (a restarted engine has a new id and a new leg key).
- Peer reads of held blocks (pdserve/kvtransfer/served.py): a capability the router mints
  (:meth:`RouterSigner.capability`), an Ed25519 signature over the reading engine's id, the holding engine's
  id, the hold's handle and an expiry, which the holder checks (:func:`capability_problem`).
- Side-channel messages between transfer agents (pdserve/kvtransfer/messages.py) and KV-event batches
  (pdserve/api/kv_events.py): HMAC-SHA256 (:class:`Signer`) with ``engine.key`` and ``events.key``, each
  signed value naming its receiver or its publisher.

Each signed value carries the wall-clock time it was made and a nonce (random; the router's legs: its run's
random prefix and a count); a receiver accepts it within :data:`MAX_CLOCK_SKEW_S` of its own clock and only
once (:class:`ReplayGuard`).

Without keys nothing is authenticated; :func:`exposure_problem` allows that only on loopback addresses, or
when the operator of the process said ``--kv-insecure``.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import itertools
import secrets
import time
from collections import OrderedDict

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

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
_ROUTER_LEG = ROUTER_LEG.encode()
PREFIX_READ = "prefix-read"
# The longest a peer-read capability may be valid for (an older or longer one is refused).
MAX_CAPABILITY_S = 300.0

ROUTER_AUTH_HEADER = "X-PDServe-Router-Auth"
LEG_KEY = "leg-key"
LEG_MAC = "leg-mac"
# How long a router's delegation of its leg key is valid (it makes a new one a quarter before the end, and on a
# rotation of router.key); engines refuse a longer one.
DELEGATION_S = 3600.0
# Delegations an engine keeps verified (routers, and their renewals); beyond it the oldest is checked again.
MAX_DELEGATIONS = 64
# MAC keys a router keeps (one per engine run it sent legs to); beyond it they are derived again.
MAX_LEG_KEYS = 4096
# What an engine answers to a leg signed for another engine (or a previous run of itself): 403, the error's
# ``type``, with its own id in ENGINE_ID_HEADER; the router then signs for that id, once.
WRONG_TARGET = "router_auth_target"
ENGINE_ID_HEADER = "X-PDServe-Engine-Id"
ENGINE_LEG_KEY_HEADER = "X-PDServe-Engine-Leg-Key"  # beside ENGINE_ID_HEADER: that run's leg key (hex)


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
    framed: list[bytes] = []
    for part in parts:  # a loop, not a generator: this frames every leg the router sends
        framed.append(len(part).to_bytes(8, "big"))
        framed.append(part)
    return b"".join(framed)


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
        _ROUTER_LEG,
        sent_at.encode(),
        nonce.encode(),
        method.upper().encode(),
        path.encode(),
        target.encode(),
        digest,
    )


def _raw_public(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes_raw()


def _delegation_message(leg_key: bytes, expires_at: int) -> bytes:
    return _framed(LEG_KEY.encode(), leg_key, str(expires_at).encode())


def _mac_key(shared: bytes, router_leg_key: bytes, engine_leg_key: bytes) -> bytes:
    """The MAC key of one (router run, engine run) pair from their X25519 secret."""
    return hashlib.sha256(_framed(LEG_MAC.encode(), shared, router_leg_key, engine_leg_key)).digest()


class RouterSigner:
    """The router's side of ``X-PDServe-Router-Auth``: leg MACs for engines whose leg key it was told,
    Ed25519 signatures otherwise."""

    def __init__(self, keys: KeyRing[Ed25519PrivateKey]) -> None:
        self.keys = keys
        self._leg_key = X25519PrivateKey.generate()
        self._leg_key_public = _raw_public(self._leg_key)
        self._delegation: tuple[str, float, Ed25519PrivateKey] | None = None  # (value, expires_at, signed with)
        # Engine leg key (hex) -> HMAC keyed with the MAC key (copied per leg: the key's pads are hashed once).
        self._macs: OrderedDict[str, hmac.HMAC | None] = OrderedDict()
        # Nonces need only be unique (the time and the MAC bind them): this run's random prefix and a count, which
        # spares a read of the system's randomness per leg.
        self._nonce_prefix = secrets.token_hex(NONCE_BYTES // 2)
        self._nonce_count = itertools.count()

    def _nonce(self) -> str:
        return f"{self._nonce_prefix}{next(self._nonce_count):016x}"

    def header(self, method: str, path: str, body: bytes, target: str, now: float | None = None) -> str:
        """``TIME NONCE TARGET SIGNATURE``: an Ed25519 signature for one HTTP request to the engine whose id is
        ``target``, which anyone with ``router.pub`` can check."""
        sent_at = f"{time.time() if now is None else now:.6f}"
        nonce = self._nonce()
        signature = self.keys.current.sign(_leg_message(sent_at, nonce, method, path, target, body))
        return f"{sent_at} {nonce} {target} {signature.hex()}"

    def leg_header(
        self, method: str, path: str, body: bytes, target: str, leg_key: str | None, now: float | None = None
    ) -> str:
        """``TIME NONCE TARGET MAC DELEGATION`` for the engine ``target`` whose leg key (its /health's) is
        ``leg_key``; :meth:`header`'s signature where that is None or not a key."""
        keyed = self._mac(leg_key) if leg_key else None
        if keyed is None:
            return self.header(method, path, body, target, now)
        now = time.time() if now is None else now
        sent_at = f"{now:.6f}"
        nonce = self._nonce()
        mac = keyed.copy()
        mac.update(_leg_message(sent_at, nonce, method, path, target, body))
        return f"{sent_at} {nonce} {target} {mac.hexdigest()} {self._delegated(now)}"

    def _mac(self, leg_key: str) -> hmac.HMAC | None:
        if leg_key in self._macs:
            return self._macs[leg_key]
        try:
            engine_leg_key = bytes.fromhex(leg_key)
            shared = self._leg_key.exchange(X25519PublicKey.from_public_bytes(engine_leg_key))
            keyed: hmac.HMAC | None = hmac.new(
                _mac_key(shared, self._leg_key_public, engine_leg_key), digestmod=hashlib.sha256
            )
        except ValueError:  # not a key, or one of the few points whose secret is all zeros
            keyed = None
        if len(self._macs) >= MAX_LEG_KEYS:
            self._macs.popitem(last=False)
        self._macs[leg_key] = keyed
        return keyed

    def _delegated(self, now: float) -> str:
        """``LEGKEY,EXPIRES,SIGNATURE``: this run's leg key, signed with the current router.key."""
        current = self.keys.current
        made = self._delegation
        if made is None or made[2] is not current or made[1] - now < DELEGATION_S / 4:
            expires_at = int(now + DELEGATION_S)
            signature = current.sign(_delegation_message(self._leg_key_public, expires_at))
            value = f"{self._leg_key_public.hex()},{expires_at},{signature.hex()}"
            made = self._delegation = (value, expires_at, current)
        return made[0]

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
    """Checks ``X-PDServe-Router-Auth`` values on the engine whose id is ``engine_id`` (one replay guard and one
    leg key a process: :attr:`leg_key`, told in /health, is this run's)."""

    def __init__(self, keys: KeyRing[Ed25519PublicKey], engine_id: str) -> None:
        self.keys = keys
        self.engine_id = engine_id
        self.replays = ReplayGuard()
        self._leg_key = X25519PrivateKey.generate()
        self._leg_key_public = _raw_public(self._leg_key)
        self.leg_key = self._leg_key_public.hex()
        # Delegations checked against the accepted router keys of ``_checked_with`` -> (MAC key, expires_at).
        self._delegations: OrderedDict[str, tuple[bytes, int]] = OrderedDict()
        self._checked_with: tuple[Ed25519PublicKey, ...] = ()

    def problem(self, header: str | None, method: str, path: str, body: bytes) -> str | None:
        """None if ``header`` proves the router made this request for this engine, else why not (the
        :data:`WRONG_TARGET` reason when it was made for another)."""
        parsed = _parse_leg_header(header)
        if isinstance(parsed, str):
            return parsed
        sent_at, nonce, target, proof, delegation = parsed
        if target != self.engine_id:
            return WRONG_TARGET
        if delegation is None:
            problem = self._signature_problem(sent_at, nonce, target, proof, method, path, body)
        else:
            problem = self._mac_problem(sent_at, nonce, target, proof, delegation, method, path, body)
        return problem or self.replays.problem(float(sent_at), nonce.encode())

    def made_for_another(self, header: str | None, method: str, path: str, body: bytes) -> str | None:
        """None if ``header`` proves the router made this request, recently, for whichever engine it names (which
        checks it again, and takes its nonce): a decode engine asked to send a prefill leg the picker signed
        sends only what the router made. Else why not (a leg MAC proves nothing to any engine but its target)."""
        parsed = _parse_leg_header(header)
        if isinstance(parsed, str):
            return parsed
        sent_at, nonce, target, signature, delegation = parsed
        if delegation is not None:
            return "a leg MAC, which only its target can check"
        return self._signature_problem(sent_at, nonce, target, signature, method, path, body)

    def _signature_problem(
        self, sent_at: str, nonce: str, target: str, signature: bytes, method: str, path: str, body: bytes
    ) -> str | None:
        if self.replays.stale(float(sent_at)):
            return "stale"
        message = _leg_message(sent_at, nonce, method, path, target, body)
        if not any(_valid(key, signature, message) for key in self.keys.accepted):
            return "bad signature"
        return None

    def _mac_problem(
        self, sent_at: str, nonce: str, target: str, mac: bytes, delegation: str, method: str, path: str, body: bytes
    ) -> str | None:
        now = time.time()
        if self.replays.stale(float(sent_at), now):
            return "stale"
        delegated = self._delegated(delegation, now)
        if isinstance(delegated, str):
            return delegated
        expected = hmac.new(delegated, _leg_message(sent_at, nonce, method, path, target, body), hashlib.sha256)
        if not hmac.compare_digest(mac, expected.digest()):
            return "bad MAC"
        return None

    def _delegated(self, delegation: str, now: float) -> bytes | str:
        """The MAC key of the router run that ``delegation`` names, or why there is none."""
        accepted = self.keys.accepted
        if accepted is not self._checked_with:  # router.pub changed (a rotation): check every delegation again
            self._delegations.clear()
            self._checked_with = accepted
        known = self._delegations.get(delegation)
        if known is not None:
            return known[0] if known[1] + MAX_CLOCK_SKEW_S >= now else "delegation expired"
        try:
            leg_key_hex, expires_text, signature_hex = delegation.split(",")
            router_leg_key, expires_at = bytes.fromhex(leg_key_hex), int(expires_text)
            signature = bytes.fromhex(signature_hex)
            router_public = X25519PublicKey.from_public_bytes(router_leg_key)
        except ValueError:
            return "malformed delegation"
        if expires_at + MAX_CLOCK_SKEW_S < now:
            return "delegation expired"
        if expires_at > now + DELEGATION_S + MAX_CLOCK_SKEW_S:
            return "delegation valid for too long"
        message = _delegation_message(router_leg_key, expires_at)
        if not any(_valid(key, signature, message) for key in accepted):
            return "bad delegation"
        try:
            shared = self._leg_key.exchange(router_public)
        except ValueError:
            return "bad delegation"
        mac_key = _mac_key(shared, router_leg_key, self._leg_key_public)
        if len(self._delegations) >= MAX_DELEGATIONS:
            self._delegations.popitem(last=False)
        self._delegations[delegation] = (mac_key, expires_at)
        return mac_key


def _parse_leg_header(header: str | None) -> tuple[str, str, str, bytes, str | None] | str:
    """(time, nonce, target, signature or MAC, delegation: None for a signature) of an
    ``X-PDServe-Router-Auth`` value, or why it is none."""
    if not header:
        return "missing"
    fields = header.split(" ")
    if len(fields) not in (4, 5):
        return "malformed"
    try:
        proof = bytes.fromhex(fields[3])
        float(fields[0])
    except ValueError:
        return "malformed"
    return fields[0], fields[1], fields[2], proof, fields[4] if len(fields) == 5 else None


def _valid(key: Ed25519PublicKey, signature: bytes, message: bytes) -> bool:
    try:
        key.verify(signature, message)
    except InvalidSignature:
        return False
    return True
