"""Failure codes of the pull path as enums, and the one table from each to the
:class:`~kvkern.xfer.outcome.Reason` a destination records.

* :class:`RejectCode`: the ``<code>`` of a source's ``PullReply.reason`` (``"<code>:
  <detail>"``) for BUSY, MISS, PARTIAL, REJECTED and ERROR replies;
* :class:`TransportFailure`: :attr:`kvkern.xfer.transport.TransportError.reason`;
* :class:`FetchFailure`: :attr:`kvkern.xfer.endpoint.FetchError.reason` (state fetches).

The enums are ``StrEnum``: a code compares equal to its text, which is what travels.
"""

from __future__ import annotations

import enum

from kvkern.xfer.messages import MAX_TEXT
from kvkern.xfer.outcome import Reason

__all__ = ["CONNECT_FAILURES", "FETCH_REASONS", "REJECT_REASONS", "TRANSPORT_REASONS",
           "FetchFailure", "RejectCode", "TransportFailure", "fetch_reason", "reject_reason",
           "reply_text", "transport_reason"]


class RejectCode(enum.StrEnum):
    """Why a source did not serve (all of) a request; the head of ``PullReply.reason``."""

    HASH_SCHEME_MISMATCH = "hash_scheme_mismatch"
    INCOMPATIBLE_MODEL = "incompatible_model"
    WRONG_RANK = "wrong_rank"
    BAD_PIECE = "bad_piece"
    TOO_MANY_CHUNKS = "too_many_chunks"
    DUPLICATE_TRANSFER = "duplicate_transfer"
    BAD_REQUEST = "bad_request"
    BUSY = "busy"
    MISS = "miss"
    PARTIAL = "partial"
    INTERNAL = "internal"


class TransportFailure(enum.StrEnum):
    """Why a transport operation failed (see :mod:`kvkern.xfer.transport`, "Errors")."""

    TRANSFER_TIMEOUT = "transfer_timeout"
    TRANSFER_FAILED = "transfer_failed"
    PEER_CLOSED = "peer_closed"
    CONNECT_TIMEOUT = "connect_timeout"
    CONNECT_FAILED = "connect_failed"
    PROTOCOL_ERROR = "protocol_error"
    AUTH_FAILED = "auth_failed"
    CLOSED = "closed"


class FetchFailure(enum.StrEnum):
    """Why a state fetch failed (see :func:`kvkern.xfer.endpoint.fetch_state`)."""

    METADATA_FETCH_FAILED = "metadata_fetch_failed"
    METADATA_TIMEOUT = "metadata_timeout"
    RESPONSE_TOO_LARGE = "response_too_large"
    REDIRECT = "redirect"
    UNAUTHENTICATED = "unauthenticated"


# A REJECTED / ERROR reply's code -> the destination's reason; codes not listed are
# ``transfer_failed`` (BUSY and MISS replies map by their status, not their code).
REJECT_REASONS: dict[RejectCode, Reason] = {
    RejectCode.HASH_SCHEME_MISMATCH: Reason.HASH_SCHEME_MISMATCH,
    RejectCode.INCOMPATIBLE_MODEL: Reason.INCOMPATIBLE_MODEL,
}
# A transport failure -> the destination's reason; others are ``transfer_failed``.
TRANSPORT_REASONS: dict[TransportFailure, Reason] = {
    TransportFailure.TRANSFER_TIMEOUT: Reason.TRANSFER_TIMEOUT,
    TransportFailure.AUTH_FAILED: Reason.UNAUTHENTICATED,
}
# A state fetch failure -> the destination's reason; others are ``metadata_fetch_failed``.
FETCH_REASONS: dict[FetchFailure, Reason] = {
    FetchFailure.METADATA_TIMEOUT: Reason.METADATA_TIMEOUT,
    FetchFailure.UNAUTHENTICATED: Reason.UNAUTHENTICATED,
}
# Failures before any data moved on a connection: the source may have restarted.
CONNECT_FAILURES = frozenset({TransportFailure.CONNECT_FAILED, TransportFailure.CONNECT_TIMEOUT,
                              TransportFailure.PEER_CLOSED, TransportFailure.CLOSED})


def reply_text(code: RejectCode, detail: str) -> str:
    """A reply's ``reason``: ``"<code>: <detail>"``, cut to the protocol's text limit."""
    text = f"{code.value}: {detail}"
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT - 3] + "..."


def reject_reason(text: str) -> Reason:
    """The destination's reason for a REJECTED / ERROR reply whose ``reason`` is ``text``."""
    head = text.partition(":")[0].strip()
    try:
        code = RejectCode(head)
    except ValueError:
        return Reason.TRANSFER_FAILED
    return REJECT_REASONS.get(code, Reason.TRANSFER_FAILED)


def transport_reason(code: str) -> Reason:
    """The destination's reason for a :class:`TransportError` of ``code``."""
    try:
        return TRANSPORT_REASONS.get(TransportFailure(code), Reason.TRANSFER_FAILED)
    except ValueError:
        return Reason.TRANSFER_FAILED


def fetch_reason(code: str) -> Reason:
    """The destination's reason for a :class:`FetchError` of ``code``."""
    try:
        return FETCH_REASONS.get(FetchFailure(code), Reason.METADATA_FETCH_FAILED)
    except ValueError:
        return Reason.METADATA_FETCH_FAILED
