"""Reads from a source process on the same host with ``process_vm_readv``, in large batches.

On one host UCX moves a one-sided read with its CMA transport, which is the same system call,
but UCX passes at most 16 local pieces to each call (``UCT_SM_MAX_IOV``, a compile-time
constant) and posts, progresses and completes every run as a request. A read scattered over
many small pieces (a TP reshard's head slices: 16 KiB pieces) is then bound by the number of
calls: two threads reading 16 KiB pieces at a 32 KiB stride moved 11.6-12.4 GB/s with 256
pieces per call and 6.6-8.3 GB/s with 16 (``docs/performance.md``). Here one call takes up to
``IOV_MAX`` (1024) pieces on each side, straight from the runs the pull planned::

    source (RegionRegistry)                      destination (ReadLanes, a lane's thread)
    Beacon: 16 random bytes at an address   ->   state's read_local {host, pid, at, token}
                                                 parse: same host id (boot id, pid namespace)
                                                 usable: read `at` in `pid`, compare the token
                                                 reading: process_vm_readv per <= 1024 pieces

Trust: the announcement is public (every peer fetches the state), so it proves nothing by
itself: a peer could announce another process on this host (its process id and token, copied
from that process's own state) and name addresses in it. So a destination takes an
announcement only from the process that served it (:func:`serves`): the state's address is
one of this host's and the announced process holds the socket listening on it, which only
that process can; the addresses a source then names (its read directory, its grants) come
from the process they are read in. The token then proves that the process id still names that
process (not another that now holds the number): it is read again before a read once its last
check is :data:`PASS_TTL_S` old. Any process that may call ``process_vm_readv`` on the source
(same user, the host's ptrace policy) may read all of its memory anyway; what the checks keep
is that a peer cannot point this process's reads at a process other than itself. Where the
call is not permitted, the host differs, the process does not serve the state or the token
does not match, the reads go through UCX as before; but a process that passed and then fails
the check (it ended, or another holds its id) is :func:`gone`, and its reads fail. A failed
call fails the read (``transfer_failed``), never a partial one.

Linux only (the system call); elsewhere :func:`parse` finds no host id and nothing changes.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import ipaddress
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from kvkern.xfer.ucp_rma import UCS_ERR_IO_ERROR, RmaError, Scatter

if TYPE_CHECKING:
    from kvkern.xfer.pauses import Steps

__all__ = ["Beacon", "LocalReadError", "LocalSource", "host_id", "parse", "reading",
           "serves", "usable", "gone", "forget", "refusals", "calls", "CALL_BYTES", "HOLD_BYTES",
           "IOV_MAX", "TOKEN_BYTES"]

log = logging.getLogger("kvkern.xfer")

IOV_MAX = 1024  # the kernel's UIO_MAXIOV: pieces per side of one call
# bytes of one call at most (a longer run is cut): a stop or a passed deadline is seen between
# calls, within the copy of one (13 ms at 5 GB/s). Each call releases the interpreter lock and
# takes it back at its end, which in an engine's process can wait up to the interpreter's switch
# interval: fewer, larger calls (docs/performance.md)
CALL_BYTES = 64 << 20
# calls of at most this many bytes (directory reads, small pulls: microseconds) keep the
# interpreter lock: taking it back after such a call can cost more than the call
HOLD_BYTES = 256 << 10
TOKEN_BYTES = 16
_MAX_PID = 1 << 22  # PID_MAX_LIMIT on 64-bit Linux
_MAX_HOST_CHARS = 128
_VERDICTS_MAX = 1024
REFUSAL_TTL_S = 60.0  # a refused source is checked again after this long
# ... and a passed one once its check is this old: a process id freed by a source that ended
# and taken by another process is refused within it (a check is one 16-byte call, 7 us)
PASS_TTL_S = 1.0

Run = tuple[int, int, int]  # (local address, remote address, nbytes)


class LocalReadError(RmaError):
    """A ``process_vm_readv`` call that failed or moved fewer bytes than asked (the read is
    not used; mapped to ``transfer_failed`` as a failed UCX read is)."""

    def __init__(self, what: str) -> None:
        Exception.__init__(self, what)
        self.status = UCS_ERR_IO_ERROR


class LocalSource(NamedTuple):
    """A same-host source process as its state announces it: its ``pid`` (in this process's
    pid namespace), and ``token`` found at address ``at`` of its memory."""

    pid: int
    at: int
    token: bytes


_host: str | None | bool = False  # False: not read yet


def host_id() -> str | None:
    """This host and pid namespace as a string (the kernel's boot id and the pid namespace's
    inode): two processes with the same one may name each other by process id. None where
    either is unavailable (not Linux, or no /proc)."""
    global _host
    if _host is False:
        try:
            with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
                boot = f.read().strip()
            ns = os.stat("/proc/self/ns/pid")
            _host = f"{boot}/{ns.st_dev}:{ns.st_ino}"
        except OSError:
            _host = None
    return _host


class Beacon:
    """The source side: :data:`TOKEN_BYTES` random bytes kept at a fixed address for the
    process's life, announced with the process id (:meth:`doc`)."""

    def __init__(self) -> None:
        self._token = np.frombuffer(os.urandom(TOKEN_BYTES), np.uint8).copy()

    def doc(self) -> dict | None:
        """The state's ``read_local``; None where this process has no host id."""
        host = host_id()
        if host is None:
            return None
        return {"host": host, "pid": os.getpid(), "at": int(self._token.ctypes.data),
                "token": self._token.tobytes().hex()}


def parse(doc: object) -> LocalSource | None:
    """A state's ``read_local`` as a :class:`LocalSource` when it names a process on this
    host and pid namespace; None when absent, malformed in any way, or elsewhere (the rank is
    then read through UCX: the field is advisory)."""
    if not isinstance(doc, dict):
        return None
    host, pid, at, token = (doc.get(k) for k in ("host", "pid", "at", "token"))
    if not (isinstance(host, str) and len(host) <= _MAX_HOST_CHARS and host == host_id()):
        return None
    if not all(type(v) is int for v in (pid, at)) or not (0 < pid < _MAX_PID
                                                         and 0 < at < 1 << 64):
        return None
    if pid == os.getpid() or not isinstance(token, str) or len(token) != 2 * TOKEN_BYTES:
        return None  # (this process itself: its own reads need no system call)
    try:
        raw = bytes.fromhex(token)
    except ValueError:
        return None
    return LocalSource(pid, at, raw)


_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's "st" column


def _listeners(path: str, v6: bool, port: int) -> list[tuple[ipaddress._BaseAddress, str]]:
    """(local address, socket inode) of every socket listening on ``port`` in one of this
    network namespace's /proc/net/tcp tables."""
    out = []
    try:
        with open(path, encoding="ascii") as f:
            next(f, None)  # the header
            for line in f:
                cols = line.split()
                if len(cols) < 10 or cols[3] != _LISTEN:
                    continue
                addr_hex, _, port_hex = cols[1].partition(":")
                if int(port_hex, 16) != port:
                    continue
                raw = bytes.fromhex(addr_hex)  # 32-bit words in host (little-endian) order
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                out.append((ipaddress.IPv6Address(raw) if v6 else ipaddress.IPv4Address(raw),
                            cols[9]))
    except (OSError, ValueError):
        pass
    return out


def _listening_inodes(ip: ipaddress._BaseAddress, port: int) -> set[str]:
    """The inodes of the sockets a connection to ``ip``:``port`` on this host reaches: those
    listening on exactly that address or on every address; for an IPv4 address the IPv6
    tables' dual-stack ones only where no IPv4 socket listens on the port."""
    if ip.version == 4:
        v4 = {n for a, n in _listeners("/proc/self/net/tcp", False, port)
              if a == ip or a.is_unspecified}
        if v4:
            return v4
        mapped = ipaddress.IPv6Address(b"\0" * 10 + b"\xff\xff" + ip.packed)
        return {n for a, n in _listeners("/proc/self/net/tcp6", True, port)
                if a == mapped or a.is_unspecified}
    return {n for a, n in _listeners("/proc/self/net/tcp6", True, port)
            if a == ip or a.is_unspecified}


def serves(pid: int, ip: str, port: int) -> str | None:
    """Why process ``pid`` is not the process serving ``ip``:``port`` (the address its state
    was fetched from), or None when it is: ``ip`` is an address of this host, and ``pid``
    holds a socket listening there. Linux only (its /proc tables); elsewhere a reason."""
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return f"{ip!r} is not an IP address"
    if addr.version == 6 and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    try:  # only an address of this host's binds
        with socket.socket(socket.AF_INET6 if addr.version == 6 else socket.AF_INET,
                           socket.SOCK_DGRAM) as probe:
            probe.bind((str(addr), 0))
    except OSError:
        return f"{addr} is not an address of this host"
    inodes = _listening_inodes(addr, port)
    if not inodes:
        return f"no socket of this host listens on {addr}:{port}"
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError as exc:
        return f"the sockets of process {pid} cannot be listed: {exc.strerror}"
    wanted = {f"socket:[{n}]" for n in inodes}
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") in wanted:
                return None
        except OSError:
            continue  # (closed meanwhile)
    return f"process {pid} does not hold the socket listening on {addr}:{port}"


_calls: dict[bool, object] = {}


def _readv(hold: bool = False):
    """libc's ``process_vm_readv``: through ``ctypes.CDLL``, which releases the interpreter
    lock around the call, or with ``hold`` through ``ctypes.PyDLL``, which keeps it."""
    fn = _calls.get(hold)
    if fn is None:
        fn = (ctypes.PyDLL if hold else ctypes.CDLL)(None, use_errno=True).process_vm_readv
        fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p,
                       ctypes.c_ulong, ctypes.c_ulong]
        fn.restype = ctypes.c_ssize_t
        _calls[hold] = fn
    return fn


def _iov(rows: np.ndarray | ctypes.Array) -> tuple[int, int]:
    """The address and the count of ``struct iovec`` rows: a ``uint64 [n, 2]`` array or a
    ctypes array of ``2n`` ``c_uint64`` (address, length)."""
    if isinstance(rows, np.ndarray):
        return rows.ctypes.data, len(rows)
    return ctypes.addressof(rows), len(rows) // 2


def _call_once(pid: int, local: np.ndarray | ctypes.Array, remote: np.ndarray | ctypes.Array,
               nbytes: int) -> None:
    """One call over ``local`` and ``remote`` iovec rows (:func:`_iov`); raises
    :class:`LocalReadError` unless every byte moved."""
    got = _readv(nbytes <= HOLD_BYTES)(pid, *_iov(local), *_iov(remote), 0)
    if got != nbytes:
        err = ctypes.get_errno() if got < 0 else 0
        why = f"{errno.errorcode.get(err, err)}: {os.strerror(err)}" if err else \
            f"{got} of {nbytes} bytes"
        raise LocalReadError(f"process_vm_readv from process {pid}: {why}")


# source -> (usable, when checked, why a source that had passed was refused): a refusal is kept
# for REFUSAL_TTL_S, a pass for PASS_TTL_S or until a read fails (forget)
_verdicts: collections.OrderedDict[LocalSource, tuple[bool, float, str | None]] = \
    collections.OrderedDict()
_lock = threading.Lock()
_refused = 0  # checks that refused a source (refusals())


def usable(src: LocalSource) -> bool:
    """Whether this process may read ``src`` directly: the token read at its address equals
    the announced one. Checked with one 16-byte call and remembered, a pass for
    :data:`PASS_TTL_S` and a refusal for :data:`REFUSAL_TTL_S`; the reason for a refusal is
    logged. A source that passed and is then refused is :func:`gone`."""
    with _lock:
        verdict = _verdicts.get(src)
    if verdict is not None and time.monotonic() - verdict[1] < (
            PASS_TTL_S if verdict[0] else REFUSAL_TTL_S):
        return verdict[0]
    buf = np.zeros(TOKEN_BYTES, np.uint8)
    why = None
    try:
        _call_once(src.pid, np.array([[buf.ctypes.data, TOKEN_BYTES]], np.uint64),
                   np.array([[src.at, TOKEN_BYTES]], np.uint64), TOKEN_BYTES)
        if buf.tobytes() != src.token:
            why = "another process holds that process id now (its token differs)"
    except (LocalReadError, OSError, AttributeError) as exc:  # AttributeError: no such call
        why = str(exc)
    global _refused
    passed = verdict is not None and (verdict[0] or verdict[2] is not None)
    if why is not None:
        log.info("process %d on this host is %s: %s", src.pid,
                 "not read any more" if passed else "read through UCX", why)
    with _lock:
        _refused += why is not None
        _verdicts[src] = (why is None, time.monotonic(), why if passed else None)
        while len(_verdicts) > _VERDICTS_MAX:
            _verdicts.popitem(last=False)
    return why is None


def gone(src: LocalSource) -> str | None:
    """Why ``src`` was refused after it had passed (the process it names ended, or another
    holds its id now), while that refusal is remembered; else None. Nothing reads such a
    source: its reads fail, where a source refused from the first is read through UCX."""
    with _lock:
        verdict = _verdicts.get(src)
    return None if verdict is None or verdict[0] else verdict[2]


def refusals() -> int:
    """How many checks of :func:`usable` refused a source in this process (each source is
    checked again every :data:`REFUSAL_TTL_S` while it is used)."""
    return _refused


def forget(src: LocalSource) -> None:
    """A read from ``src`` failed: check it again before the next one."""
    with _lock:
        _verdicts.pop(src, None)


def calls(runs: Sequence[Run | Scatter]) -> Iterator[tuple[np.ndarray | ctypes.Array,
                                                           np.ndarray | ctypes.Array, int]]:
    """``runs`` as system calls of at most :data:`IOV_MAX` pieces on each side and
    :data:`CALL_BYTES` bytes: ``(local rows, remote rows, bytes)``, the rows as :func:`_iov`
    takes them. Plain runs in a row share calls, one piece on each side per run (a longer
    one cut); a :class:`Scatter` is one remote piece over its local pieces, and neighbouring
    ones share a call."""
    i, n = 0, len(runs)
    while i < n:
        if type(runs[i]) is Scatter:
            group, pieces, nbytes = [], 0, 0
            while i < n and type(runs[i]) is Scatter and (not group or (
                    pieces + len(runs[i].local) <= IOV_MAX
                    and nbytes + runs[i].nbytes <= CALL_BYTES)):
                group.append(runs[i])
                pieces += len(runs[i].local)
                nbytes += runs[i].nbytes
                i += 1
            local = group[0].local if len(group) == 1 else np.concatenate(
                [s.local for s in group])
            remote = np.array([(s.remote, s.nbytes) for s in group], np.uint64)
            yield np.ascontiguousarray(local, np.uint64), remote, nbytes
            continue
        j = i
        while j < n and type(runs[j]) is not Scatter:
            j += 1
        small = _small_call(runs[i:j])
        if small is not None:
            yield small
        else:
            yield from _plain_calls(np.array(runs[i:j], np.uint64).reshape(-1, 3))
        i = j


_SMALL_RUNS = 32  # plain runs that fit one call are laid out without numpy up to this many


def _small_call(runs: Sequence[Run]) -> tuple[ctypes.Array, ctypes.Array, int] | None:
    """A few plain runs that fit one call, as ctypes iovec rows (a directory read, a small
    pull's blocks: 1.4 us against 16 us through numpy per read); None otherwise."""
    if len(runs) > _SMALL_RUNS:
        return None
    total = sum(run[2] for run in runs)
    if total > CALL_BYTES:
        return None
    local = (ctypes.c_uint64 * (2 * len(runs)))()
    remote = (ctypes.c_uint64 * (2 * len(runs)))()
    for k, (lo, re, nb) in enumerate(runs):
        local[2 * k], local[2 * k + 1] = lo, nb
        remote[2 * k], remote[2 * k + 1] = re, nb
    return local, remote, total


def _plain_calls(rows: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
    """Plain runs (``uint64 [n, 3]`` rows of local, remote, bytes) as calls."""
    if (rows[:, 2] > CALL_BYTES).any():  # cut the long runs into CALL_BYTES pieces
        cut = []
        for lo, re, nb in rows.tolist():
            cut += [(lo + k, re + k, min(CALL_BYTES, nb - k)) for k in range(0, nb, CALL_BYTES)]
        rows = np.array(cut, np.uint64)
    ends = np.cumsum(rows[:, 2])
    start, done = 0, 0
    while start < len(rows):
        end = int(np.searchsorted(ends, done + CALL_BYTES, side="right"))
        end = min(max(end, start + 1), start + IOV_MAX)
        part = rows[start:end]
        yield (np.ascontiguousarray(part[:, 0::2]), np.ascontiguousarray(part[:, 1:]),
               int(ends[end - 1]) - done)
        start, done = end, int(ends[end - 1])


def reading(src: LocalSource, parts: Sequence[tuple[bytes, Sequence[Run | Scatter]]],
            deadline: float, stop: threading.Event) -> Steps[float | None]:
    """Read every part's runs (their keys unused: the addresses are the source's own) from
    ``src`` on this thread; the ``perf_counter`` time the first call completed. Raises
    :class:`LocalReadError`, or TimeoutError when ``deadline`` passed or ``stop`` was set
    before a call (a call itself is one copy, bounded by the memory's speed). Steps with no
    pauses, as :meth:`kvkern.xfer.ucp_rma.ReadBatch.waiting` for a driver."""
    first = None
    for _, runs in parts:
        for local, remote, nbytes in calls(runs):
            if stop.is_set() or time.perf_counter() >= deadline:
                raise TimeoutError("read stopped" if stop.is_set() else "read deadline passed")
            _call_once(src.pid, local, remote, nbytes)
            if first is None:
                first = time.perf_counter()
    return first
    yield  # (a generator: steps for the lanes' drivers)
