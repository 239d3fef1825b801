"""``accept_from``: the networks whose hosts may connect to a source's UCX listeners."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvkern.xfer.networks import (
    ANY,
    LOOPBACK,
    Networks,
    ProvenHosts,
    host_key,
    is_loopback_host,
)


def test_addresses_in_and_out():
    nets = Networks.parse("10.0.0.0/16, 192.168.1.7 fd00::/8")
    assert "10.0.255.1" in nets and "192.168.1.7" in nets and "fd12::1" in nets
    assert "10.1.0.1" not in nets and "192.168.1.8" not in nets and "fe80::1" not in nets
    assert "::ffff:10.0.0.1" in nets  # an IPv4-mapped IPv6 address is its IPv4 address
    for junk in (None, "", "10.0.0", "not-an-ip", "10.0.0.1:80", 167772161):
        assert junk not in nets
    assert "fe80::1%eth0" in Networks.parse("fe80::/10")
    assert "127.0.0.1" in LOOPBACK and "::1" in LOOPBACK and "10.0.0.1" not in LOOPBACK
    assert "203.0.113.9" in ANY and "2001:db8::1" in ANY
    assert str(Networks.parse(["10.0.0.1", "[::1]"])) == "10.0.0.1/32, ::1/128"


@pytest.mark.parametrize("spec,match", [
    ("", "names no network"),
    ([" , "], "names no network"),
    ("10.0.0.0/33", "entry '10.0.0.0/33'"),
    ("fleet.example", "entry 'fleet.example'"),
    ("10.0.0.0/8:8000", "entry '10.0.0.0/8:8000'"),
    (5, "a string or a list of strings"),
    (["10.0.0.0/8", None], "a string or a list of strings"),
])
def test_bad_entries_are_named(spec, match):
    with pytest.raises(ValueError, match=match):
        Networks.parse(spec)


@given(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1), st.integers(0, 32))
def test_membership_is_ipaddress_membership(addr, base, prefix):
    net = ipaddress.ip_network(f"{ipaddress.IPv4Address(base)}/{prefix}", strict=False)
    ip = ipaddress.IPv4Address(addr)
    nets = Networks([net])
    assert (str(ip) in nets) == (ip in net)
    assert (f"::ffff:{ip}" in nets) == (ip in net)


def test_loopback_hosts():
    for host in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost", "a.localhost"):
        assert is_loopback_host(host), host
    for host in ("0.0.0.0", "::", "10.0.0.1", "example.com", ""):
        assert not is_loopback_host(host), host


def test_a_host_is_an_ipv4_address_or_an_ipv6_slash_64():
    assert host_key("10.0.0.1") == "10.0.0.1" and host_key("::ffff:10.0.0.1") == "10.0.0.1"
    assert host_key("2001:db8:1:2::1") == host_key("2001:db8:1:2:ffff:1:2:3") == "2001:db8:1:2::/64"
    assert host_key("2001:db8:1:3::1") != host_key("2001:db8:1:2::1")
    assert host_key("fe80::1%eth0") == "fe80::/64" and host_key("::1") == "::/64"
    for other in ("", "not-an-ip", "10.0.0.1:80"):
        assert host_key(other) == other


@given(st.integers(0, 2**128 - 1), st.integers(0, 2**64 - 1))
def test_every_address_of_one_ipv6_slash_64_is_one_host(addr, low):
    ip = ipaddress.IPv6Address(addr)
    if ip.ipv4_mapped is not None:
        return
    same = ipaddress.IPv6Address((addr >> 64 << 64) | low)
    assert host_key(str(ip)) == host_key(str(same))
    assert ip in ipaddress.ip_network(host_key(str(ip)))


def test_a_proven_host_stays_proven_for_its_time_to_live_only():
    now = [0.0]
    proven = ProvenHosts(ttl_s=10.0, max_hosts=3, clock=lambda: now[0])
    assert "10.0.0.1" not in proven and None not in proven
    proven.note("10.0.0.1")
    proven.note("2001:db8::1")
    proven.note(None)  # (an unknown address proves nothing)
    assert "10.0.0.1" in proven and "::ffff:10.0.0.1" in proven
    assert "2001:db8::ffff" in proven and "2001:db8:0:1::1" not in proven  # (its /64)
    now[0] = 9.9
    proven.note("10.0.0.1")  # (proven again: its time starts over)
    now[0] = 10.0
    assert "2001:db8::1" not in proven and "10.0.0.1" in proven
    for i in range(2, 6):  # at most three kept: the least recently proven go first
        proven.note(f"10.0.0.{i}")
    assert len(proven) == 3 and "10.0.0.1" not in proven and "10.0.0.5" in proven
    with pytest.raises(ValueError):
        ProvenHosts(ttl_s=0)
