"""Source discovery (kvkern.xfer.discovery): the UCX addresses a source state names are
checked against the allowlist, and an allowed one is not checked again."""

from __future__ import annotations

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
