"""Endpoint resolution and the allowlist: an SSRF corpus, DNS rebinding, the CLI, and
fetch_state against a real aiohttp server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvkern.xfer import endpoint as endpoint_mod
from kvkern.xfer.endpoint import (
    REASONS,
    Allowlist,
    EndpointConfig,
    FetchError,
    ResolvedEndpoint,
    check_endpoint_main,
    fetch_state,
    resolve_endpoint,
    resolve_endpoint_async,
)

REPO = Path(__file__).resolve().parents[1]

ALLOW = Allowlist.parse([
    "10.0.0.0/8:8000-8010",
    "worker-1.example:8000",
    "*.svc.cluster.local:8000",
    "[fd00:1::/64]:9000",
    "192.168.1.5",
])
CONFIG = EndpointConfig(state_port_offset=1000)

DNS = {
    "worker-1.example": ["203.0.113.9"],
    "pod.ns.svc.cluster.local": ["10.2.3.4", "fd00:1::7"],
    "evil.example": ["8.8.8.8"],
    "localhost": ["127.0.0.1", "::1"],
    "metadata.google.internal": ["169.254.169.254"],
    "rebind.svc.cluster.local": ["10.0.0.7", "127.0.0.1"],
    "rebind2.svc.cluster.local": ["169.254.169.254", "10.0.0.7"],
    "rebind3.svc.cluster.local": ["10.0.0.7", "::ffff:169.254.169.254"],
    "rebind4.svc.cluster.local": ["10.0.0.7", "0.0.0.0"],
    "empty.svc.cluster.local": [],
    "garbage.svc.cluster.local": ["not-an-ip"],
    "zone.svc.cluster.local": ["fe80::1%eth0"],
    "192.168.1.5.nip.io": ["127.0.0.1"],
}


class FakeDNS:
    def __init__(self, table=None):
        self.table = DNS if table is None else table
        self.calls: list[tuple[str, int]] = []

    def __call__(self, host, port):
        self.calls.append((host, port))
        if host not in self.table:
            raise socket.gaierror(socket.EAI_NONAME, f"{host} not known")
        return list(self.table[host])


def verdict(endpoint, allow=ALLOW, dp_rank=None, config=CONFIG, dns=None):
    return resolve_endpoint(endpoint, allow, dp_rank=dp_rank, config=config,
                            resolver=dns or FakeDNS())


HOSTILE = [
    # loopback in every spelling
    ("http://127.0.0.1:8000", "loopback"),
    ("127.0.0.1:8000", "loopback"),
    ("HTTP://127.0.0.1:8000", "loopback"),
    ("http://127.0.0.1.:8000", "loopback"),
    ("2130706433:8000", "loopback"),
    ("http://2130706433:8000/", "loopback"),
    ("0177.0.0.1:8000", "loopback"),
    ("0x7f.1:8000", "loopback"),
    ("http://0x7f.0x00.0x00.0x01:8000", "loopback"),
    ("127.1:8000", "loopback"),
    ("http://0x7f000001:8000", "loopback"),
    ("http://017700000001:8000", "loopback"),
    ("http://[::1]:8000/", "loopback"),
    ("http://[::ffff:127.0.0.1]:8000/", "loopback"),
    ("http://[::ffff:7f00:1]:8000/", "loopback"),
    ("http://[::127.0.0.1]:8000", "loopback"),
    ("http://[64:ff9b::7f00:1]:9000", "loopback"),
    ("http://localhost:8000", "loopback"),
    ("192.168.1.5.nip.io:8000", "loopback"),
    # cloud metadata
    ("http://169.254.169.254/latest/meta-data/", "metadata_address"),
    ("http://0xa9.0xfe.0xa9.0xfe/", "metadata_address"),
    ("http://2852039166/", "metadata_address"),
    ("http://[::ffff:169.254.169.254]/", "metadata_address"),
    ("http://[::ffff:a9fe:a9fe]/", "metadata_address"),
    ("http://[2002:a9fe:a9fe::1]:9000", "metadata_address"),
    ("http://[fd00:ec2::254]/", "metadata_address"),
    ("http://[fd20:ce::254]/", "metadata_address"),
    ("http://100.100.100.200/", "metadata_address"),
    ("http://169.254.170.2/v2/credentials", "metadata_address"),
    ("http://metadata.google.internal/computeMetadata/v1/", "metadata_address"),
    ("http://metadata.google.internal./", "metadata_address"),
    ("http://METADATA:80/", "metadata_address"),
    # link-local, unspecified, multicast, reserved
    ("http://169.254.1.1:8000/", "link_local"),
    ("http://[fe80::1]:8000/", "link_local"),
    ("http://0.0.0.0:8000/", "unspecified"),
    ("http://0:8000", "unspecified"),
    ("http://[::]:8000/", "unspecified"),
    ("http://224.0.0.1:8000/", "multicast"),
    ("http://[ff02::1]:9000/", "multicast"),
    ("http://255.255.255.255:8000/", "reserved"),
    ("http://240.0.0.1:8000", "reserved"),
    ("http://0.1.2.3:8000", "reserved"),
    # schemes, user info, URL tricks
    ("file:///etc/passwd", "bad_scheme"),
    ("gopher://10.0.0.5:8000/_GET", "bad_scheme"),
    ("ftp://10.0.0.5/", "bad_scheme"),
    ("dict://10.0.0.5:8000/", "bad_scheme"),
    ("javascript:alert(1)", "bad_scheme"),
    ("http://user:pass@10.0.0.5:8000/", "userinfo"),
    ("http://10.0.0.5:8000@evil.example/", "userinfo"),
    ("http://evil.example#@10.0.0.5:8000/", "bad_url"),
    ("http://10.0.0.5\\@evil.example:8000", "bad_url"),
    ("http://10.0.0.5 :8000", "bad_url"),
    ("http://10.0.0.5:8000/\r\nX-Injected: 1", "bad_url"),
    ("//10.0.0.5:8000", "bad_url"),
    ("10.0.0.5:8000/admin", "bad_url"),
    ("", "bad_url"),
    # malformed hosts and ports
    ("http://256.0.0.1:8000/", "bad_host"),
    ("http://1.2.3.4.5:8000/", "bad_host"),
    ("http://08.0.0.1:8000", "bad_host"),
    ("0x1g.1:8000", "bad_host"),  # (a hex part that is not hex, before the last)
    ("tcp://0x-1.5:9000", "bad_host"),
    ("1" * 4400, "bad_host"),  # (int() of 4301+ digits raises)
    ("1.0x1g.2", "bad_host"),
    ("http://[fe80::1%25eth0]:8000/", "bad_host"),
    ("http://%31%32%37.0.0.1:8000/", "bad_host"),
    ("http://[::1:8000", "bad_host"),
    ("http://:8000/", "bad_host"),
    ("http://::1:8000/", "bad_host"),
    ("http://exa_mple..com:8000/", "bad_host"),
    ("http://10.0.0.5:0/", "bad_port"),
    ("http://10.0.0.5:65536/", "bad_port"),
    ("http://10.0.0.5:80a/", "bad_port"),
    ("http://10.0.0.5:/", "bad_port"),
    ("tcp://10.0.0.5", "bad_port"),
    ("tcp://10.0.0.5:7000/path", "bad_url"),
    # not on the list
    ("http://8.8.8.8:8000/", "not_allowed"),
    ("http://evil.example:8000/", "not_allowed"),
    ("http://[fc00::1]:9000", "not_allowed"),
    ("http://11.0.0.1:8000", "not_allowed"),
    ("http://10.0.0.5:9999/", "port_not_allowed"),
    ("http://10.0.0.5/", "port_not_allowed"),
    ("https://10.0.0.5/", "port_not_allowed"),
    ("worker-1.example:8001", "port_not_allowed"),
    ("pod.ns.svc.cluster.local:8001", "port_not_allowed"),
    ("http://[fd00:1::5]:9001/", "port_not_allowed"),
    # DNS
    ("rebind.svc.cluster.local:8000", "loopback"),
    ("rebind2.svc.cluster.local:8000", "metadata_address"),
    ("rebind3.svc.cluster.local:8000", "metadata_address"),
    ("rebind4.svc.cluster.local:8000", "unspecified"),
    ("nxdomain.svc.cluster.local:8000", "resolve_failed"),
    ("empty.svc.cluster.local:8000", "resolve_failed"),
    ("garbage.svc.cluster.local:8000", "resolve_failed"),
    ("zone.svc.cluster.local:8000", "link_local"),
    # tcp control endpoints: rank offsets move the port out of the allowed range
    ("tcp://127.0.0.1:7000", "loopback"),
]


def test_corpus_is_large_and_covers_reasons():
    assert len(HOSTILE) >= 40
    covered = {r for _, r in HOSTILE}
    assert covered <= set(REASONS)
    assert covered >= {"not_allowed", "bad_scheme", "userinfo", "resolve_failed",
                       "metadata_address", "link_local", "port_not_allowed", "loopback",
                       "unspecified", "bad_host", "bad_port", "bad_url"}


@pytest.mark.parametrize("endpoint,reason", HOSTILE, ids=[e[:60] or "<empty>" for e, _ in HOSTILE])
def test_hostile_endpoint_refused(endpoint, reason):
    v = verdict(endpoint)
    assert not v.allowed and v.endpoint is None
    assert v.reason == reason, v


ALLOWED = [
    ("http://10.0.0.5:8000/kvkern/v1/state", "http", "10.0.0.5", "10.0.0.5", 8000,
     "/kvkern/v1/state"),
    ("http://10.0.0.5:8000", "http", "10.0.0.5", "10.0.0.5", 8000, "/kvkern/v1/state"),
    ("http://10.0.0.5:8000/custom/state?fmt=msgpack", "http", "10.0.0.5", "10.0.0.5", 8000,
     "/custom/state?fmt=msgpack"),
    ("10.0.0.5:8005", "http", "10.0.0.5", "10.0.0.5", 8005, "/kvkern/v1/state"),
    ("10.0.0.5", "http", "10.0.0.5", "10.0.0.5", 8000, "/kvkern/v1/state"),
    ("http://012.0.0.5:8000", "http", "10.0.0.5", "10.0.0.5", 8000, "/kvkern/v1/state"),
    ("http://[::ffff:10.0.0.5]:8000", "http", "10.0.0.5", "10.0.0.5", 8000,
     "/kvkern/v1/state"),
    ("worker-1.example:8000", "http", "worker-1.example", "203.0.113.9", 8000,
     "/kvkern/v1/state"),
    ("Worker-1.Example.:8000", "http", "worker-1.example", "203.0.113.9", 8000,
     "/kvkern/v1/state"),
    ("https://pod.ns.svc.cluster.local:8000/s", "https", "pod.ns.svc.cluster.local",
     "10.2.3.4", 8000, "/s"),
    ("http://[fd00:1::5]:9000/x", "http", "fd00:1::5", "fd00:1::5", 9000, "/x"),
    ("[fd00:1::5]:9000", "http", "fd00:1::5", "fd00:1::5", 9000, "/kvkern/v1/state"),
    ("192.168.1.5:1234", "http", "192.168.1.5", "192.168.1.5", 1234, "/kvkern/v1/state"),
    ("tcp://10.0.0.5:7000", "http", "10.0.0.5", "10.0.0.5", 8000, "/kvkern/v1/state"),
]


@pytest.mark.parametrize("endpoint,scheme,host,ip,port,path", ALLOWED,
                         ids=[a[0] for a in ALLOWED])
def test_allowed_endpoint(endpoint, scheme, host, ip, port, path):
    v = verdict(endpoint)
    assert v.allowed and v.reason == "allowed", v
    ep = v.endpoint
    assert (ep.scheme, ep.host, ep.ip, ep.port, ep.path) == (scheme, host, ip, port, path)
    assert ep.ip in ep.addresses


def test_pinned_address_and_host_header():
    dns = FakeDNS()
    v = verdict("pod.ns.svc.cluster.local:8000", dns=dns)
    assert dns.calls == [("pod.ns.svc.cluster.local", 8000)]  # resolved once
    ep = v.endpoint
    assert ep.addresses == ("10.2.3.4", "fd00:1::7")  # every address checked...
    assert ep.url == "http://10.2.3.4:8000/kvkern/v1/state"  # ...connect to the first
    assert ep.host_header == "pod.ns.svc.cluster.local:8000"
    v6 = verdict("http://[fd00:1::5]:9000/x").endpoint
    assert v6.url == "http://[fd00:1::5]:9000/x" and v6.host_header == "[fd00:1::5]:9000"


def test_second_address_outside_the_list_is_refused():
    """A name resolving to one allowed and one merely unlisted address is refused too."""
    dns = FakeDNS({"mixed.svc.cluster.local": ["10.0.0.7", "8.8.8.8"]})
    v = verdict("mixed.svc.cluster.local:8000", allow=["10.0.0.0/8:8000"], dns=dns)
    assert v.reason == "not_allowed" and v.addresses == ("10.0.0.7", "8.8.8.8")


@pytest.mark.parametrize("order", [["10.0.0.7", "127.0.0.1"], ["127.0.0.1", "10.0.0.7"]],
                         ids=["allowed_first", "forbidden_first"])
def test_dns_rebinding_any_forbidden_address_refuses(order):
    dns = FakeDNS({"flip.svc.cluster.local": order})
    v = verdict("flip.svc.cluster.local:8000", dns=dns)
    assert v.reason == "loopback" and len(dns.calls) == 1


def test_rebinding_between_calls_each_checked():
    """A resolver answering differently on each call: every verdict stands on its own
    answer, and a pinned endpoint never re-resolves."""
    answers = iter([["10.0.0.7"], ["127.0.0.1"]])
    calls = []

    def flip(host, port):
        calls.append(host)
        return next(answers)

    first = verdict("flip.svc.cluster.local:8000", dns=flip)
    second = verdict("flip.svc.cluster.local:8000", dns=flip)
    assert first.allowed and first.endpoint.ip == "10.0.0.7"
    assert second.reason == "loopback" and len(calls) == 2


def test_empty_allowlist_fails_closed_without_resolving():
    dns = FakeDNS()
    for allow in ([], [""], Allowlist()):
        v = resolve_endpoint("pod.ns.svc.cluster.local:8000", allow, resolver=dns)
        assert v.reason == "empty_allowlist"
    assert dns.calls == []


def test_unlisted_name_with_only_name_entries_is_not_resolved():
    dns = FakeDNS()
    v = verdict("evil.example:8000", allow=["worker-1.example:8000"], dns=dns)
    assert v.reason == "not_allowed" and dns.calls == []


@pytest.mark.parametrize(
    "endpoint,allow,reason",
    [
        ("127.0.0.1:8000", ["127.0.0.1:8000"], "allowed"),
        ("127.0.0.1:8000", ["127.0.0.0/8"], "allowed"),
        ("127.0.0.1:8000", ["0.0.0.0/0"], "loopback"),
        ("127.0.0.1:8000", ["127.0.0.1:9000"], "port_not_allowed"),
        ("[::1]:9000", ["[::1]:9000"], "allowed"),
        ("[::1]:9000", ["::/0"], "loopback"),
        ("localhost:8000", ["localhost:8000"], "allowed"),
        ("localhost:8000", ["*.svc.cluster.local"], "not_allowed"),
        ("http://169.254.169.254/", ["169.254.169.254:80"], "allowed"),
        ("http://169.254.169.254/", ["169.254.0.0/16"], "metadata_address"),
        ("http://169.254.7.7:80/", ["169.254.0.0/16"], "allowed"),
        ("http://169.254.7.7:80/", ["0.0.0.0/0"], "link_local"),
        ("http://[fe80::2]:80/", ["fe80::/64"], "allowed"),
        ("http://metadata.google.internal/", ["metadata.google.internal"], "metadata_address"),
        ("http://metadata.google.internal/",
         ["metadata.google.internal", "169.254.169.254"], "allowed"),
        ("http://0.0.0.0:8000/", ["0.0.0.0/0", "0.0.0.0"], "unspecified"),
        ("http://8.8.8.8:8000/", ["0.0.0.0/0"], "allowed"),
        ("http://10.0.0.5:8000/", ["0x0a000005:8000"], "allowed"),
        ("http://10.0.0.5:8005/", ["10.0.0.5:8000-8010"], "allowed"),
        ("http://10.0.0.5:8011/", ["10.0.0.5:8000-8010"], "port_not_allowed"),
        ("a.svc.cluster.local:8000", ["*.svc.cluster.local:*"], "allowed"),
        ("svc.cluster.local:8000", ["*.svc.cluster.local"], "not_allowed"),
        ("evilsvc.cluster.local:8000", ["*.svc.cluster.local"], "not_allowed"),
    ],
)
def test_explicit_listing_rules(endpoint, allow, reason):
    dns = FakeDNS({**DNS, "a.svc.cluster.local": ["10.9.9.9"], "svc.cluster.local": ["10.9.9.9"],
                   "evilsvc.cluster.local": ["10.9.9.9"]})
    assert verdict(endpoint, allow=allow, dns=dns).reason == reason


def test_tcp_control_endpoint_dp_rank_rule():
    v = verdict("tcp://10.0.0.5:7000", dp_rank=3)
    ep = v.endpoint
    assert (ep.control, ep.port, ep.dp_rank) == ("tcp://10.0.0.5:7003", 8003, 3)
    assert verdict("tcp://10.0.0.5:7000", dp_rank=11).reason == "port_not_allowed"
    stride = EndpointConfig(state_port_offset=1000, dp_port_stride=2)
    assert verdict("tcp://10.0.0.5:7000", dp_rank=3, config=stride).endpoint.port == 8006
    assert verdict("tcp://10.0.0.5:7000", config=EndpointConfig()).reason == "no_state_mapping"
    assert verdict("tcp://10.0.0.5:65535", dp_rank=1).reason == "bad_port"
    # DP rank does not move http ports.
    assert verdict("10.0.0.5:8000", dp_rank=5).endpoint.port == 8000


@pytest.mark.parametrize("spec", ["10.0.0.1/8", "*", "host:0", "host:9-3", "[::1", "a*b.com",
                                  "host:http", "*.", "[::1]x"])
def test_bad_allowlist_entries_raise(spec):
    with pytest.raises(ValueError, match="allowlist entry"):
        Allowlist.parse([spec])


def test_allowlist_string_forms():
    a = Allowlist.parse("10.0.0.0/8:8000, host.example  [::1]:9000")
    assert [e.spec for e in a.entries] == ["10.0.0.0/8:8000", "host.example", "[::1]:9000"]


def test_bad_dp_rank_raises():
    with pytest.raises(ValueError, match="dp_rank"):
        verdict("10.0.0.5:8000", dp_rank=-1)


async def test_async_resolution():
    v = await resolve_endpoint_async("pod.ns.svc.cluster.local:8000", ALLOW, resolver=FakeDNS())
    assert v.allowed


class StuckDNS(FakeDNS):
    """A resolver whose every lookup waits until ``release`` is set (a name server down)."""

    def __init__(self):
        super().__init__()
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.waiting = 0

    def __call__(self, host, port):
        with self.lock:
            self.waiting += 1
        self.release.wait(10)
        return super().__call__(host, port)


async def until_true(pred, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not pred():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_stuck_lookups_hold_neither_addresses_nor_the_loops_executor(monkeypatch):
    """Host name lookups that hang (a name server down) hold the lookup threads only: an
    endpoint that names an address, or a name refused before any lookup, is answered at
    once; work on the event loop's default executor (one thread here) still runs; lookups
    past MAX_PENDING_LOOKUPS are refused at once (``resolve_busy``) instead of queueing; one
    whose caller gave up counts until its thread returns."""
    await until_true(lambda: endpoint_mod.pending_lookups() == 0)  # (no earlier test's)
    monkeypatch.setattr(endpoint_mod, "MAX_PENDING_LOOKUPS", endpoint_mod.LOOKUP_THREADS + 2)
    loop = asyncio.get_running_loop()
    default = concurrent.futures.ThreadPoolExecutor(1)
    loop.set_default_executor(default)
    dns = StuckDNS()
    held = [asyncio.ensure_future(resolve_endpoint_async(
        "pod.ns.svc.cluster.local:8000", ALLOW, resolver=dns))
        for _ in range(endpoint_mod.LOOKUP_THREADS + 2)]
    try:
        await until_true(lambda: dns.waiting == endpoint_mod.LOOKUP_THREADS)
        assert endpoint_mod.pending_lookups() == len(held)
        ip = await asyncio.wait_for(resolve_endpoint_async("10.0.0.5:8000", ALLOW,
                                                           resolver=dns), 1)
        assert ip.allowed and ip.endpoint.ip == "10.0.0.5"
        names = Allowlist.parse(["worker-1.example:8000"])
        for spec, allow, reason in (("evil.example:8000", names, "not_allowed"),
                                    ("metadata.google.internal", ALLOW, "metadata_address"),
                                    ("worker-1.example:8000", [], "empty_allowlist")):
            v = await asyncio.wait_for(resolve_endpoint_async(spec, allow, resolver=dns), 1)
            assert not v.allowed and v.reason == reason
        assert await asyncio.wait_for(asyncio.to_thread(lambda: 7), 1) == 7
        refused = await asyncio.wait_for(resolve_endpoint_async(
            "worker-1.example:8000", ALLOW, resolver=dns), 1)
        assert not refused.allowed and refused.reason == "resolve_busy"
        assert "lookups pending" in refused.detail
        assert dns.waiting == endpoint_mod.LOOKUP_THREADS
        with pytest.raises(asyncio.TimeoutError):  # its caller gives up; its thread waits on
            await asyncio.wait_for(held[0], 0.05)
        assert endpoint_mod.pending_lookups() == len(held)
    finally:
        dns.release.set()
    done = await asyncio.gather(*held[1:])
    assert all(v.allowed for v in done)
    await until_true(lambda: endpoint_mod.pending_lookups() == 0)
    default.shutdown(wait=False)


def test_a_forked_child_looks_up_on_threads_of_its_own(tmp_path):
    """The lookup threads of a parent do not exist in a forked child: the child makes its
    own, and its count starts at zero."""
    script = tmp_path / "fork.py"
    script.write_text(
        "import asyncio, os, sys\n"
        "from kvkern.xfer import endpoint\n"
        "def dns(host, port):\n"
        "    return ['10.1.2.3']\n"
        "def look():\n"
        "    return asyncio.run(asyncio.wait_for(endpoint.resolve_endpoint_async(\n"
        "        'a.example:8000', ['10.0.0.0/8'], resolver=dns), 5)).allowed\n"
        "assert look()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os._exit(0 if look() and endpoint.pending_lookups() == 0 else 3)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "sys.exit(os.waitstatus_to_exitcode(status))\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]


# ------------------------------------------------------------------------------------- CLI


def test_cli_allowed_and_refused(capsys, monkeypatch):
    monkeypatch.delenv("KVKERN_ALLOWLIST", raising=False)
    assert check_endpoint_main(["10.0.0.5:8000", "--allow", "10.0.0.0/8:8000"]) == 0
    out = capsys.readouterr().out
    assert "verdict    allowed" in out and "http://10.0.0.5:8000/kvkern/v1/state" in out
    assert check_endpoint_main(["http://0x7f.1:8000", "--allow", "10.0.0.0/8"]) == 3
    out = capsys.readouterr().out
    assert "refused: loopback" in out and "127.0.0.1" in out
    assert check_endpoint_main(["10.0.0.5:8000"]) == 3
    assert "empty_allowlist" in capsys.readouterr().out


def test_cli_json_dp_rank_and_env(capsys, monkeypatch):
    monkeypatch.setenv("KVKERN_ALLOWLIST", "10.0.0.0/8:8000-8010")
    rc = check_endpoint_main(["tcp://10.0.0.5:7000", "--dp-rank", "2", "--state-port-offset",
                              "1000", "--json"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["allowed"] and doc["reason"] == "allowed"
    assert doc["resolved"]["port"] == 8002 and doc["resolved"]["control"] == "tcp://10.0.0.5:7002"
    assert doc["resolved"]["url"] == "http://10.0.0.5:8002/kvkern/v1/state"
    rc = check_endpoint_main(["http://10.0.0.5:9000", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 3 and doc["reason"] == "port_not_allowed" and doc["resolved"] is None


def test_cli_usage_errors(capsys):
    assert check_endpoint_main(["10.0.0.5", "--allow", "10.0.0.1/8"]) == 2
    assert "allowlist entry" in capsys.readouterr().err
    assert check_endpoint_main([]) == 2


def test_cli_subprocess():
    env = {k: v for k, v in os.environ.items() if k != "KVKERN_ALLOWLIST"}
    run = lambda *a: subprocess.run([sys.executable, "-m", "kvkern", "check-endpoint", *a],
                                    cwd=REPO, env=env, capture_output=True, text=True,
                                    timeout=60)
    refused = run("http://2130706433:8000/", "--allow", "10.0.0.0/8")
    assert refused.returncode == 3, refused.stderr
    assert "loopback" in refused.stdout


# ------------------------------------------------------------------------------ fetch_state


@pytest.fixture
async def state_server():
    from aiohttp import web

    seen: dict[str, str] = {}

    async def ok(request):
        seen["host"] = request.headers.get("Host", "")
        return web.Response(body=b'{"state": "ok"}', content_type="application/json")

    async def redirect(request):
        raise web.HTTPFound("http://169.254.169.254/latest/meta-data/")

    async def big(request):
        return web.Response(body=b"x" * 5000)

    async def big_streamed(request):
        resp = web.StreamResponse()
        await resp.prepare(request)  # no Content-Length: chunked
        for _ in range(10):
            await resp.write(b"y" * 1000)
        await resp.write_eof()
        return resp

    async def slow(request):
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(b"partial")
        await asyncio.sleep(5)
        return resp

    async def error(request):
        return web.Response(status=500, text="boom")

    async def gzip(request):
        return web.Response(body=b"\x1f\x8b", headers={"Content-Encoding": "gzip"})

    app = web.Application()
    for path, handler in [("/ok", ok), ("/redirect", redirect), ("/big", big),
                          ("/big-streamed", big_streamed), ("/slow", slow),
                          ("/error", error), ("/gzip", gzip)]:
        app.router.add_get(path, handler)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        yield port, seen
    finally:
        await runner.cleanup()


def _resolved(port, path):
    allow = [f"state.test:{port}", f"127.0.0.1:{port}"]
    dns = FakeDNS({"state.test": ["127.0.0.1"]})
    v = resolve_endpoint(f"http://state.test:{port}{path}", allow, resolver=dns)
    assert v.allowed, v
    return v.endpoint


async def test_fetch_state_ok_pins_ip_and_sends_host(state_server):
    port, seen = state_server
    body = await fetch_state(_resolved(port, "/ok"), timeout_s=5, max_bytes=1000)
    assert body == b'{"state": "ok"}'
    assert seen["host"] == f"state.test:{port}"


@pytest.mark.parametrize(
    "path,max_bytes,reason",
    [
        ("/redirect", 1000, "redirect"),
        ("/big", 1000, "response_too_large"),
        ("/big-streamed", 4000, "response_too_large"),
        ("/error", 1000, "metadata_fetch_failed"),
        ("/gzip", 1000, "metadata_fetch_failed"),
    ],
)
async def test_fetch_state_refusals(state_server, path, max_bytes, reason):
    port, _ = state_server
    with pytest.raises(FetchError) as info:
        await fetch_state(_resolved(port, path), timeout_s=5, max_bytes=max_bytes)
    assert info.value.reason == reason, info.value


async def test_fetch_state_exact_limit_ok(state_server):
    port, _ = state_server
    assert len(await fetch_state(_resolved(port, "/big-streamed"), timeout_s=5,
                                 max_bytes=10000)) == 10000


async def test_fetch_state_slow_body_times_out(state_server):
    port, _ = state_server
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(FetchError) as info:
        await fetch_state(_resolved(port, "/slow"), timeout_s=0.3, max_bytes=1000)
    assert info.value.reason == "metadata_timeout"
    assert loop.time() - t0 < 2.0


async def test_fetch_state_connection_refused():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ep = ResolvedEndpoint(scheme="http", host="127.0.0.1", ip="127.0.0.1", port=port,
                          path="/ok", addresses=("127.0.0.1",))
    with pytest.raises(FetchError) as info:
        await fetch_state(ep, timeout_s=5, max_bytes=10)
    assert info.value.reason == "metadata_fetch_failed"
