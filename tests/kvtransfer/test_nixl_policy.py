"""Where NIXL may carry KV (pdserve/kvtransfer/nixl_policy.py), and UCX's listeners kept on the engine's address.

NIXL's metadata gives a peer the whole registration, and over UCX's tcp or shared-memory transports nothing holds
the peer to it (reproduced on dbd1dc4: a peer that edited the region list it received read the cluster secret out
of a prefill's heap). So across hosts NIXL serves only over RDMA; the default cross-pod configuration (UCX over tcp,
or UCX_TLS unset) gets the checked TCP transport, whose handshake carries no memory address at all. And UCX, which
listens on every interface unless told otherwise (reproduced: an engine started with --host 127.0.0.1 had a UCX
listener on the machine's external address), is pinned to the engine's interface; the start-up check sees every
listener of the process, UCX's included."""

from __future__ import annotations

import socket

import numpy as np
import pytest

from pdserve.kvtransfer import nixl_policy
from pdserve.kvtransfer.nixl_policy import choose_transport
from pdserve.kvtransfer.work import TransferWork
from tests.kvtransfer.agents import Engine, engines, load, token_of

RDMA = ["mlx5_0"]


@pytest.mark.parametrize(
    ("host", "environ", "devices", "unbounded", "expected"),
    [
        ("127.0.0.1", {}, [], False, "nixl"),  # one host: peers are this host's processes
        ("127.0.0.1", {"UCX_TLS": "tcp,self"}, [], False, "nixl"),
        ("127.0.0.1", {"UCX_TLS": "rc,cuda_copy,self"}, [], False, "tcp"),  # nothing UCX could use locally
        ("10.0.0.5", {}, [], False, "tcp"),  # across hosts, UCX_TLS unset: tcp and shared memory, no bound
        ("10.0.0.5", {"UCX_TLS": "tcp,self"}, [], False, "tcp"),  # the operator's old default
        ("10.0.0.5", {"UCX_TLS": "tcp,self"}, RDMA, False, "tcp"),
        ("10.0.0.5", {"UCX_TLS": "rc,ud,self"}, RDMA, False, "tcp"),  # ud carries no RMA in hardware
        ("10.0.0.5", {"UCX_TLS": "all"}, RDMA, False, "tcp"),
        ("10.0.0.5", {"UCX_TLS": "^tcp"}, RDMA, False, "tcp"),
        ("10.0.0.5", {"UCX_TLS": "rc,cuda_copy,gdr_copy,self"}, [], False, "tcp"),  # no RDMA device here
        ("10.0.0.5", {"UCX_TLS": "rc,cuda_copy,gdr_copy,self"}, RDMA, False, "nixl"),  # the operator's default
        ("10.0.0.5", {"UCX_TLS": "dc_x,self"}, RDMA, False, "nixl"),
        ("10.0.0.5", {}, [], True, "nixl"),  # said outright: every peer may read and write this process
    ],
)
def test_nixl_serves_only_where_a_peer_stays_inside_the_registration(host, environ, devices, unbounded, expected):
    choice = choose_transport("nixl", host, unbounded, environ, devices)
    assert choice.name == expected, choice.reason
    assert choose_transport("tcp", host, unbounded, environ, devices).name == "tcp"
    if unbounded and expected == "nixl":
        assert "EVERY PEER" in choice.reason


def test_a_cross_pod_default_hands_no_peer_any_memory_address():
    # The default cross-pod configuration: its handshake reply names no agent, no address, no region to edit.
    choice = choose_transport("nixl", "10.0.0.5", False, {"UCX_TLS": "tcp,self"}, [])
    import torch

    from pdserve.kvtransfer import messages
    from pdserve.kvtransfer.transport.registry import make_transport

    transport = make_transport(choice, torch.zeros((4, 64)), np.zeros(4, np.int64), messages.Seal("x", None))
    assert transport.name == "tcp" and transport.local_info() == {}


def test_ucx_listens_only_on_the_engines_address():
    pytest.importorskip("nixl._api")
    before = nixl_policy.listening_sockets()
    with engines({"filled": True, "transport": "nixl"}, {"filled": False, "transport": "nixl"}) as (prefill, decode):
        assert prefill.agent.transport.name == "nixl"
        opened = {inode: address for inode, address in nixl_policy.listening_sockets().items() if inode not in before}
        assert opened and all(address == "127.0.0.1" for address in opened.values()), opened
        # And NIXL still moves blocks, over loopback.
        prefill.agent.submit(TransferWork(holds=[("p", [1], token_of("p"))]))
        decode.agent.submit(TransferWork(loads=[load("d", prefill.remote("p", [1]), [2])]))
        decode.wait_for(lambda seen: seen.finished_recving or seen.failed_recving, "the pull")
        assert decode.seen.finished_recving == {"d"}


def test_the_start_up_check_sees_a_ucx_listener_on_another_interface(monkeypatch):
    # Before (dbd1dc4), an engine started with --host 127.0.0.1 had a UCX listener on the machine's external
    # address, and the exposure check never saw it. Here UCX is left unpinned on purpose: the engine refuses.
    pytest.importorskip("nixl._api")
    interfaces = [name for _, name in socket.if_nameindex() if name != nixl_policy.interface_of("127.0.0.1")]
    if not any(nixl_policy.interface_of_name(name) for name in interfaces):
        pytest.skip("no IPv4 interface besides loopback: nothing for UCX to listen on")
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    monkeypatch.setattr(nixl_policy, "ucx_environment", lambda host, environ: {})
    with pytest.raises(RuntimeError, match="refusing to start"):
        Engine(filled=True, transport="nixl")
