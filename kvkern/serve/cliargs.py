"""Shared pieces of the ``kvkern worker`` and ``kvkern router`` command lines: a parser whose
usage errors are one line, flag value types that name the bad value, and the one-line report
of a mistake found after parsing (exit status 2, never a traceback)."""

from __future__ import annotations

import argparse
import errno
import sys

__all__ = [
    "BIND_ERRNOS",
    "EXIT_USAGE",
    "LOG_LEVELS",
    "Parser",
    "UsageError",
    "bind_error",
    "check_port_free",
    "credential_fix",
    "nonneg_float",
    "nonneg_int",
    "port",
    "positive_float",
    "positive_int",
    "report",
]

EXIT_USAGE = 2
#: errors of listening on an address that are the operator's to fix
BIND_ERRNOS = frozenset({errno.EADDRINUSE, errno.EACCES, errno.EADDRNOTAVAIL})
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


class UsageError(ValueError):
    """A flag value or combination the command cannot run with; the message names the
    problem and the fix."""


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` to a flag's help when X is a value; a flag whose default is
    unset (None, empty, off) says in its own words what happens without it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        unset = action.default is None or action.default is False or (
            isinstance(action.default, (list, tuple)) and not action.default)
        if unset or "default" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """``argparse`` with every flag's default in its help and usage errors on one line."""

    def __init__(self, **kw) -> None:
        kw.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(**kw)

    def error(self, message: str):  # noqa: D401 (argparse's name)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def report(prog: str, message: str) -> int:
    """Print ``prog: error: message`` as one line on stderr; return the usage exit status."""
    text = " ".join(str(message).split())
    print(f"{prog}: error: {text}", file=sys.stderr, flush=True)
    return EXIT_USAGE


def credential_fix(exc: Exception) -> str:
    """A fleet-secret problem's message, with the fix when it does not name one."""
    text = str(exc)
    if "kvkern secret" in text:
        return text
    return (f"{text}; pass --fleet-secret-file with a readable file holding a secret made by "
            "`kvkern secret`")


def bind_error(exc: OSError, host: str, port: int) -> UsageError:
    """A failure to listen on ``host:port``, as a usage error naming the fix."""
    if exc.errno == errno.EADDRINUSE:
        return UsageError(f"port {port} on {host} is already in use; stop the process holding "
                          "it or pick another --port")
    if exc.errno == errno.EACCES:
        return UsageError(f"no permission to listen on port {port}; use a port above 1023")
    why = exc.strerror or str(exc)
    return UsageError(f"cannot listen on {host}:{port} ({why}); pass a --host the worker's "
                      "host owns (127.0.0.1, 0.0.0.0, ...)")


def check_port_free(host: str, port: int) -> None:
    """Raise :class:`UsageError` when ``host:port`` cannot be listened on now (port 0 always
    can), so the mistake shows before anything slow starts."""
    if port == 0:
        return
    import socket  # noqa: PLC0415

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise UsageError(f"--host {host!r} does not resolve ({exc.strerror}); pass an address "
                         "the worker's host owns") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind
        try:
            s.bind(addr)
        except OSError as exc:
            if exc.errno not in BIND_ERRNOS:
                raise
            raise bind_error(exc, host, port) from None


def _number(kind, text: str, *, low: float, strict: bool, what: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    if value < low or (strict and value == low):
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return value


def positive_float(text: str) -> float:
    return _number(float, text, low=0.0, strict=True, what="a number > 0")


def nonneg_float(text: str) -> float:
    return _number(float, text, low=0.0, strict=False, what="a number >= 0")


def positive_int(text: str) -> int:
    return _number(int, text, low=1, strict=False, what="an integer >= 1")


def nonneg_int(text: str) -> int:
    return _number(int, text, low=0, strict=False, what="an integer >= 0")


def port(text: str) -> int:
    value = _number(int, text, low=0, strict=False, what="a port in 0..65535")
    if value > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port in 0..65535")
    return value
