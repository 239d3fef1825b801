"""Blocking JSON over HTTP for the demo, the tests and the router's CLI: stdlib only, proxy
environment variables ignored (a loopback request must never go to a proxy), every call under
a timeout."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

__all__ = ["HTTPError", "get_json", "get_text", "post_json"]

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class HTTPError(RuntimeError):
    """A non-2xx answer; ``status`` and ``body`` (text) kept."""

    def __init__(self, url: str, status: int, body: str) -> None:
        super().__init__(f"{url}: HTTP {status}: {body[:500]}")
        self.status = status
        self.body = body


def _open(req: urllib.request.Request, timeout: float) -> bytes:
    try:
        with _OPENER.open(req, timeout=timeout) as r:
            return r.read()
    except urllib.error.HTTPError as exc:
        body = exc.read().decode("utf-8", "replace")
        raise HTTPError(req.full_url, exc.code, body) from None


def get_text(url: str, *, timeout: float) -> str:
    return _open(urllib.request.Request(url), timeout).decode("utf-8", "replace")


def get_json(url: str, *, timeout: float) -> Any:
    return json.loads(_open(urllib.request.Request(url), timeout))


def post_json(url: str, body: Any, *, timeout: float) -> Any:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    return json.loads(_open(req, timeout))
