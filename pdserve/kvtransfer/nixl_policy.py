"""When NIXL may move an engine's KV, and how its UCX is confined (docs/faults.md, "Transports").

NIXL hands a peer the engine's agent metadata: the registered regions and UCX's packed remote keys. Whether
that peer is then held to those regions depends on the UCX transport that carries its reads:

- RDMA (InfiniBand / RoCE ``rc`` and ``dc``): the adapter checks every remote access against the memory
  region the key names (its bounds and access rights): a peer cannot reach outside the registration. This is
  from the InfiniBand specification and UCX's documentation; this project has no RDMA hardware to test it.
- TCP, shared memory (``sm``: ``cma``, ``posix``, ``sysv``, ``xpmem``), ``cuda_ipc``: no bound. Over TCP the
  target's UCX serves any address the initiator asks for; CMA is ``process_vm_readv`` on any address of the
  target. A peer that edits the region list it received reads and writes the whole process (the cluster's
  keys, other tenants' prompts). Measured here on UCX over TCP and over CMA.

So ``--kv-transfer nixl`` (the default) means: NIXL where nothing is exposed by it — every peer is a process
of this host (the engine's KV address is loopback; same-user processes can read each other with ptrace
anyway), or UCX is limited to RDMA transports and an RDMA device is present — else pdserve's own checked TCP
transport, which serves only the blocks of a hold the peer names with its token. ``--kv-nixl-unbounded``
takes NIXL anyway, saying that every peer may read and write this process. The choice is logged at start.

UCX opens a TCP listener on every network interface unless told otherwise: :func:`ucx_environment` pins it
to the interface of the engine's KV address (loopback when that is loopback), and :func:`unexpected_listeners`
lets the start-up check see every listener the transport opened (UCX's) beyond that address.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field

from pdserve.api.auth import is_loopback

# UCX transports that carry remote memory access in RDMA hardware (the registration's bounds are enforced).
ENFORCING_TRANSPORTS = frozenset({"rc", "rc_v", "rc_verbs", "rc_x", "rc_mlx5", "dc", "dc_x", "dc_mlx5"})
# Transports that only move data inside the initiator (no peer reaches memory through them).
LOCAL_TRANSPORTS = frozenset({"self", "cuda_copy", "gdr_copy", "rocm_copy"})
# Transports between the processes of one host (what a loopback deployment's NIXL needs one of).
HOST_TRANSPORTS = frozenset({"tcp", "sm", "shm", "cma", "posix", "sysv", "xpmem", "knem"})
RDMA_DEVICES_DIR = "/sys/class/infiniband"
_SIOCGIFADDR = 0x8915


@dataclass(frozen=True)
class TransportChoice:
    name: str  # "nixl" or "tcp"
    reason: str  # why, for the start-up log
    ucx_env: dict[str, str] = field(default_factory=dict)  # set before UCX starts (NIXL only)


def ucx_transports(environ: Mapping[str, str]) -> list[str] | None:
    """The transports ``UCX_TLS`` names; None when it does not restrict them (unset, ``all``, or an exclusion)."""
    text = environ.get("UCX_TLS", "").strip()
    if not text or text.startswith("^"):
        return None
    names = [name.strip().lower() for name in text.split(",") if name.strip()]
    return None if "all" in names else names


def rdma_devices() -> list[str]:
    try:
        return sorted(os.listdir(RDMA_DEVICES_DIR))
    except OSError:
        return []


def choose_transport(
    requested: str,
    host: str,
    unbounded_ok: bool,
    environ: Mapping[str, str] = os.environ,
    devices: list[str] | None = None,
) -> TransportChoice:
    """The transport an engine whose KV address is ``host`` uses when ``requested`` (``--kv-transfer``)."""
    if requested == "tcp":
        return TransportChoice("tcp", "--kv-transfer tcp")
    ucx_env = ucx_environment(host, environ)
    transports = ucx_transports(environ)
    devices = rdma_devices() if devices is None else devices
    rdma_only = bool(
        transports
        and set(transports) <= ENFORCING_TRANSPORTS | LOCAL_TRANSPORTS
        and set(transports) & ENFORCING_TRANSPORTS
        and devices
    )
    if is_loopback(host):
        if transports is None or set(transports) & HOST_TRANSPORTS or rdma_only:
            return TransportChoice("nixl", "every peer is a process of this host (loopback KV address)", ucx_env)
        return TransportChoice("tcp", f"UCX_TLS={','.join(transports)} carries nothing between this host's processes")
    if rdma_only:
        assert transports is not None
        return TransportChoice("nixl", f"UCX limited to RDMA ({','.join(transports)}) on {','.join(devices)}", ucx_env)
    if unbounded_ok:
        return TransportChoice(
            "nixl",
            "--kv-nixl-unbounded: UCX over transports that do not bound a peer's access: EVERY PEER THAT HAND-SHAKES "
            "CAN READ AND WRITE THIS PROCESS'S MEMORY",
            ucx_env,
        )
    offered = ",".join(transports) if transports else "any transport (UCX_TLS unset)"
    return TransportChoice(
        "tcp",
        f"NIXL over UCX's {offered} would let every peer read and write this process's memory; the checked TCP "
        f"transport serves instead (limit UCX_TLS to rc/dc on an RDMA network, or give --kv-nixl-unbounded)",
    )


def ucx_environment(host: str, environ: Mapping[str, str]) -> dict[str, str]:
    """``UCX_NET_DEVICES`` that keeps UCX's listeners on the interface of ``host`` (its loopback interface when
    ``host`` is loopback, whatever was set; otherwise only when nothing was set). Empty for a wildcard host."""
    try:
        address = ipaddress.ip_address(host.strip("[]")) if host != "localhost" else ipaddress.ip_address("127.0.0.1")
    except ValueError:
        try:
            address = ipaddress.ip_address(socket.gethostbyname(host))
        except OSError:
            return {}
    if address.is_unspecified or (environ.get("UCX_NET_DEVICES") and not address.is_loopback):
        return {}
    interface = interface_of(str(address))
    return {"UCX_NET_DEVICES": interface} if interface else {}


def interface_of_name(name: str) -> str | None:
    """The IPv4 address of network interface ``name`` (None: it has none)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        answer = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
    except OSError:
        return None
    finally:
        probe.close()
    return str(ipaddress.ip_address(answer[20:24]))


def interface_of(address: str) -> str | None:
    """The network interface that holds IPv4 ``address`` (loopback addresses: the loopback interface)."""
    for _, name in socket.if_nameindex():
        held = interface_of_name(name)
        if held is None:
            continue
        if held == address or (ipaddress.ip_address(held).is_loopback and ipaddress.ip_address(address).is_loopback):
            return name
    return None


def listening_sockets(pid: int | str = "self") -> dict[str, str]:
    """Every TCP socket of process ``pid`` in the listening state: its inode -> its local address."""
    inodes = set()
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(f"{fd_dir}/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = {}
    for table, width in (("tcp", 4), ("tcp6", 16)):
        try:
            with open(f"/proc/{pid}/net/{table}") as handle:
                lines = handle.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                found[fields[9]] = _proc_address(fields[1].split(":")[0], width)
    return found


def _proc_address(text: str, width: int) -> str:
    raw = bytes.fromhex(text)
    # /proc/net/tcp prints each 32-bit word in host (little-endian) order.
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, width, 4))
    return str(ipaddress.ip_address(words))


def unexpected_listeners(host: str, before: Mapping[str, str], pid: int | str = "self") -> list[str]:
    """Addresses of the process's listening sockets opened since ``before`` (``listening_sockets()`` then) that are
    neither ``host`` (or what it resolves to) nor loopback; none for a wildcard ``host`` (that engine listens
    everywhere by choice). A wildcard listener is unexpected: it answers on every interface."""
    try:
        if ipaddress.ip_address(host.strip("[]")).is_unspecified:
            return []
    except ValueError:
        pass
    allowed = {host.strip("[]")}
    with contextlib.suppress(OSError):
        allowed.add(socket.gethostbyname(host))
    found = []
    for inode, address in listening_sockets(pid).items():
        if inode in before:
            continue
        parsed = ipaddress.ip_address(address)
        mapped = getattr(parsed, "ipv4_mapped", None) or parsed
        if not (mapped.is_loopback or str(mapped) in allowed):
            found.append(address)
    return found
