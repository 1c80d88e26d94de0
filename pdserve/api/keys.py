"""The deployment's key material: which keys exist, who holds which, and how they are made and rotated.

A deployment's keys live in one folder (``--kv-keys DIR``, env ``PDSERVE_KV_KEYS``; the operator mounts
the items of one Secret there), one file a key kind:

- ``router.key``: the router's Ed25519 signing key. Held by routers only: it signs the P/D legs and release
  calls that make an engine hold KV for others or pull from a peer.
- ``router.pub``: its public half. Held by engines, which can check the router's signature but not make one.
- ``engine.key``: the engines' side-channel key (HMAC-SHA256). Held by engines only: transfer agents seal
  every side-channel message with it.
- ``events.key``: the KV-event key (HMAC-SHA256), held by engines (to sign their KV-event streams) and
  routers (to check them).

So a router holds ``router.key`` and ``events.key`` (:data:`ROUTER_FILES`), an engine ``router.pub``,
``engine.key`` and ``events.key`` (:data:`ENGINE_FILES`); no engine can sign as the router.

A file holds one key a line (hex; ``#`` starts a comment). The first line's key signs; every line's key is
accepted. That is how keys roll over without a dropped request (:func:`rotate`): ``add`` appends a new key
everywhere (still accepted only), ``promote`` makes it the one that signs once every process accepts it,
``retire`` drops the old one once every process signs with the new. Processes re-read a file that changed
(Kubernetes updates a mounted Secret in place), so none restarts.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Generic, TypeVar

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

logger = logging.getLogger(__name__)

KEYS_ENV = "PDSERVE_KV_KEYS"
ROUTER_KEY = "router.key"
ROUTER_PUB = "router.pub"
ENGINE_KEY = "engine.key"
EVENTS_KEY = "events.key"
ROUTER_FILES = (ROUTER_KEY, EVENTS_KEY)
ENGINE_FILES = (ROUTER_PUB, ENGINE_KEY, EVENTS_KEY)
ALL_FILES = (ROUTER_KEY, ROUTER_PUB, ENGINE_KEY, EVENTS_KEY)
SECRET_FILES = (ROUTER_KEY, ENGINE_KEY, EVENTS_KEY)  # readable by their owner only
KEY_BYTES = 32
# How often a process looks at a key file for a new version (a rollover step waits longer than this).
RELOAD_INTERVAL_S = 2.0
ROTATION_STEPS = ("add", "promote", "retire")

K = TypeVar("K")


class KeyFileError(ValueError):
    """A key folder or file is missing, unreadable or malformed; the message says which and why."""


def _hex_key(text: str, path: Path, line: int) -> bytes:
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise KeyFileError(f"{path}:{line}: not a hex key") from None
    if len(key) != KEY_BYTES:
        raise KeyFileError(f"{path}:{line}: a key is {KEY_BYTES} bytes ({2 * KEY_BYTES} hex digits), not {len(key)}")
    return key


def _key_lines(path: Path) -> list[bytes]:
    try:
        text = path.read_text()
    except OSError as error:
        raise KeyFileError(f"cannot read the key file {path}: {error.strerror or error}") from None
    keys = [
        _hex_key(content, path, number)
        for number, line in enumerate(text.splitlines(), 1)
        if (content := line.split("#", 1)[0].strip())
    ]
    if not keys:
        raise KeyFileError(f"{path}: no key in it")
    return keys


class KeyRing(Generic[K]):
    """The keys of one file: ``current`` signs, each of ``accepted`` is accepted. Re-reads the file when it
    changed (at most every :data:`RELOAD_INTERVAL_S`); a version that fails to parse is logged and the previous
    keys stay. Thread-safe."""

    def __init__(self, keys: Sequence[K], path: Path | None = None, parse: Callable[[bytes], K] | None = None) -> None:
        if not keys:
            raise KeyFileError("a key ring needs at least one key")
        self._keys: tuple[K, ...] = tuple(keys)
        self._path = path
        self._parse = parse
        self._stamp = self._stat() if path is not None else None
        self._next_check = time.monotonic() + RELOAD_INTERVAL_S
        self._lock = threading.Lock()

    @classmethod
    def load(cls, path: Path, parse: Callable[[bytes], K]) -> KeyRing[K]:
        return cls([parse(key) for key in _key_lines(path)], path, parse)

    def _stat(self) -> tuple[int, int, int] | None:
        assert self._path is not None
        try:
            stat = self._path.stat()
        except OSError:
            return None
        return stat.st_mtime_ns, stat.st_size, stat.st_ino

    def _refresh(self) -> None:
        if self._path is None or self._parse is None:
            return
        now = time.monotonic()
        if now < self._next_check:
            return
        with self._lock:
            if now < self._next_check:
                return
            self._next_check = now + RELOAD_INTERVAL_S
            stamp = self._stat()
            if stamp == self._stamp or stamp is None:
                return
            self._stamp = stamp
            try:
                self._keys = tuple(self._parse(key) for key in _key_lines(self._path))
            except (KeyFileError, ValueError) as error:  # a broken file: keep what works until it is mended
                logger.error(
                    "key file %s changed but cannot be used (%s): keeping its previous keys", self._path, error
                )
                return
            logger.info("key file %s: %d key(s) loaded", self._path, len(self._keys))

    @property
    def current(self) -> K:
        self._refresh()
        return self._keys[0]

    @property
    def accepted(self) -> tuple[K, ...]:
        self._refresh()
        return self._keys


def _private(key: bytes) -> Ed25519PrivateKey:
    return Ed25519PrivateKey.from_private_bytes(key)


def _public(key: bytes) -> Ed25519PublicKey:
    return Ed25519PublicKey.from_public_bytes(key)


def _raw(key: bytes) -> bytes:
    return key


def public_hex(private_key: bytes) -> str:
    """The hex public half of a hex-decoded Ed25519 private key."""
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    return _private(private_key).public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()


def load_router_signing(folder: str | Path) -> KeyRing[Ed25519PrivateKey]:
    return KeyRing.load(_file(folder, ROUTER_KEY), _private)


def load_router_public(folder: str | Path) -> KeyRing[Ed25519PublicKey]:
    return KeyRing.load(_file(folder, ROUTER_PUB), _public)


def load_secret(folder: str | Path, name: str) -> KeyRing[bytes]:
    """``engine.key`` or ``events.key`` of ``folder``."""
    return KeyRing.load(_file(folder, name), _raw)


def _file(folder: str | Path, name: str) -> Path:
    return Path(folder) / name


def check_folder(folder: str | Path, names: Sequence[str], component: str) -> None:
    """Raise KeyFileError unless ``folder`` holds every key file ``names`` (well formed)."""
    path = Path(folder)
    if not path.is_dir():
        raise KeyFileError(
            f"{component}: the key folder {folder} does not exist (make one with `pdserve keys {folder}`)"
        )
    missing = [name for name in names if not (path / name).exists()]
    if missing:
        raise KeyFileError(f"{component}: {folder} lacks {', '.join(missing)} (a {component} needs {', '.join(names)})")
    for name in names:
        _key_lines(path / name)


def new_bundle() -> dict[str, str]:
    """Fresh contents for every key file (file name -> text)."""
    router = secrets.token_bytes(KEY_BYTES)
    return {
        ROUTER_KEY: router.hex() + "\n",
        ROUTER_PUB: public_hex(router) + "\n",
        ENGINE_KEY: secrets.token_hex(KEY_BYTES) + "\n",
        EVENTS_KEY: secrets.token_hex(KEY_BYTES) + "\n",
    }


def write_bundle(folder: str | Path, contents: dict[str, str], names: Sequence[str] = ALL_FILES) -> None:
    """Write key files ``names`` of ``contents`` into ``folder`` (made if missing), each atomically (a reader
    sees the old or the new file, never half of one); secret ones readable by their owner only."""
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    for name in names:
        target = path / name
        temporary = path / f".{name}.{os.getpid()}.tmp"
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if name in SECRET_FILES else 0o644)
        with os.fdopen(descriptor, "w") as handle:
            handle.write(contents[name])
        os.replace(temporary, target)


def read_bundle(folder: str | Path) -> dict[str, str]:
    return {name: (Path(folder) / name).read_text() for name in ALL_FILES}


def rotate(contents: dict[str, str], step: str) -> dict[str, str]:
    """One step of a rollover over every key file's contents (see the module's docstring)."""
    if step not in ROTATION_STEPS:
        raise ValueError(f"a rotation step is one of {', '.join(ROTATION_STEPS)}, not {step!r}")
    lines = {name: [line.split("#", 1)[0].strip() for line in contents[name].splitlines()] for name in ALL_FILES}
    lines = {name: [line for line in keys if line] for name, keys in lines.items()}
    pairs = list(zip(lines[ROUTER_KEY], lines[ROUTER_PUB], strict=False))
    if len(lines[ROUTER_KEY]) != len(lines[ROUTER_PUB]) or any(
        public_hex(bytes.fromhex(private)) != public for private, public in pairs
    ):
        raise ValueError("router.pub is not line for line the public half of router.key")
    if step == "add":
        fresh = new_bundle()
        for name in ALL_FILES:
            lines[name].append(fresh[name].strip())
    elif step == "promote":
        for name in ALL_FILES:
            lines[name] = [lines[name][-1], *lines[name][:-1]]
    else:
        for name in ALL_FILES:
            lines[name] = lines[name][:1]
    return {name: "\n".join(keys) + "\n" for name, keys in lines.items()}
