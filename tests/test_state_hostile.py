"""State documents from a hostile source (kvkern.xfer.state): values that end up in every
outcome of a pull are bounded when the state is parsed."""

from __future__ import annotations

import json

import pytest

from kvkern.xfer.state import MAX_ID_CHARS, parse_state


def state_doc(**fields: object) -> dict:
    """A minimal valid state document, with ``fields`` replaced."""
    doc = {"protocol": "kvkern/1", "worker_id": "w", "incarnation": "i", "hash_scheme": "x",
           "block_size": 16, "codec_fingerprint": "00",
           "topology": {"model": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8,
                                  "block_size": 16, "dtype": "bfloat16"},
                        "parallel": {"tp_size": 1, "pp_size": 1, "dp_size": 1,
                                     "attention_dp": False}},
           "dp_groups": {"0": {"ranks": {"0": {"ucx_host": "127.0.0.1", "ucx_port": 1}}}}}
    doc.update(fields)
    return doc


@pytest.mark.parametrize("field", ["worker_id", "incarnation"])
def test_a_long_worker_id_or_incarnation_makes_the_state_invalid(field):
    """A 10 KB ``worker_id`` or ``incarnation`` (each would be copied into every outcome
    and its log line) is refused as an invalid state naming the field; one of
    MAX_ID_CHARS characters is taken."""
    with pytest.raises(ValueError, match=rf"state invalid: .*\$\.{field}"):
        parse_state(json.dumps(state_doc(**{field: "x" * 10_000})))
    with pytest.raises(ValueError, match=field):
        parse_state(state_doc(**{field: "x" * (MAX_ID_CHARS + 1)}))
    state = parse_state(json.dumps(state_doc(**{field: "x" * MAX_ID_CHARS})))
    assert getattr(state, field) == "x" * MAX_ID_CHARS
