"""The vLLM connector's settings (``kv_connector_extra_config``): defaults safe on one host,
every bad or unknown key refused by name. No vLLM needed."""

from __future__ import annotations

import pytest

from kvkern.integrations.vllm.config import ConnectorConfig


def test_defaults_stay_on_loopback():
    cfg = ConnectorConfig.from_extra(None)
    assert (cfg.listen_host, cfg.listen_port, cfg.allowlist) == ("127.0.0.1", 0, ("127.0.0.1",))
    assert not cfg.trust_unsigned_hints and cfg.serve and cfg.policy == "strict"
    assert cfg.remote_read == "off"  # reads are an opt-in (SECURITY.md)
    assert cfg.accept_from is None  # (the source's default: loopback, as listen is)


def test_the_three_settings_an_operator_gives():
    cfg = ConnectorConfig.from_extra({"listen": "[::1]:8600", "allowlist": "10.0.0.0/8, 10.1.0.5",
                                      "fleet_secret_file": "/etc/kvkern/fleet.key",
                                      "advertise_host": "10.0.0.5", "deadline_s": 30,
                                      "trust_unsigned_hints": True, "max_inflight_pulls": 8})
    assert (cfg.listen_host, cfg.listen_port) == ("::1", 8600)
    assert cfg.allowlist == ("10.0.0.0/8", "10.1.0.5")
    assert cfg.deadline_s == 30.0 and cfg.trust_unsigned_hints and cfg.max_inflight_pulls == 8
    assert ConnectorConfig.from_extra({"allowlist": ["a", "b"]}).allowlist == ("a", "b")
    assert ConnectorConfig.from_extra({"gil_switch_interval_s": None}).gil_switch_interval_s \
        is None
    assert ConnectorConfig.from_extra({"remote_read": "host"}).remote_read == "host"
    assert ConnectorConfig.from_extra({"accept_from": "10.0.0.0/16, fd00::/8"}).accept_from \
        == ("10.0.0.0/16", "fd00::/8")


@pytest.mark.parametrize("extra,match", [
    ({"listne": "x:1"}, "unknown kvkern connector setting"),
    ({"listen": "8600"}, "host:port"),
    ({"listen": "h:70000"}, "port in"),
    ({"allowlist": 5}, "allowlist"),
    ({"accept_from": "10.0.0.0/16, fleet"}, "accept_from entry 'fleet'"),
    ({"accept_from": ""}, "accept_from names no network"),
    ({"trust_unsigned_hints": "yes"}, "true or false"),
    ({"deadline_s": 0}, "positive number"),
    ({"deadline_s": float("nan")}, "positive number"),
    ({"max_inflight_pulls": 0}, ">= 1"),
    ({"policy": "maybe"}, "strict"),
    ({"remote_read": "on"}, "remote_read must be one of"),
    ({"remote_read": True}, "remote_read must be one of"),
    ({"model_id": 3}, "must be a string"),
    ({"gil_switch_interval_s": -1}, "positive number"),
])
def test_bad_settings_are_refused_by_name(extra, match):
    with pytest.raises(ValueError, match=match):
        ConnectorConfig.from_extra(extra)
