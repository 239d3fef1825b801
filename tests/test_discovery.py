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
