"""The test fleet's credential (``tests/conftest.py`` puts its secret in the environment),
signed requests to a worker's peer endpoints and router-signed hints."""

from __future__ import annotations

import asyncio
import json
import urllib.parse
import urllib.request
from collections.abc import Sequence

from kvkern.xfer.auth import Credential, HttpVerifier, authority, serves_request, sign_hint
from kvkern.xfer.hints import KvHint, decode_hint

CREDENTIAL = Credential.from_env(peer_id="test-suite")
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def to_of(base_url: str) -> str:
    """The ``host:port`` a signed request to ``base_url`` names its server with."""
    u = urllib.parse.urlsplit(base_url if "//" in base_url else f"http://{base_url}")
    return authority(u.hostname, u.port or 80)


def peer_headers(method: str, path: str, base_url: str) -> dict[str, str]:
    """Headers that authenticate one request to a path under ``/kvkern/`` of the server at
    ``base_url``."""
    headers, _ = CREDENTIAL.sign_request(method, path, to=to_of(base_url))
    return headers


def peer_get(base_url: str, path: str, *, timeout: float = 10.0,
             credential: Credential = CREDENTIAL) -> dict:
    """GET a peer endpoint of a worker as a fleet member (of ``credential``'s fleet) would;
    checks the answer's signature too."""
    headers, nonce = credential.sign_request("GET", path, to=to_of(base_url))
    req = urllib.request.Request(f"{base_url}{path}", headers=headers)
    with _OPENER.open(req, timeout=timeout) as r:
        body = r.read()
        assert credential.verify_response(nonce, body, r.headers.get("X-Kvkern-Auth-Response"))
    return json.loads(body)


async def prove_host(http_port: int, host: str = "127.0.0.1") -> None:
    """Fetch a source's signed state as a destination does before it connects: the source's
    UCX listeners then take connections from this host (``SourceConfig.proven_host_ttl_s``)."""
    from kvkern.xfer.source import STATE_PATH  # noqa: PLC0415

    await asyncio.to_thread(peer_get, f"http://{host}:{http_port}", STATE_PATH)


def signed(body: dict, *, cache_salt: str = "", credential: Credential | None = None) -> dict:
    """``body`` with its hint signed as the fleet's router signs it (for ``body``'s own
    ``token_ids``)."""
    hint = decode_hint(body)
    assert isinstance(hint, KvHint), hint
    tokens: Sequence[int] = body["token_ids"]
    return {**body, **sign_hint(credential or CREDENTIAL, hint, tokens,
                                cache_salt=body.get("cache_salt", cache_salt))}


def signed_listing(request, body: dict):
    """An aiohttp answer as a fleet member gives it to a peer path: 401 unless ``request``
    is signed with the test fleet's secret, else ``body`` with the answer's signature."""
    from aiohttp import web  # noqa: PLC0415

    verdict = HttpVerifier(CREDENTIAL).check("GET", request.raw_path,
                                             request.headers.get("X-Kvkern-Auth"),
                                             serves=serves_request(request))
    if not verdict.ok:
        return web.json_response({"error": "unauthorized"}, status=401)
    resp = web.json_response(body)
    resp.headers["X-Kvkern-Auth-Response"] = CREDENTIAL.response_mac(verdict.nonce, resp.body)
    return resp
