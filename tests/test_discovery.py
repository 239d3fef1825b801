"""Source discovery (kvkern.xfer.discovery): the UCX addresses a source state names are
checked against the allowlist, and an allowed one is not checked again; resolutions are
shared; a failed connection re-checks the incarnation without changing the pull's state; a
state's same-host announcements cost one bounded check."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from kvkern.xfer import endpoint
from kvkern.xfer.config import XferConfig
from kvkern.xfer.discovery import SourceDiscovery
from kvkern.xfer.outcome import Reason
from kvkern.xfer.pulljob import Fallback


def test_rank_addresses_checked_once_refusals_every_time(monkeypatch):
    d = SourceDiscovery(XferConfig(allowlist="10.0.0.0/8:5000-5010"), None)
    calls = []
    real = endpoint.Allowlist.check
    monkeypatch.setattr(endpoint.Allowlist, "check",
                        lambda self, *a: calls.append(a) or real(self, *a))
    state = SimpleNamespace(ranks={(0, 0): ("10.1.2.3", 5000), (0, 1): ("10.1.2.4", 5001),
                                   (0, 2): ("10.1.2.5", 6000), (0, 3): ("host.example", 5000)})
    for _ in range(3):
        assert d.rank_addresses(state, 0, [0, 1]) == {0: ("10.1.2.3", 5000),
                                                      1: ("10.1.2.4", 5001)}
    assert len(calls) == 2
    for _ in range(2):
        with pytest.raises(Fallback) as info:
            d.rank_addresses(state, 0, [0, 2])
        assert info.value.reason is Reason.SOURCE_NOT_ALLOWED and "port" in info.value.detail
    assert len(calls) == 4  # (the refused address once more each time)
    with pytest.raises(Fallback, match="a name, not an address"):
        d.rank_addresses(state, 0, [3])
    with pytest.raises(Fallback) as info:
        d.rank_addresses(state, 0, [7])
    assert info.value.reason is Reason.METADATA_INVALID


def test_pulls_of_a_source_not_yet_resolved_share_one_resolution():
    """Concurrent pulls hinting one endpoint that is not resolved yet wait for one
    resolution (each would hold a thread while the resolver answers); a failed one is not
    kept, so the next pull resolves again."""
    import asyncio
    import threading
    import time

    calls: list[str] = []
    answer = ["10.1.2.3"]
    lock = threading.Lock()

    def resolver(host: str, port: int) -> list[str]:
        with lock:
            calls.append(host)
        time.sleep(0.05)
        if not answer:
            raise OSError("no such name")
        return answer

    d = SourceDiscovery(XferConfig(allowlist="10.0.0.0/8"), None, resolver=resolver)

    def job(source: str) -> SimpleNamespace:
        return SimpleNamespace(hint=SimpleNamespace(source=source, source_dp_rank=None),
                               refreshes=[])

    async def main() -> None:
        got = await asyncio.gather(*(d.resolve(job("http://src.example:8600"), 5.0)
                                     for _ in range(8)))
        assert len(calls) == 1 and {g.ip for g in got} == {"10.1.2.3"}
        answer.clear()
        for _ in range(2):
            results = await asyncio.gather(*(d.resolve(job("http://gone.example:8600"), 5.0)
                                             for _ in range(4)), return_exceptions=True)
            assert all(isinstance(r, Fallback) and r.reason is Reason.SOURCE_NOT_ALLOWED
                       for r in results), results
        assert calls == ["src.example", "gone.example", "gone.example"]
        assert not d._resolving
        await d.aclose()

    asyncio.run(main())


def test_a_worker_out_of_lookups_falls_back_busy_and_keeps_its_verdicts(monkeypatch):
    """A hint whose host name finds every lookup slot taken ends as this worker's ``busy``
    (not the source's refusal), and a background refresh refused that way keeps the cached
    verdict, which an unreachable name server did not make wrong."""
    import asyncio

    d = SourceDiscovery(XferConfig(allowlist="10.0.0.0/8", state_cache_ttl_s=0.01), None,
                        resolver=lambda host, port: ["10.1.2.3"])

    def job(source: str) -> SimpleNamespace:
        return SimpleNamespace(hint=SimpleNamespace(source=source, source_dp_rank=None),
                               refreshes=[])

    async def main() -> None:
        first = job("http://src.example:8600")
        assert (await d.resolve(first, 5.0)).ip == "10.1.2.3"
        monkeypatch.setattr(endpoint, "MAX_PENDING_LOOKUPS", 0)
        with pytest.raises(Fallback) as info:
            await d.resolve(job("http://other.example:8600"), 5.0)
        assert info.value.reason is Reason.BUSY and "lookups pending" in info.value.detail
        await asyncio.sleep(0.02)  # past the time to live: used, and refreshed after the pull
        again = job("http://src.example:8600")
        assert (await d.resolve(again, 5.0)).ip == "10.1.2.3" and again.refreshes
        d.after_pull(again)
        while d._refreshes:
            await asyncio.sleep(0.005)
        assert (await d.resolve(job("http://src.example:8600"), 5.0)).ip == "10.1.2.3"
        assert d._verdicts  # kept
        await d.aclose()

    asyncio.run(main())


def _state_doc(*, incarnation: str = "i1", tp_size: int = 2, read_worker: str = "aa",
               ranks: dict | None = None) -> dict:
    """A state document of a source with ``tp_size`` ranks (each read through UCX)."""
    if ranks is None:
        ranks = {str(r): {"ucx_host": "10.1.2.3", "ucx_port": 5000 + r, "read": "native",
                          "read_worker": read_worker} for r in range(tp_size)}
    return {"protocol": "kvkern/1", "worker_id": "w", "incarnation": incarnation,
            "hash_scheme": "x", "block_size": 16, "codec_fingerprint": "00",
            "topology": {"model": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8,
                                   "block_size": 16, "dtype": "bfloat16"},
                         "parallel": {"tp_size": tp_size, "pp_size": 1, "dp_size": 1,
                                      "attention_dp": False}},
            "dp_groups": {"0": {"ranks": ranks}}}


def _fake_fetches(monkeypatch, bodies: list) -> list:
    """``endpoint.fetch_state`` answering ``bodies`` in turn; returns the list of fetches."""
    import json

    fetched: list = []

    async def fetch_state(resolved, *, timeout_s, max_bytes, credential, **kw):
        fetched.append(resolved)
        body = bodies[min(len(fetched), len(bodies)) - 1]
        return body if isinstance(body, bytes) else json.dumps(body).encode()

    monkeypatch.setattr(endpoint, "fetch_state", fetch_state)
    return fetched


def _pull_job(source: str = "http://src.example:8600", md_t: float = 5.0) -> SimpleNamespace:
    return SimpleNamespace(hint=SimpleNamespace(source=source, source_dp_rank=None),
                           refreshes=[], timeouts=(md_t, 5.0, 10.0), state=None,
                           state_cached=False)


@pytest.mark.parametrize("fresh", [
    pytest.param(dict(tp_size=1), id="fewer_ranks"),
    pytest.param(dict(read_worker="bb"), id="other_read_worker"),
])
def test_a_failed_connection_keeps_the_state_its_pull_was_planned_with(monkeypatch, fresh):
    """A connection (or direct read) failing on a cached state fetches the state again to
    check the source's incarnation: a fresh one of the same incarnation that names other
    ranks or read workers goes to the cache for the next pulls, while the failing pull keeps
    the state its plan was made from (never a plan's source rank missing from its state)."""
    import asyncio

    from kvkern.xfer.transport import TransportError

    fetched = _fake_fetches(monkeypatch, [_state_doc(), _state_doc(**fresh)])
    d = SourceDiscovery(XferConfig(allowlist="10.0.0.0/8"), credential=object(),
                        resolver=lambda host, port: ["10.1.2.3"])

    async def main() -> None:
        first = await d.discover(_pull_job())
        job = _pull_job()
        assert await d.discover(job) is first and job.state_cached and len(fetched) == 1
        await d.connect_failed(job, TransportError("connect_failed", "refused"))
        assert len(fetched) == 2
        assert job.state is first and job.state_cached
        assert job.state.ranks.keys() == {(0, 0), (0, 1)}
        assert job.state.read_workers[(0, 0)] == b"\xaa"
        (cached, *_), = d._state_cache.values()
        assert cached is not first and cached.incarnation == first.incarnation
        later = _pull_job()
        assert await d.discover(later) is cached and len(fetched) == 2
        await d.aclose()

    asyncio.run(main())


def test_the_cached_states_are_bounded_in_bytes_not_only_in_count(monkeypatch):
    """Sources whose state documents are large (up to max_state_bytes, each parsed to several
    times that) are kept to STATE_CACHE_BYTES together, the oldest dropped first, whatever
    number of source strings the hints name."""
    import asyncio
    import json

    from kvkern.xfer import discovery as discovery_mod

    monkeypatch.setattr(discovery_mod, "STATE_CACHE_BYTES", 1 << 20)
    doc = _state_doc()
    doc["padding"] = "x" * (300 << 10)  # (an unknown field: ignored, but fetched and kept)
    _fake_fetches(monkeypatch, [json.dumps(doc).encode()])
    d = SourceDiscovery(XferConfig(allowlist="10.0.0.0/8"), credential=object(),
                        resolver=lambda host, port: ["10.1.2.3"])

    async def main() -> None:
        for i in range(10):
            await d.discover(_pull_job(f"http://src{i}.example:8600/kvkern/v1/state?v={i}"))
        sizes = [entry[2] for entry in d._state_cache.values()]
        assert len(sizes) == 3 and sum(sizes) <= 1 << 20, sizes
        assert all(key[1] in ("src7.example", "src8.example", "src9.example")
                   for key in d._state_cache)
        await d.aclose()

    asyncio.run(main())


def test_a_failed_connection_to_a_restarted_source_ends_as_incarnation_changed(monkeypatch):
    import asyncio

    from kvkern.xfer.transport import TransportError

    _fake_fetches(monkeypatch, [_state_doc(), _state_doc(incarnation="i2", tp_size=1)])
    d = SourceDiscovery(XferConfig(allowlist="10.0.0.0/8"), credential=object(),
                        resolver=lambda host, port: ["10.1.2.3"])

    async def main() -> None:
        first = await d.discover(_pull_job())
        job = _pull_job()
        await d.discover(job)
        with pytest.raises(Fallback) as info:
            await d.connect_failed(job, TransportError("connect_failed", "refused"))
        assert info.value.reason is Reason.SOURCE_INCARNATION_CHANGED
        assert job.state is first
        await d.aclose()

    asyncio.run(main())


def _many_processes(first_pid: int, n: int):
    """A state of ``n`` ranks, each announcing another process on this host for same-host
    reads, ``first_pid`` the first."""
    from kvkern.xfer.local_reads import LocalSource
    from kvkern.xfer.state import parse_state

    state = parse_state(_state_doc(tp_size=1))
    pids = [first_pid] + [4_000_000 + r for r in range(1, n)]
    return dataclasses.replace(state, read_locals={
        (0, r): LocalSource(pid, 1, b"\0" * 16) for r, pid in enumerate(pids)})


@pytest.mark.parametrize("first", ["this_process", "no_process"])
def test_a_state_naming_thousands_of_processes_costs_one_check(monkeypatch, caplog, first):
    """A state (under the size cap) whose 4500 ranks each announce another process on this
    host for same-host reads: one process serves a state, so only the first one named is
    checked (the /proc tables read once), the others are dropped unchecked, and one
    warning says so."""
    import logging
    import os
    import socket
    import time

    from kvkern.xfer import local_reads
    from kvkern.xfer.discovery import _served_state

    if local_reads.host_id() is None:
        pytest.skip("no /proc here")
    parses = []
    real = local_reads._listening_inodes
    monkeypatch.setattr(local_reads, "_listening_inodes",
                        lambda *a: parses.append(a) or real(*a))
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        resolved = SimpleNamespace(ip="127.0.0.1", port=listener.getsockname()[1],
                                   display_url="http://src.example:8600")
        state = _many_processes(os.getpid() if first == "this_process" else 4_000_000, 4500)
        caplog.set_level(logging.WARNING, "kvkern.xfer")
        t = time.perf_counter()
        served = _served_state(state, resolved)
        took = time.perf_counter() - t
    assert took < 0.5 and len(parses) <= 1
    assert served.read_locals == ({(0, 0): state.read_locals[(0, 0)]}
                                  if first == "this_process" else {})
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "4500 process(es)" in warnings[0].getMessage()


def test_checking_same_host_announcements_is_bounded_by_the_metadata_timeout(monkeypatch):
    """The check of a state's same-host announcements runs in a thread, within the state
    fetch's metadata timeout: one that does not end in time is ``metadata_timeout``, and
    the pull does not wait for it."""
    import asyncio
    import os
    import threading
    import time

    from kvkern.xfer import discovery, local_reads

    if local_reads.host_id() is None:
        pytest.skip("no /proc here")
    local = {"host": local_reads.host_id(), "pid": os.getppid() or 1, "at": 1, "token": "0" * 32}
    _fake_fetches(monkeypatch, [_state_doc(ranks={"0": {
        "ucx_host": "10.1.2.3", "ucx_port": 5000, "read": "native", "read_worker": "aa",
        "read_local": local}})])
    release = threading.Event()
    monkeypatch.setattr(discovery, "_served_state", lambda state, resolved: release.wait(10))
    d = SourceDiscovery(XferConfig(allowlist="10.0.0.0/8"), credential=object(),
                        resolver=lambda host, port: ["10.1.2.3"])

    async def main() -> None:
        t = time.perf_counter()
        with pytest.raises(Fallback) as info:
            await d.discover(_pull_job(md_t=0.2))
        assert info.value.reason is Reason.METADATA_TIMEOUT and "same-host" in info.value.detail
        assert time.perf_counter() - t < 2.0 and not d._state_cache
        release.set()  # (the thread ends on its own: asyncio.run waits for it)
        await d.aclose()

    try:
        asyncio.run(main())
    finally:
        release.set()
