"""Who sends a request, and what that tenant may ask for: the tenant table (``--tenants FILE``, JSON or YAML, e.g. a
mounted Secret), the API keys that name tenants, the trusted gateway header that may name them instead
(``--tenant-header``), and the priority range each tenant may use.

A tenant is known by one of two things, never by what a client says of itself:

- an API key (``Authorization: Bearer KEY``) listed under a tenant (``keys``, or ``key_sha256``: the key's
  SHA-256 in hex, so the file need not hold the key). An unknown or missing key is a 401.
- with ``--tenant-header NAME``, that header, which only a gateway in front of the router may set: the gateway
  authenticates clients and must strip the header from what clients send (docs/kubernetes.md). The router then
  checks ``--api-key`` (the gateway's), not tenant keys. A name the table lacks gets the table's ``default``
  entry, counted as ``other`` in metrics; without a ``default`` entry it is a 403.

Without a table (and without the header) there is one tenant, ``default``, whose priority range is
``--priority-range``. A request's ``priority`` (vLLM's field: lower first) is clamped into its tenant's range, so
a self-assigned -10**9 gets the tenant's best, never more; a request without one gets the tenant's default.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import msgspec

from pdserve.api.protocol import ProtocolError

DEFAULT_TENANT = "default"
OTHER = "other"  # the metrics' label of tenants the table does not list
_BEARER = "Bearer "


class PriorityRange(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    default: int = 0
    min: int = 0
    max: int = 0


class TenantSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """One tenant's entry in the table."""

    keys: list[str] = []
    key_sha256: list[str] = []
    weight: float = 1.0  # its share of the fleet under saturation, against the others of its priority
    priority: PriorityRange = PriorityRange()
    requests_per_minute: float | None = None  # the whole deployment's: each router replica applies its share
    tokens_per_minute: float | None = None  # prompt + output tokens, likewise
    max_queued: int = 256  # requests it may have waiting in one router replica
    queue_timeout: float | None = None  # seconds one of its requests may wait for the fleet before a 429


class TenantsFile(msgspec.Struct, forbid_unknown_fields=True):
    tenants: dict[str, TenantSpec]
    default: TenantSpec | None = None  # for names a trusted gateway sends that the table lacks


@dataclass(frozen=True)
class Tenant:
    """A request's tenant: ``name`` is its flow (fairness and limits); ``label`` what metrics call it."""

    name: str
    label: str
    spec: TenantSpec

    def clamp(self, priority: int | None) -> int:
        bounds = self.spec.priority
        if priority is None:
            return bounds.default
        return min(max(priority, bounds.min), bounds.max)


def _check(name: str, spec: TenantSpec) -> None:
    if not spec.weight > 0:
        raise ValueError(f"tenant {name!r}: weight must be > 0, got {spec.weight}")
    bounds = spec.priority
    if not bounds.min <= bounds.default <= bounds.max:
        raise ValueError(f"tenant {name!r}: priority needs min <= default <= max, got {bounds}")
    for field in ("requests_per_minute", "tokens_per_minute", "queue_timeout"):
        value = getattr(spec, field)
        if value is not None and not value > 0:
            raise ValueError(f"tenant {name!r}: {field} must be > 0, got {value}")
    if spec.max_queued < 0:
        raise ValueError(f"tenant {name!r}: max_queued must be >= 0, got {spec.max_queued}")
    for digest in spec.key_sha256:
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest.lower()):
            raise ValueError(f"tenant {name!r}: key_sha256 entries are 64 hex digits")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


class Tenants:
    """The table, and how a request's tenant is found (``identify``)."""

    def __init__(
        self,
        table: TenantsFile | None,
        header: str | None = None,
        priority_range: PriorityRange | None = None,
    ) -> None:
        """``priority_range``: the one tenant's when there is no table (None: priority 0 only)."""
        self.header = header
        self.keyed = table is not None and header is None  # tenant keys authenticate clients
        self.by_name: dict[str, Tenant] = {}
        self.by_key: dict[bytes, Tenant] = {}
        self.default: Tenant | None = None
        if table is None:
            spec = TenantSpec(priority=priority_range or PriorityRange())
            self.default = Tenant(DEFAULT_TENANT, DEFAULT_TENANT, spec)
            return
        for name, spec in table.tenants.items():
            _check(name, spec)
            tenant = self.by_name[name] = Tenant(name, name, spec)
            for digest in [_digest(key) for key in spec.keys] + [bytes.fromhex(d) for d in spec.key_sha256]:
                if digest in self.by_key:
                    raise ValueError(f"tenant {name!r}: a key is also {self.by_key[digest].name!r}'s")
                self.by_key[digest] = tenant
        if table.default is not None:
            _check("default", table.default)
            self.default = Tenant(OTHER, OTHER, table.default)
        if self.keyed and not self.by_key:
            raise ValueError("the tenant table lists no keys (keys, key_sha256), and no --tenant-header names tenants")

    @classmethod
    def load(cls, path: str | None, header: str | None, priority_range: PriorityRange) -> Tenants:
        """From ``--tenants PATH`` (None: no table), ``--tenant-header`` and ``--priority-range``."""
        if path is None:
            return cls(None, header, priority_range)
        raw = Path(path).read_bytes()
        try:
            if path.endswith((".yaml", ".yml")):
                table = msgspec.yaml.decode(raw, type=TenantsFile)
            else:
                table = msgspec.json.decode(raw, type=TenantsFile)
        except msgspec.ValidationError as error:
            raise ValueError(f"--tenants {path}: {error}") from None
        return cls(table, header, priority_range)

    @property
    def labels(self) -> list[str]:
        """Every tenant label metrics may carry."""
        return [*self.by_name, *([self.default.label] if self.default is not None else [])]

    def identify(self, headers: Mapping[str, str]) -> Tenant:
        """The tenant of a request with these headers; ProtocolError 401/403 when it has none."""
        get = headers.get
        if self.header is not None:
            name = get(self.header)
            if not name:
                raise ProtocolError(
                    f"no tenant: the gateway sets {self.header}", 401, error_type="authentication_error"
                )
            return self.by_name.get(name) or self._unlisted(name)
        if not self.keyed:
            assert self.default is not None
            return self.default
        authorization = get("Authorization") or ""
        if not authorization.startswith(_BEARER):
            raise ProtocolError("invalid or missing API key", 401, error_type="authentication_error")
        tenant = self.by_key.get(_digest(authorization[len(_BEARER) :]))
        if tenant is None:
            raise ProtocolError("invalid or missing API key", 401, error_type="authentication_error")
        return tenant

    def _unlisted(self, name: str) -> Tenant:
        """A name the gateway sent that the table lacks: its own flow, under the default entry's policy."""
        if self.default is None:
            raise ProtocolError(f"unknown tenant {name[:64]!r}", 403, error_type="permission_error")
        return Tenant(name, OTHER, self.default.spec)


def parse_priority_range(text: str) -> PriorityRange:
    """``--priority-range MIN:MAX`` (the default tenant's; its default priority is 0, or the bound nearest 0)."""
    low, colon, high = text.partition(":")
    try:
        bounds = (int(low), int(high)) if colon else None
    except ValueError:
        bounds = None
    if bounds is None or bounds[0] > bounds[1]:
        raise ValueError(f"--priority-range: {text!r} is not MIN:MAX with MIN <= MAX (e.g. -10:10)")
    return PriorityRange(min(max(0, bounds[0]), bounds[1]), bounds[0], bounds[1])
