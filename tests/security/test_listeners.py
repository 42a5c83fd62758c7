"""What this process listens on, as `ss` sees it: NIXL's UCX transport and the side channel
bind to the configured host (loopback by default), never to every interface."""

from __future__ import annotations

import ipaddress
import os
import subprocess

import pytest

from kvx import ConfigError
from kvx.plugins.nixl.agent import make_agent
from kvx.plugins.nixl.interfaces import interface_of
from kvx.plugins.nixl.side_channel import SideChannelServer


def listeners() -> list[str]:
    """Local addresses of this process's listening TCP sockets."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    mine = [line.split() for line in out.splitlines() if f"pid={os.getpid()}," in line]
    return [fields[3].rsplit(":", 1)[0].strip("[]") for fields in mine]


def external_address() -> str | None:
    """An address of this machine that is not loopback (None on a machine without one)."""
    out = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True).stdout
    for line in out.split("\n"):
        fields = line.split()
        if len(fields) > 3 and not ipaddress.ip_interface(fields[3]).ip.is_loopback:
            return str(ipaddress.ip_interface(fields[3]).ip)
    return None


@pytest.mark.timeout(60)
def test_nixl_agent_and_side_channel_listen_on_loopback_only() -> None:
    import torch

    before = set(listeners())
    agent = make_agent("kvx-listener-test", ["UCX"], 0, "127.0.0.1")
    tensor = torch.zeros(1024)
    registration = agent.register_memory([(tensor.data_ptr(), 4096, 0, "")], "DRAM")
    server = SideChannelServer("127.0.0.1", 0, "h", {}, {}, secret=None)
    try:
        assert agent.get_agent_metadata()
        now = listeners()
        assert len(now) > len(before)  # the agent and the side channel listen somewhere...
        assert all(ipaddress.ip_address(a).is_loopback for a in now), now  # ...on loopback
    finally:
        server.close()
        agent.deregister_memory(registration)
    assert "UCX_NET_DEVICES" not in os.environ


@pytest.mark.timeout(60)
def test_agent_on_an_interface_address_listens_there() -> None:
    address = external_address()
    assert address is not None, "this test needs a non-loopback interface"
    agent = make_agent("kvx-listener-test-ext", ["UCX"], 0, address)
    try:
        assert address in listeners()
        assert interface_of(address) != "lo"
    finally:
        del agent


def test_an_address_no_interface_holds_names_the_key() -> None:
    with pytest.raises(ConfigError, match="side_channel_host: no network interface"):
        make_agent("kvx-listener-test-bad", ["UCX"], 0, "198.51.100.77")
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("::1") == "lo"
    assert interface_of("0.0.0.0") is None
