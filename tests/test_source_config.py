"""SourceConfig: one frozen configuration of the source, validated once; SourceService
accepts it or its fields as keywords."""

from __future__ import annotations

import pytest

from kvkern.xfer.source_config import PeerQuotas, SourceConfig


def test_keywords_and_config_build_the_same_service():
    from kvkern.cache.pool import BlockPool
    from kvkern.xfer.kvgroup import KVGroup, RankKV
    from kvkern.xfer.source import SourceService
    from tests.test_layout_segments import topo

    t = topo()
    lay = t.local_layout(0, 8, "trtllm")
    group = KVGroup(t, 0, BlockPool(8, block_size=t.model.block_size),
                    {0: RankKV(0, lay, lay.allocate(fill="zeros"))})
    cfg = SourceConfig(worker_id="w", chunk_bytes=1 << 20, read_hold_s=1.0)
    a = SourceService([group], config=cfg, credential=None)
    b = SourceService([group], worker_id="w", chunk_bytes=1 << 20, read_hold_s=1.0,
                      credential=None, quotas=None)
    assert a.config == b.config
    assert a.chunk_bytes == 1 << 20 and a.read_hold_s == 1.0 and a.advertise_host == "127.0.0.1"
    c = SourceService([group], config=cfg, chunk_bytes=4096, credential=None)
    assert c.config.chunk_bytes == 4096 and c.config.read_hold_s == 1.0


@pytest.mark.parametrize("kw,match", [
    ({"chunk_bytes": 0}, "chunk_bytes must be a positive int, got 0"),
    ({"pack_threads": True}, "pack_threads must be a positive int"),
    ({"staging_cache_bytes": -1}, "staging_cache_bytes must be an int >= 0"),
    ({"remote_read": "yes"}, "remote_read must be one of"),
    ({"read_hold_s": 120.0}, "read_hold_s must be a finite number in"),
    ({"max_send_s": float("inf")}, "max_send_s must be a finite number > 0"),
    ({"idle_connection_s": 0}, "idle_connection_s must be a finite number > 0"),
    ({"host": "0.0.0.0"}, "advertise_host"),
    ({"accept_from": ("10.0.0.0/8", "10.0.0.0/99")}, "accept_from entry '10.0.0.0/99'"),
    ({"accept_from": ()}, "accept_from names no network"),
    ({"accept_from": 10}, "accept_from must be a string or a list of strings"),
    ({"worker_id": "w" * 257}, "worker_id must be a string of 1 to 256 characters"),
    ({"worker_id": ""}, "worker_id must be a string of 1 to 256 characters"),
])
def test_bad_values_are_named(kw, match):
    with pytest.raises(ValueError, match=match):
        SourceConfig(**{"worker_id": "w", **kw})


def test_quotas_are_checked():
    with pytest.raises(ValueError, match="max_sends_per_peer must be a positive int"):
        PeerQuotas(max_sends_per_peer=0)
    for name in ("max_connections_per_peer", "max_connections"):
        with pytest.raises(ValueError, match=f"{name} must be a positive int"):
            PeerQuotas(**{name: 0})
    with pytest.raises(ValueError, match=r"peer_pin_fraction must be in \(0, 1\]"):
        PeerQuotas(peer_pin_fraction=1.5)
    assert SourceConfig(worker_id="w", host="0.0.0.0", advertise_host="10.0.0.1").peer_host \
        == "10.0.0.1"


def test_who_may_connect_defaults_to_loopback_on_a_loopback_host():
    """UCX listens on every interface whatever ``host`` says: a source bound to loopback
    accepts UCX connections from loopback only; one bound elsewhere from any address,
    until ``accept_from`` names the fleet's networks."""
    from kvkern.xfer.networks import ANY, LOOPBACK, Networks

    assert SourceConfig(worker_id="w").accept_networks == LOOPBACK
    assert SourceConfig(worker_id="w", host="localhost").accept_networks == LOOPBACK
    assert SourceConfig(worker_id="w", host="::1").accept_networks == LOOPBACK
    assert SourceConfig(worker_id="w", host="10.0.0.5").accept_networks == ANY
    assert SourceConfig(worker_id="w", host="0.0.0.0", advertise_host="10.0.0.5") \
        .accept_networks == ANY
    cfg = SourceConfig(worker_id="w", host="0.0.0.0", advertise_host="10.0.0.5",
                       accept_from="10.0.0.0/16")
    assert cfg.accept_from == ("10.0.0.0/16",)
    assert cfg.accept_networks == Networks.parse("10.0.0.0/16")
    assert "10.0.9.9" in cfg.accept_networks and "10.1.0.1" not in cfg.accept_networks
