"""The fleet credential (kvkern.xfer.auth): secrets, domain-separated MACs, signed HTTP
requests and answers, signed router hints, the router's hint stripping and cache salts."""

from __future__ import annotations

import hashlib
import hmac
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvkern.cache.hashing import salt_key, sequence_hashes
from kvkern.serve.router import DIALECTS, hint_fragment, router_hashes
from kvkern.xfer.auth import (
    AUTH_HEADER,
    HINT_AUTH_FIELD,
    HTTP_SKEW_S,
    Credential,
    CredentialError,
    HttpVerifier,
    addressed_to,
    authority,
    check_hint,
    generate_secret,
    sign_hint,
)
from kvkern.xfer.hints import KvHint, decode_hint, strip_hints

SECRET = "ab" * 32
CRED = Credential(SECRET, peer_id="a")
TO = "10.0.0.5:8600"  # the server the test requests are sent to


def HERE(to: str) -> bool:  # noqa: N802 (the test server: the one at TO)
    return to == TO

OTHER = Credential("cd" * 32, peer_id="a")
TOKENS = list(range(40))


# ------------------------------------------------------------------------------ secrets


def test_secret_forms_and_limits(tmp_path):
    assert len(bytes.fromhex(generate_secret())) == 32
    raw = bytes(range(40))
    assert Credential(raw).mac("hint", b"x") == Credential(raw.hex()).mac("hint", b"x")
    with pytest.raises(CredentialError, match="at least 32 bytes"):
        Credential("ab" * 31)
    with pytest.raises(CredentialError, match="at least 32 bytes"):
        Credential("short text secret")
    f = tmp_path / "secret"
    f.write_text(SECRET + "\n")
    assert Credential.from_file(str(f)).mac("hint", b"x") == CRED.mac("hint", b"x")
    with pytest.raises(CredentialError, match="cannot read"):
        Credential.from_file(str(tmp_path / "missing"))


def test_from_env_prefers_the_file_and_is_none_when_unset(tmp_path):
    f = tmp_path / "s"
    f.write_text("cd" * 32)
    env = {"KVKERN_FLEET_SECRET_FILE": str(f), "KVKERN_FLEET_SECRET": SECRET}
    assert Credential.from_env(env).mac("hint", b"") == OTHER.mac("hint", b"")
    assert Credential.from_env({"KVKERN_FLEET_SECRET": SECRET}).mac("hint", b"") == \
        CRED.mac("hint", b"")
    assert Credential.from_env({}) is None
    assert Credential.from_env({"KVKERN_FLEET_SECRET_FILE": "", "KVKERN_FLEET_SECRET": ""}) \
        is None


@pytest.mark.parametrize("edge", [b" ", b"\n", b"\t", b"\x0b", b"\x0c", b"\r"],
                         ids=["space", "newline", "tab", "vt", "ff", "cr"])
def test_secrets_whose_bytes_end_in_whitespace_read_the_same_everywhere(tmp_path, edge):
    """A random 32-byte secret may begin or end with a whitespace byte; read as hex from the
    environment or a file, it is the same credential as given directly."""
    key = edge + bytes(range(1, 31)) + edge
    text = key.hex()
    path = tmp_path / "fleet.key"
    path.write_text(text + "\n")
    direct = Credential(text, peer_id="p")
    for cred in (Credential.from_env({"KVKERN_FLEET_SECRET": text}, peer_id="p"),
                 Credential.from_env({"KVKERN_FLEET_SECRET_FILE": str(path)}, peer_id="p"),
                 Credential.from_file(str(path), peer_id="p")):
        assert cred.mac("hint", b"x") == direct.mac("hint", b"x")


def test_repr_never_shows_the_secret():
    assert SECRET not in repr(CRED) and "ab" * 8 not in repr(CRED)


def test_macs_are_separated_by_purpose_and_framing():
    assert CRED.mac("hint", b"x") != CRED.mac("http-request", b"x")
    assert CRED.mac("hint", b"ab", b"c") != CRED.mac("hint", b"a", b"bc")
    assert not CRED.verify("http-request", CRED.mac("hint", b"x"), b"x")
    assert CRED.verify("hint", CRED.mac("hint", b"x").hex(), b"x")
    assert not CRED.verify("hint", "zz", b"x") and not CRED.verify("hint", b"", b"x")
    # the construction: HMAC-SHA256 under a key derived per purpose
    key = hmac.new(bytes.fromhex(SECRET), b"kvkern/auth/v1/hint", hashlib.sha256).digest()
    assert CRED.mac("hint", b"x") == hmac.new(key, b"\x01\x00\x00\x00x",
                                              hashlib.sha256).digest()


def test_control_proofs_bind_both_nonces_and_ids():
    nc, ns = b"\x01" * 32, b"\x02" * 32
    p = CRED.server_proof(nc, ns, "c", "s")
    assert p != CRED.client_proof(nc, ns, "c", "s")
    assert p != CRED.server_proof(ns, nc, "c", "s") != CRED.server_proof(nc, ns, "s", "c")
    assert p != OTHER.server_proof(nc, ns, "c", "s")


# ----------------------------------------------------------------------------- HTTP


def test_signed_request_verifies_once_and_the_answer_is_bound_to_it():
    v = HttpVerifier(CRED)
    headers, nonce = CRED.sign_request("GET", "/kvkern/v1/state", to=TO)
    ok = v.check("GET", "/kvkern/v1/state", headers[AUTH_HEADER], serves=HERE)
    assert ok.ok and ok.peer_id == "a" and ok.nonce == nonce
    assert v.check("GET", "/kvkern/v1/state", headers[AUTH_HEADER],
                   serves=HERE).why == "replayed request"
    body = b'{"x": 1}'
    mac = CRED.response_mac(nonce, body)
    assert CRED.verify_response(nonce, body, mac)
    assert not CRED.verify_response(nonce, body + b" ", mac)
    assert not CRED.verify_response("other", body, mac)
    assert not OTHER.verify_response(nonce, body, mac)
    assert not CRED.verify_response(nonce, body, None)


@pytest.mark.parametrize("change, why", [
    (lambda h: h, None),
    (lambda h: h.replace("mac=", "mac=00"), "bad signature"),
    (lambda h: "v1" + h[2:], "malformed credentials"),
    (lambda h: h.replace(f"to={TO}", "to=10.0.0.6:8600"), "bad signature"),
    (lambda h: h.replace(f"to={TO}", "to=no port"), "malformed credentials"),
    (lambda h: h.replace(" id=a", " id=b"), "bad signature"),
    (lambda h: h + " extra=1", "malformed credentials"),
    (lambda h: h.replace("ts=", "ts=x"), "malformed credentials"),
    (lambda h: h * 10, "malformed credentials"),
    (lambda h: re.sub(r"ts=\d+", "ts=" + "9" * 350, h), "malformed credentials"),
    (lambda h: re.sub(r"ts=(\d+)", lambda m: "ts=+" + m[1], h), "malformed credentials"),
    (lambda h: re.sub(r"ts=\d", "ts=\u0663", h), "malformed credentials"),
], ids=["valid", "mac", "version", "to", "to-malformed", "peer", "field", "ts", "long",
        "huge-ts", "signed-ts", "unicode-digit-ts"])
def test_tampered_headers_are_refused(change, why):
    headers, _ = CRED.sign_request("GET", "/kvkern/v1/state", to=TO)
    got = HttpVerifier(CRED).check("GET", "/kvkern/v1/state", change(headers[AUTH_HEADER]),
                                   serves=HERE)
    assert got.ok is (why is None) and got.why == (why or "")


def test_method_path_key_and_clock_are_covered():
    headers, _ = CRED.sign_request("GET", "/kvkern/v1/state", to=TO, now=1000.0)
    h = headers[AUTH_HEADER]
    v = HttpVerifier(CRED)
    assert v.check("GET", "/kvkern/v1/blocks", h, now=1000.0, serves=HERE).why == "bad signature"
    assert v.check("POST", "/kvkern/v1/state", h, now=1000.0, serves=HERE).why == "bad signature"
    assert HttpVerifier(OTHER).check("GET", "/kvkern/v1/state", h, now=1000.0,
                                     serves=HERE).why == \
        "bad signature"
    late = 1000.0 + HTTP_SKEW_S + 1
    assert v.check("GET", "/kvkern/v1/state", h, now=late,
                   serves=HERE).why == "stale or future timestamp"
    early = 1000.0 - HTTP_SKEW_S - 1
    assert v.check("GET", "/kvkern/v1/state", h, now=early,
                   serves=HERE).why == "stale or future timestamp"
    assert v.check("GET", "/kvkern/v1/state", h, now=1000.0, serves=HERE).ok
    assert v.check("GET", "/kvkern/v1/state", None, serves=HERE).why == "no credentials"


def test_a_request_signed_for_one_server_is_refused_by_another():
    """A signed request names the server it is sent to: a host that sees it (a non-member
    a destination asked for a state, say) cannot replay it to another fleet member."""
    headers, _ = CRED.sign_request("GET", "/kvkern/v1/state", to=TO)
    other = HttpVerifier(CRED).check("GET", "/kvkern/v1/state", headers[AUTH_HEADER],
                                     serves=lambda to: to == "10.0.0.6:8600")
    assert not other.ok and other.why == f"signed for another server ({TO})"
    assert HttpVerifier(CRED).check("GET", "/kvkern/v1/state", headers[AUTH_HEADER],
                                    serves=HERE).ok
    with pytest.raises(ValueError, match="host:port"):
        CRED.sign_request("GET", "/kvkern/v1/state", to="10.0.0.5")


@pytest.mark.parametrize("to, local, names, ok", [
    ("10.0.0.5:8600", ("10.0.0.5", 8600), (), True),
    ("10.0.0.5:8601", ("10.0.0.5", 8600), (), False),  # another port
    ("10.0.0.6:8600", ("10.0.0.5", 8600), (), False),  # another address
    ("worker-3.fleet:8600", ("10.0.0.5", 8600), ("0.0.0.0", "Worker-3.fleet."), True),
    ("worker-4.fleet:8600", ("10.0.0.5", 8600), ("worker-3.fleet",), False),
    ("localhost:8600", ("127.0.0.1", 8600), (), True),
    ("localhost:8600", ("10.0.0.5", 8600), (), False),
    ("[fd00::5]:8600", ("fd00::5", 8600, 0, 0), (), True),
    ("[FD00:0::5]:8600", ("fd00::5", 8600, 0, 0), (), True),
    ("10.0.0.5:8600", ("::ffff:10.0.0.5", 8600, 0, 0), (), True),  # (a dual-stack socket)
    ("[::ffff:10.0.0.5]:8600", ("10.0.0.5", 8600), (), True),
    ("10.0.0.5:8600", None, (), False),
    ("10.0.0.5", ("10.0.0.5", 8600), (), False),
], ids=lambda x: str(x))
def test_addressed_to_names_this_server_by_its_address_or_names(to, local, names, ok):
    assert addressed_to(to, local, names) is ok


@pytest.mark.parametrize("host, port, want", [
    ("10.0.0.5", 8600, "10.0.0.5:8600"), ("Worker-3.Fleet.", 80, "worker-3.fleet:80"),
    ("fd00::5", 8600, "[fd00::5]:8600"), ("[FD00::5]", 1, "[fd00::5]:1"),
    ("fe80::1%eth0", 8600, "[fe80::1]:8600")])
def test_authority_is_what_a_request_can_be_signed_for(host, port, want):
    assert authority(host, port) == want
    CRED.sign_request("GET", "/kvkern/v1/state", to=authority(host, port))


def test_a_nonce_is_refused_for_as_long_as_its_timestamp_is_accepted():
    """A request stamped ahead of the server's clock (within the allowed skew) stays
    refused as a replay until its stamp leaves the window, not for a window from its first
    use."""
    v = HttpVerifier(CRED)
    ahead = 1000.0 + HTTP_SKEW_S - 1
    headers, _ = CRED.sign_request("GET", "/kvkern/v1/state", to=TO, now=ahead)
    h = headers[AUTH_HEADER]
    assert v.check("GET", "/kvkern/v1/state", h, now=1000.0, serves=HERE).ok
    for later in (1000.0 + HTTP_SKEW_S + 1, ahead + HTTP_SKEW_S - 0.5):
        other, _ = CRED.sign_request("GET", "/kvkern/v1/state", to=TO, now=later)
        assert v.check("GET", "/kvkern/v1/state", other[AUTH_HEADER], now=later,
                       serves=HERE).ok
        assert v.check("GET", "/kvkern/v1/state", h, now=later,
                       serves=HERE).why == "replayed request"
    assert v.check("GET", "/kvkern/v1/state", h, now=ahead + HTTP_SKEW_S + 1,
                   serves=HERE).why == "stale or future timestamp"


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=600))
def test_random_headers_never_raise(header):
    assert not HttpVerifier(CRED).check("GET", "/kvkern/v1/state", header, serves=HERE).ok


# ----------------------------------------------------------------------------- hints


def _hint_body(dialect: str = "kv_hint", tokens=TOKENS, **extra) -> dict:
    frag = hint_fragment(dialect, "127.0.0.1:9000", router_hashes(tokens, 4))
    return {"token_ids": tokens, **frag, **extra}


@pytest.mark.parametrize("dialect", DIALECTS)
def test_a_router_signature_covers_its_request_in_every_dialect(dialect):
    body = _hint_body(dialect)
    hint = decode_hint(body)
    assert isinstance(hint, KvHint)
    body.update(sign_hint(CRED, hint, TOKENS))
    assert check_hint(CRED, body, decode_hint(body), TOKENS) is None


@pytest.mark.parametrize("dialect", DIALECTS)
def test_a_worker_with_other_limits_than_the_router_accepts_its_signature(dialect):
    """The router signs a hint decoded with its own limits; a worker decodes it with its
    default policy and timeout caps, which may differ: the signature covers what the hint
    states, so both agree (a best_effort worker refused every router-signed hint)."""
    from kvkern.xfer.hints import HintLimits

    body = _hint_body(dialect)
    if dialect == "kv_hint":
        body["kv_hint"] = {**body["kv_hint"], "deadline_s": 50.0}
    body.update(sign_hint(CRED, decode_hint(body), TOKENS))
    worker = HintLimits(default_policy="best_effort", max_deadline_s=30.0)
    hint = decode_hint(body, limits=worker)
    assert hint.policy == "best_effort"
    assert check_hint(CRED, body, hint, TOKENS) is None
    if dialect == "kv_hint":
        assert hint.deadline_s == 30.0 and "deadline_s" in hint.clamped
        body["kv_hint"] = {**body["kv_hint"], "policy": "best_effort"}  # not what was signed
        why = check_hint(CRED, body, decode_hint(body, limits=worker), TOKENS)
        assert why is not None and "does not match" in why, why


@pytest.mark.parametrize("what, expect", [
    ("tokens", "does not match"),
    ("salt", "does not match"),
    ("source", "does not match"),
    ("hashes", "does not match"),
    ("key", "does not match"),
    ("expired", "expired"),
    ("far future", "too far in the future"),
    ("unsigned", "not signed"),
    ("malformed", "malformed"),
    ("huge expiry", "malformed"),
    ("negative expiry", "malformed"),
    ("no credential", "no fleet credential"),
], ids=lambda x: x.replace(" ", "-"))
def test_hint_signatures_refuse_anything_else(what, expect):
    body = _hint_body()
    hint = decode_hint(body)
    body.update(sign_hint(CRED, hint, TOKENS, now=1000.0 if what == "expired" else None))
    cred, tokens, salt = CRED, TOKENS, ""
    if what == "tokens":
        tokens = [*TOKENS[:-1], 999]
    elif what == "salt":
        salt = "tenant-b"
    elif what == "source":
        body["kv_hint"] = {**body["kv_hint"], "source": "127.0.0.1:9001"}
    elif what == "hashes":
        body["kv_hint"] = {**body["kv_hint"], "block_hashes": body["kv_hint"]["block_hashes"][:-1]}
    elif what == "key":
        cred = OTHER
    elif what == "far future":
        body[HINT_AUTH_FIELD] = {**body[HINT_AUTH_FIELD],
                                 "exp": body[HINT_AUTH_FIELD]["exp"] + 10 ** 10}  # ~4 months
    elif what == "unsigned":
        del body[HINT_AUTH_FIELD]
    elif what == "malformed":
        body[HINT_AUTH_FIELD] = {"v": 1, "exp": "soon", "by": "a", "mac": "00"}
    elif what in ("huge expiry", "negative expiry"):  # (past a float's range: no arithmetic)
        body[HINT_AUTH_FIELD] = {**body[HINT_AUTH_FIELD],
                                 "exp": 10 ** 400 * (1 if what == "huge expiry" else -1)}
    elif what == "no credential":
        cred = None
    why = check_hint(cred, body, decode_hint(body), tokens, cache_salt=salt)
    assert why is not None and expect in why, why


def test_sign_hint_bounds_its_lifetime():
    hint = decode_hint(_hint_body())
    with pytest.raises(ValueError, match="ttl_s"):
        sign_hint(CRED, hint, TOKENS, ttl_s=0)
    with pytest.raises(ValueError, match="ttl_s"):
        sign_hint(CRED, hint, TOKENS, ttl_s=3600)


def test_strip_hints_removes_every_client_hint():
    body = {"token_ids": [1], "max_new_tokens": 2, HINT_AUTH_FIELD: {"v": 1},
            "kv_transfer_params": {"other": 1}, "extra_args": {"keep": True}}
    for dialect in DIALECTS:
        frag = hint_fragment(dialect, "127.0.0.1:9000", [1, 2])
        body.setdefault("extra_args", {}).update(
            {k: v for k, v in frag.items() if k != "kv_transfer_params"})
        for k, v in frag.items():
            body[k] = {**body.get(k, {}), **v} if isinstance(v, dict) else v
    body["extra_args"]["kv_transfer_params"] = hint_fragment("dynamo", "h:1", [1])[
        "kv_transfer_params"]
    assert decode_hint(body).ok
    out = strip_hints(body)
    assert decode_hint(out).reason == "no_hint"
    assert out["kv_transfer_params"] == {"other": 1} and out["extra_args"]["keep"] is True
    assert HINT_AUTH_FIELD not in out and out["max_new_tokens"] == 2
    assert decode_hint(body).ok  # the caller's body is not changed


# ----------------------------------------------------------------------------- salts


@pytest.mark.parametrize("scheme", ["public-xxh3-v1", "trtllm-v1"])
def test_salts_separate_every_chained_hash(scheme):
    plain = sequence_hashes(TOKENS, 4, scheme)
    assert sequence_hashes(TOKENS, 4, scheme, cache_salt=salt_key("")) == plain
    a = sequence_hashes(TOKENS, 4, scheme, cache_salt=salt_key("tenant-a"))
    b = sequence_hashes(TOKENS, 4, scheme, cache_salt=salt_key("tenant-b"))
    assert not (set(a) & set(b)) and not (set(a) & set(plain))
    assert a == sequence_hashes(TOKENS, 4, scheme, cache_salt=salt_key("tenant-a"))


def test_router_hashes_follow_the_salt():
    assert router_hashes(TOKENS, 4) == sequence_hashes(TOKENS, 4, "public-xxh3-v1")
    assert router_hashes(TOKENS, 4, "x") == sequence_hashes(
        TOKENS, 4, "public-xxh3-v1", cache_salt=salt_key("x"))
    assert salt_key(None) is None and salt_key("") is None
    assert salt_key("a") != salt_key("b") and 0 <= salt_key("a") < 2 ** 64
