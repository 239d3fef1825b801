"""Every use of ucxx internals, in one place: what kvkern needs from ucxx beyond its public
Python API (``create_listener``, ``create_endpoint``, ``exceptions``,
``stop_notifier_thread``), behind a small documented API. A new ucxx release is checked here
(and by tests/test_ucp_rma.py against the UCX headers), not across the transfer path.

=========================  ==========================================================
application context        :data:`APP_FEATURES`, :func:`app_features`,
                           :func:`worker_address`
notifier thread            :func:`install_notifier`, :func:`rebind_notifier`,
                           :func:`stop_notifier`
progress thread            :func:`note_cuda_device`, :func:`install_progress_start`
read contexts (``_lib``)   :func:`new_rma_context`, :func:`read_target`,
                           :func:`new_worker`, :func:`endpoint_to_address`
connection handshake       :func:`new_client_endpoint`, :func:`new_listener`,
                           :func:`close_listener`, :func:`close_endpoint`,
                           :func:`listener_handle`, :func:`conn_request_ip`,
                           :func:`endpoint_with_tags`, :func:`stream_buffer`,
                           :func:`tags_checksum` (:mod:`kvkern.xfer.handshake`),
                           :class:`CloseWatch`
libucp (ctypes)            :func:`libucp`, :func:`map_for_remote_read`, :func:`pack_rkey`,
                           :func:`unmap`,
                           :func:`unpack_rkey`, :func:`destroy_rkey`, :func:`read_poster`,
                           :func:`request_calls`, :func:`ptr_status`
=========================  ==========================================================

The private pieces used: ucxx's application context (``ucxx.core._get_ctx()`` /
``ucxx.core._ctx``: its ``context.feature_flags``, ``worker.address``, the ``ucx_api`` module
its constructor makes the context with (replaced by :func:`_restrict_app_features`),
notifier thread, its body ``_notifierThread`` (replaced by :func:`_notifier`) and the
Python-future pool), the progress thread's start callback
(``ucxx._lib_async.continuous_ucx_progress._create_context``, replaced by
:func:`_progress_thread_started`), the Cython binding ``ucxx._lib.libucxx``
(``UCXContext``, ``UCXWorker``, ``UCXAddress``, ``Feature``, ``UCXEndpoint``,
``UCXListener``; the dict a ``UCXListener`` keeps its callback in, found with
:func:`gc.get_referents`), the C++ ``ucxx::Listener::getHandle`` of libucxx (through
:mod:`ctypes`, to reject a connection request), ucxx's asyncio ``Endpoint``, ``Listener``
and listener handler tracker (its futures, cancelled by :func:`close_listener`),
``Array`` and ``hash64bits`` (a connection's first exchange), and the libucp that ucxx loaded,
bound with :mod:`ctypes` (ucxx 0.52's Python API has no RMA): the calls' signatures and the
two parameter structs of ``ucp/api/ucp.h``.

Everything here is lazy: importing this module imports neither ucxx nor libucp.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import logging
import os
import socket
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

from kvkern.xfer.ucx_env import import_ucxx

log = logging.getLogger("kvkern.xfer")

if TYPE_CHECKING:
    from ucxx._lib.libucxx import UCXAddress, UCXContext, UCXEndpoint, UCXWorker
    from ucxx._lib_async import ApplicationContext

__all__ = ["APP_FEATURES", "MemMapParams", "ReadTarget", "RequestParam", "UCS_OK",
           "app_features", "destroy_rkey", "endpoint_to_address", "libucp",
           "map_for_remote_read", "new_rma_context", "new_worker", "note_cuda_device",
           "pack_rkey", "ptr_status", "read_poster", "rebind_notifier", "request_calls",
           "read_target", "stop_notifier", "unmap", "unpack_rkey", "worker_address"]

UCS_OK = 0
UCS_ERR_LAST = -100  # the lowest ucs_status_t (UCS_ERR_LAST in ucs/type/status.h)

# ucp/api/ucp.h values (checked against the header by tests/test_ucp_rma.py)
MAP_FIELD_ADDRESS, MAP_FIELD_LENGTH, MAP_FIELD_PROT, MAP_FIELD_MEMORY_TYPE = 1, 2, 8, 16
PROT_LOCAL_READ, PROT_LOCAL_WRITE, PROT_REMOTE_READ = 1, 2, 1 << 8
OP_ATTR_FIELD_DATATYPE, OP_ATTR_FIELD_MEMORY_TYPE = 1 << 3, 1 << 6
DATATYPE_IOV = 2  # ucp_dt_make_iov(): the buffer is an array of ucp_dt_iov_t
UCP_FEATURE_RMA = 1 << 1
RKEY_PAD = 4096  # zero bytes after a received rkey (see unpack_rkey)


# ---------------------------------------------------------------- application context

# The features of ucxx's application context, whose worker listens for peers and carries
# every connection: tags, streams and wake-ups. Not RMA: a worker whose context has it answers
# UCX's software puts and gets (ucp_put_handler, ucp_get_req_handler) from any connected
# endpoint at any address, before kvkern authenticates anyone; one-sided reads use contexts
# of their own (:func:`read_target`, the read lanes'), whose transports exclude TCP. Not AM:
# kvkern sends no active messages, and ucxx would keep every one a peer sends.
APP_FEATURES = ("TAG", "WAKEUP", "STREAM")


def _app_context() -> ApplicationContext:
    """ucxx's application context, created (and bound to the running loop) on first use,
    with :data:`APP_FEATURES` only; the process then stops ucxx's notifier thread at exit
    (:func:`stop_notifier_at_exit`)."""
    ucxx = import_ucxx()
    install_notifier()
    install_progress_start()
    _restrict_app_features()
    ctx = ucxx.core._get_ctx()
    stop_notifier_at_exit()
    if not _rma_warned and int(ctx.context.feature_flags) & UCP_FEATURE_RMA:
        _warn_rma()
    return ctx


_rma_warned = False


def _warn_rma() -> None:
    """Say once that ucxx's context was made (by other code of this process, before kvkern's
    first use) with RMA, which kvkern's listener then serves to anyone (SECURITY.md)."""
    global _rma_warned
    _rma_warned = True
    logging.getLogger("kvkern.xfer").warning(
        "ucxx's UCX context was created with RMA before kvkern used it: the UCX listener "
        "answers one-sided reads and writes of this process's memory from unauthenticated "
        "peers; let kvkern create ucxx's context first (SECURITY.md)")


_exit_hook = [False]


def stop_notifier_at_exit() -> None:
    """Stop ucxx's notifier at interpreter exit. It is a non-daemon thread that only stops
    when told, so without this a process that made the context (even just to look at it)
    waits for it forever at exit. ``threading._register_atexit`` runs before non-daemon
    threads are joined (plain atexit runs after, too late); concurrent.futures uses it for
    the same problem. Idempotent."""
    if _exit_hook[0]:
        return
    _exit_hook[0] = True
    _at_exit(stop_notifier)


def _at_exit(fn: Callable[[], object]) -> None:
    """Run ``fn`` at interpreter exit, before non-daemon threads are joined."""
    register = getattr(threading, "_register_atexit", None)
    if register is None:  # not CPython 3.9+: fall back to atexit (may be too late)
        import atexit  # noqa: PLC0415

        register = atexit.register
    with contextlib.suppress(RuntimeError):  # already shutting down
        register(fn)


def _restrict_app_features() -> None:
    """Make ucxx create its application context with :data:`APP_FEATURES` (ucxx asks for
    every feature and takes no say in it): its module's ``ucx_api`` becomes a copy whose
    ``UCXContext`` passes them. Idempotent; a context made before this keeps its features
    (:func:`app_features` tells)."""
    from ucxx._lib_async import application_context  # noqa: PLC0415

    api = application_context.ucx_api
    if getattr(api, "kvkern_features", None) is not None:
        return
    lib = _libucxx()
    features = tuple(getattr(lib.Feature, name) for name in APP_FEATURES)

    def context(config_dict: dict | None = None, feature_flags: object = None) -> UCXContext:
        return lib.UCXContext(dict(config_dict or {}), features)

    proxy = ModuleType(lib.__name__)
    proxy.__dict__.update({k: v for k, v in vars(lib).items() if not k.startswith("__")})
    proxy.UCXContext = context
    proxy.kvkern_features = features
    application_context.ucx_api = proxy


def app_features() -> int:
    """The ``ucp_feature`` bits of ucxx's application context."""
    return int(_app_context().context.feature_flags)


def worker_address() -> bytes:
    """This process's ucxx worker address (its UCX address version is every worker's)."""
    return _app_context().worker.address.tobytes()


# ---------------------------------------------------------------- notifier thread

NOTIFIER_POLL_NS = 1_000_000_000  # the notifier's wait between checks for a shutdown


def _notifier(event_loop: asyncio.AbstractEventLoop, worker: Any, queue: Any) -> None:
    """The body of ucxx's notifier thread, leaner: for each batch of completed requests it
    hands ``worker.run_request_notifier`` (which resolves their futures) to the loop as one
    callback, where ucxx's own schedules a coroutine as a task and then waits up to 10 ms for
    it before it waits for the next batch (control round trip 25-65% shorter on loopback,
    docs/performance.md)."""
    from ucxx._lib.libucxx import PythonRequestNotifierWaitState as State  # noqa: PLC0415

    asyncio.set_event_loop(event_loop)  # the pool's futures belong to this loop
    try:
        while True:
            worker.populate_python_futures_pool()
            state = worker.wait_request_notifier(period_ns=NOTIFIER_POLL_NS)
            if state == State.Shutdown or (not queue.empty() and queue.get() == "shutdown"):
                return
            if state == State.Timeout:
                continue
            try:
                event_loop.call_soon_threadsafe(worker.run_request_notifier)
            except RuntimeError:  # the loop is closed: nothing is awaited any more
                return
    finally:
        worker.clear_python_futures_pool()


def install_notifier() -> None:
    """Make ucxx start :func:`_notifier` as its notifier thread (a context made from now on,
    and every restart by :func:`rebind_notifier`). Idempotent."""
    from ucxx._lib_async import application_context  # noqa: PLC0415

    application_context._notifierThread = _notifier


# ---------------------------------------------------------------- progress thread

# The CUDA device this process's pools are on, for ucxx's progress thread (first named kept),
# and what that thread made current when it started (-1: nothing), under one lock.
_progress_device: list[int] = []
_progress_applied: list[int] = []
_progress_lock = threading.Lock()


def note_cuda_device(device: object) -> None:
    """Name a device whose pools this process serves (a ``torch.device`` or its string): the
    first CUDA device named becomes current on ucxx's progress thread when it starts
    (:func:`_progress_thread_started`); host devices, and devices named later, change nothing.
    Name it before the first connection or listener, which start that thread (a warning
    otherwise)."""
    import torch  # noqa: PLC0415

    device = torch.device(device)
    if device.type != "cuda" or (device.index is None and not torch.cuda.is_available()):
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _progress_lock:
        if _progress_device:
            return
        _progress_device.append(index)
        late = bool(_progress_applied) and _progress_applied[0] != index
    if late:
        logging.getLogger("kvkern.xfer").warning(
            "ucxx's progress thread started before CUDA device %d was named (current there: "
            "%s): name the pools' device before the first connection", index,
            _progress_applied[0] if _progress_applied[0] >= 0 else "none")


def _progress_thread_started() -> None:
    """The first thing ucxx's progress thread runs, in place of ucxx's own, which makes GPU 0's
    CUDA context current through cuda-core in every process (a context on GPU 0 for each
    rank of a multi-GPU host, and an error where cuda-core is absent): the context of the
    device named by :func:`note_cuda_device` current, where UCX's CUDA transports then work
    on this process's pools; in a process that uses CUDA but named no device, GPU 0's, as
    ucxx would; in any other process no CUDA call at all. Never raises."""
    with _progress_lock:
        index = _progress_device[0] if _progress_device else None
        torch = sys.modules.get("torch")
        if index is None and torch is not None and torch.cuda.is_initialized():
            index = 0
        _progress_applied[:] = [-1 if index is None else index]
    if index is None:
        return
    try:
        torch.cuda.set_device(index)
        # (set_device alone binds no context when the device is the thread's default, 0:
        # a runtime call that needs one makes the device's primary context current on it)
        torch.cuda.mem_get_info(index)
    except Exception as exc:  # noqa: BLE001 (on UCX's thread: logged, the thread goes on)
        logging.getLogger("kvkern.xfer").warning(
            "ucxx's progress thread could not make CUDA device %d current: %s", index, exc)


def install_progress_start() -> None:
    """Make ucxx's progress thread start with :func:`_progress_thread_started` (each thread
    ucxx starts from now on). Idempotent."""
    from ucxx._lib_async import continuous_ucx_progress  # noqa: PLC0415

    continuous_ucx_progress._create_context = _progress_thread_started


def rebind_notifier(loop: asyncio.AbstractEventLoop) -> bool:
    """Make ucxx's notifier thread resolve request futures on ``loop``: restart it for that
    loop if it serves another, with the Python-future pool refilled from this thread (futures
    pooled for the old loop must not serve the new one's requests). False when ucxx runs
    without the notifier (``UCXPY_ENABLE_PYTHON_FUTURE`` off): nothing to bind."""
    ctx = _app_context()
    if not ctx.enable_python_future or ctx.notifier_thread is None:
        return False
    args = getattr(ctx.notifier_thread, "_args", ())
    if not args or args[0] is not loop:
        ctx.stop_notifier_thread()
        ctx.worker.clear_python_futures_pool()
        ctx.worker.populate_python_futures_pool()
        ctx.start_notifier_thread()
    return True


def stop_notifier() -> bool:
    """Stop ucxx's notifier thread for good, waking it first so that this does not wait out
    its 1 s poll; False when there was none (no context yet, or no notifier)."""
    ctx = import_ucxx().core._ctx
    if ctx is None or not ctx.enable_python_future or ctx.notifier_thread is None:
        return False
    with contextlib.suppress(Exception):
        ctx.worker.stop_request_notifier_thread()
    with contextlib.suppress(Exception):
        ctx.stop_notifier_thread()
    return True


# ---------------------------------------------------------------- lane workers

def _libucxx() -> ModuleType:
    return import_ucxx()._lib.libucxx


def new_rma_context(config: dict[str, str], *, wakeup: bool = False) -> UCXContext:
    """A UCP context of its own with RMA (and ``wakeup``: worker wake-ups) only, on the
    transports :func:`kvkern.xfer.ucx_env.rma_tls` allows, and ``config`` (UCX settings
    without the ``UCX_`` prefix, on top of the environment); raises if this UCX rejects a
    setting, or if no transport is allowed."""
    from kvkern.xfer.ucx_env import rma_tls  # noqa: PLC0415

    tls = rma_tls()
    if tls is None:
        raise RuntimeError(f"UCX_TLS={os.environ.get('UCX_TLS')!r} leaves no transport but "
                           "tcp, which one-sided reads never use")
    lib = _libucxx()
    features = (lib.Feature.RMA, lib.Feature.WAKEUP) if wakeup else (lib.Feature.RMA,)
    return lib.UCXContext({**config, "TLS": tls}, features)


class ReadTarget:
    """What this process's memory is registered in for peers' one-sided reads: a context of
    its own (:func:`new_rma_context`) and its worker, whose address the state document
    publishes for destinations' read lanes. ucxx's progress thread drives the worker,
    blocked on its wake-up descriptor between events: reads from the host or the RDMA
    fabric need no help from it, but it wires up the lanes' endpoints and answers their
    keep-alives."""

    def __init__(self) -> None:
        self.context = new_rma_context({}, wakeup=True)
        self.worker = _libucxx().UCXWorker(self.context)
        self.worker.init_blocking_progress_mode()
        self.worker.start_progress_thread(False)
        self.handle = int(self.context.handle)  # ucp_context_h
        self.address = self.worker.address.tobytes()

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.worker.stop_progress_thread()


_read_target: list[ReadTarget | BaseException] = []
_target_lock = threading.Lock()


def read_target() -> ReadTarget:
    """This process's :class:`ReadTarget`, made on first use (and stopped at exit); raises
    what making it raised, every time."""
    with _target_lock:
        if not _read_target:
            import_ucxx()
            try:
                _read_target.append(ReadTarget())
            except Exception as exc:  # noqa: BLE001 (said again to every caller)
                _read_target.append(exc)
            else:
                _at_exit(_read_target[0].stop)
    made = _read_target[0]
    if isinstance(made, BaseException):
        raise RuntimeError(f"no UCX context for one-sided reads: {made}") from made
    return made


def new_worker(context: UCXContext) -> tuple[UCXWorker, int]:
    """A UCX worker of ``context`` and its ``ucp_worker_h``."""
    worker = _libucxx().UCXWorker(context)
    return worker, int(worker.handle)


def endpoint_to_address(worker: UCXWorker,
                        address: bytes) -> tuple[UCXEndpoint, UCXAddress, int]:
    """An endpoint of ``worker`` to the worker at ``address`` (with error handling): the
    endpoint, the address object it was made from (keep it as long as the endpoint) and its
    ``ucp_ep_h``. The caller checks ``address`` first (a foreign UCX address version makes
    libucp abort). ``ucp_ep_create`` takes no length and parses entries whose lengths and
    ends the address itself gives, so the copy UCX is handed ends in zeros, as a received
    rkey does (:func:`unpack_rkey`): a truncated address from the wire is never parsed past
    memory of its own."""
    ucx_address = _libucxx().UCXAddress.create_from_buffer(
        memoryview(bytearray(bytes(address) + bytes(RKEY_PAD))))
    ep = worker.create_endpoint_from_worker_address(ucx_address, True)
    return ep, ucx_address, int(ep.handle)


# ---------------------------------------------------------------- connection handshake

def tags_checksum(*args: object) -> int:
    """ucxx's 64-bit hash, the checksum of the tags each side sends in its first exchange."""
    from ucxx._lib_async.utils import hash64bits  # noqa: PLC0415

    return hash64bits(*args)


def stream_buffer(buf: bytes | bytearray) -> Any:
    """``buf`` as the buffer object ucxx's stream calls take (it refers to ``buf``)."""
    from ucxx._lib.arr import Array  # noqa: PLC0415

    return Array(buf)


def new_client_endpoint(host: str, port: int) -> tuple[Any, Any]:
    """A ``UCXEndpoint`` to the listener at ``host:port`` (error handling on) and the
    application context it belongs to; its tags are not exchanged yet."""
    ctx = _app_context()
    ctx.continuous_ucx_progress()
    ucx_ep = _libucxx().UCXEndpoint.create(ctx.worker, host, port, True)
    if not ctx.progress_mode.startswith("thread"):
        ctx.worker.progress()
    return ucx_ep, ctx


class CloseWatch:
    """The one close callback of a ``UCXEndpoint``, for the life of the endpoint; what wants
    to hear of the endpoint's end adds a hook here.

    ucxx keeps a close callback in a dict that the endpoint owns and hands UCX a bare pointer
    to it. Setting a second callback frees the first dict before the new one is installed,
    with the GIL released in between, so a close arriving at that moment on UCX's progress
    thread calls through freed memory (seen: a segmentation fault in the process). So an
    endpoint's callback is set once, by :meth:`install`, and never replaced.

    Hooks run on UCX's progress thread (keep them to flags and ``call_soon_threadsafe``); a
    hook added after the close runs at once, in the caller's thread."""

    def __init__(self) -> None:
        self.closed = False
        self._hooks: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    @classmethod
    def install(cls, ucx_ep: Any) -> CloseWatch:
        watch = cls()
        try:
            ucx_ep.set_close_callback(watch)
        except RuntimeError:  # ucxx: "Endpoint is closing or has already closed"
            watch.closed = True
        return watch

    def __call__(self, *_: object) -> None:
        with self._lock:
            self.closed = True
            hooks, self._hooks = self._hooks, []
        for hook in hooks:
            with contextlib.suppress(Exception):  # (one hook's error never skips another)
                hook()

    def add(self, hook: Callable[[], None]) -> None:
        with self._lock:
            if not self.closed:
                self._hooks.append(hook)
                return
        hook()

    def remove(self, hook: Callable[[], None]) -> None:
        with self._lock, contextlib.suppress(ValueError):
            self._hooks.remove(hook)


def endpoint_with_tags(ucx_ep: Any, ctx: Any, *, send_tag: int, recv_tag: int,
                       closing: CloseWatch) -> Any:
    """ucxx's ``Endpoint`` over ``ucx_ep`` with the tags both sides exchanged;
    ``kvkern_closing`` on it is ``closing``, the endpoint's :class:`CloseWatch`."""
    from ucxx._lib_async.endpoint import Endpoint  # noqa: PLC0415

    ep = Endpoint(endpoint=ucx_ep, ctx=ctx, tags={"msg_send": send_tag, "msg_recv": recv_tag})
    ep.kvkern_closing = closing
    return ep


def close_endpoint(ucx_ep: Any, period_ns: int = 1_000_000_000) -> None:
    """Close a ``UCXEndpoint``, waiting at most ``period_ns`` for each of its steps (an
    endpoint in error may refuse to close: nothing is raised)."""
    with contextlib.suppress(Exception):
        ucx_ep.close_blocking(period=period_ns, max_attempts=1)


_kept_listener_callbacks: list[Any] = []  # see ListenerRelay


class ListenerRelay:
    """What a UCX listener calls for each connection request, on UCX's progress thread.

    A request whose client address ``admit(ip)`` turns down (``ip`` None where libucp
    cannot tell) is rejected before any endpoint exists, so nothing its sender writes is ever
    received or queued; ``on_reject(ip)`` then runs on ``loop``. Every other request becomes
    an endpoint handed to ``on_request(ucx_endpoint, *args)``. After :meth:`close`, every
    request is rejected.

    ucxx keeps a listener's callback in a dict that the Python listener owns and hands the
    C++ listener a bare pointer to it. Every endpoint accepted from the listener keeps the
    C++ listener alive, so it goes on accepting, and calling through that pointer, after
    the Python listener and its dict are gone (seen: a connection request after a close
    while an earlier connection was still in its handshake called into freed memory).
    :func:`new_listener` therefore keeps the dict for the life of the process, holding only
    this relay, which :meth:`close` empties; the C++ listener's ``ucp_listener_h`` stays
    valid while it calls, so a late request is still rejected through it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, on_request: Callable[..., None],
                 args: tuple, *, admit: Callable[[str | None], bool] | None = None,
                 on_reject: Callable[[str | None], None] | None = None) -> None:
        import weakref  # noqa: PLC0415

        self._loop = weakref.ref(loop)
        self._target: tuple[Callable[..., None], tuple] | None = (on_request, args)
        self._admit = admit
        self._on_reject = on_reject
        self._listener: Any = None  # the UCXListener, until close
        self._handle: int | None = None  # its ucp_listener_h
        self._bound = threading.Event()

    def bind(self, ucx_listener: Any) -> None:
        """Start serving the requests of ``ucx_listener`` (a ``UCXListener``)."""
        self._handle = listener_handle(ucx_listener)
        self._listener = ucx_listener
        self._bound.set()

    def __call__(self, conn_request: int) -> None:
        self._bound.wait(10.0)  # (a request may come before new_listener has bound it)
        target, listener = self._target, self._listener
        if target is None or listener is None:
            self._reject(conn_request)
            return
        ip = None
        try:
            ip = conn_request_ip(conn_request)
            admitted = self._admit is None or self._admit(ip)
        except Exception:  # (never leave a request unanswered: its client would wait)
            log.exception("a connection request from %s could not be checked", ip)
            admitted = False
        if not admitted:
            self._reject(conn_request, ip, tell=True)
            return
        try:  # (UCX answers, and frees, the request whether or not this succeeds)
            ucx_ep = listener.create_endpoint_from_conn_request(conn_request, True)
        except Exception as exc:
            log.warning("a connection from %s could not be accepted: %s", ip, exc)
            return
        target[0](ucx_ep, *target[1])

    def _reject(self, conn_request: int, ip: str | None = None, *, tell: bool = False) -> None:
        if self._handle is not None:
            libucp().ucp_listener_reject(self._handle, conn_request)
        if tell and self._on_reject is not None:
            loop = self._loop()
            with contextlib.suppress(AttributeError, RuntimeError):  # the loop is gone
                loop.call_soon_threadsafe(self._on_reject, ip)

    def close(self) -> None:
        self._target = None
        self._listener = None


def new_listener(port: int, on_request: Callable[..., None], args: tuple, *,
                 admit: Callable[[str | None], bool] | None = None,
                 on_reject: Callable[[str | None], None] | None = None) -> Any:
    """ucxx's ``Listener`` on ``port``: a connection request from an address ``admit``
    turns down is rejected (see :class:`ListenerRelay`), every other one calls
    ``on_request(ucx_endpoint, loop, ctx_ref, tracker, *args)`` on UCX's progress thread,
    where ``tracker.submit(coroutine, loop)`` runs a handler on the loop (tracked, as ucxx
    tracks its own), until :func:`close_listener` or the listener's collection."""
    import gc  # noqa: PLC0415
    import weakref  # noqa: PLC0415

    from ucxx._lib_async.listener import Listener, _ListenerHandlerTracker  # noqa: PLC0415

    ctx = _app_context()
    ctx.continuous_ucx_progress()
    tracker = _ListenerHandlerTracker()
    loop = asyncio.get_event_loop()
    relay = ListenerRelay(loop, on_request, (loop, weakref.ref(ctx), tracker, *args),
                          admit=admit, on_reject=on_reject)
    ucx_listener = _libucxx().UCXListener.create(
        worker=ctx.worker, port=port, cb_func=relay, cb_args=(), deliver_endpoint=False)
    relay.bind(ucx_listener)
    # the dict ucxx handed the C++ listener a pointer to (its only dict), kept for good
    kept = [r for r in gc.get_referents(ucx_listener)
            if isinstance(r, dict) and r.get("cb_func") is relay]
    _kept_listener_callbacks.extend(kept or [ucx_listener])  # (else the listener itself)
    listener = Listener(ucx_listener, tracker, ctx)
    listener.kvkern_relay, listener.kvkern_tracker = relay, tracker
    weakref.finalize(listener, relay.close)  # (the relay holds the UCXListener until then)
    return listener


def close_listener(listener: Any) -> None:
    """Stop a listener of :func:`new_listener`: requests arriving from now on are closed,
    the handlers of connections not handed over yet (their handshakes) are cancelled, and
    ucxx's listener is closed."""
    listener.kvkern_relay.close()
    tracker = listener.kvkern_tracker
    with tracker._lock:
        pending = list(tracker._futures)
    for future in pending:
        future.cancel()
    listener.close()


# ---------------------------------------------------------------- libucp (ctypes)

class MemMapParams(ctypes.Structure):  # ucp_mem_map_params_t (ucp/api/ucp.h)
    _fields_ = [("field_mask", ctypes.c_uint64), ("address", ctypes.c_void_p),
                ("length", ctypes.c_size_t), ("flags", ctypes.c_uint),
                ("prot", ctypes.c_uint), ("memory_type", ctypes.c_int),
                ("exported_memh_buffer", ctypes.c_void_p)]


class RequestParam(ctypes.Structure):  # ucp_request_param_t (ucp/api/ucp.h)
    _fields_ = [("op_attr_mask", ctypes.c_uint32), ("flags", ctypes.c_uint32),
                ("request", ctypes.c_void_p), ("cb", ctypes.c_void_p),
                ("datatype", ctypes.c_uint64), ("user_data", ctypes.c_void_p),
                ("reply_buffer", ctypes.c_void_p), ("memory_type", ctypes.c_int),
                ("recv_info", ctypes.c_void_p), ("memh", ctypes.c_void_p)]


_lib: ctypes.CDLL | None = None
class TransportEntry(ctypes.Structure):  # ucp_transport_entry_t (ucp/api/ucp_def.h)
    _fields_ = [("transport_name", ctypes.c_char_p), ("device_name", ctypes.c_char_p)]


class Transports(ctypes.Structure):  # ucp_transports_t (ucp/api/ucp_def.h)
    _fields_ = [("entries", ctypes.POINTER(TransportEntry)), ("num_entries", ctypes.c_uint),
                ("entry_size", ctypes.c_size_t)]


class EpAttr(ctypes.Structure):  # ucp_ep_attr_t (ucp/api/ucp.h)
    _fields_ = [("field_mask", ctypes.c_uint64), ("name", ctypes.c_char * 32),
                ("local_sockaddr", ctypes.c_byte * 128), ("remote_sockaddr", ctypes.c_byte * 128),
                ("transports", Transports), ("user_data", ctypes.c_void_p)]
    # (the sockaddr_storage fields are 8-byte aligned in C; both start at multiples of 8)


class ConnRequestAttr(ctypes.Structure):  # ucp_conn_request_attr_t (ucp/api/ucp.h)
    _fields_ = [("field_mask", ctypes.c_uint64), ("client_address", ctypes.c_byte * 128),
                ("client_id", ctypes.c_uint64)]


CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR = 1 << 0
EP_ATTR_FIELD_REMOTE_SOCKADDR = 1 << 2
EP_ATTR_FIELD_TRANSPORTS = 1 << 3
MAX_EP_TRANSPORTS = 32

_lib_lock = threading.Lock()
_V = ctypes.c_void_p
_STATUS = ctypes.c_int8  # ucs_status_t is a packed (1-byte) signed enum in ucs/type/status.h


def _loaded(name: str) -> str | None:
    """Path of the library ``name`` (``libucp.so``) this process already mapped (the copy
    ucxx uses), if any."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1]
                if f"/{name}" in path and os.path.exists(path):
                    return path
    except OSError:
        return None
    return None


def libucp() -> ctypes.CDLL:
    """libucp with the signatures used here, bound to the copy ucxx loaded."""
    global _lib
    if _lib is not None:
        return _lib
    with _lib_lock:
        if _lib is not None:
            return _lib
        import_ucxx()
        lib = ctypes.CDLL(_loaded("libucp.so") or "libucp.so.0")
        sig = {
            "ucp_mem_map": (_STATUS, [_V, ctypes.POINTER(MemMapParams), ctypes.POINTER(_V)]),
            "ucp_mem_unmap": (_STATUS, [_V, _V]),
            "ucp_rkey_pack": (_STATUS, [_V, _V, ctypes.POINTER(_V),
                                        ctypes.POINTER(ctypes.c_size_t)]),
            "ucp_rkey_buffer_release": (None, [_V]),
            "ucp_ep_rkey_unpack": (_STATUS, [_V, ctypes.c_char_p, ctypes.POINTER(_V)]),
            "ucp_rkey_destroy": (None, [_V]),
            "ucp_get_nbx": (_V, [_V, _V, ctypes.c_size_t, ctypes.c_uint64, _V,
                                 ctypes.POINTER(RequestParam)]),
            "ucp_request_check_status": (_STATUS, [_V]),
            "ucp_request_free": (None, [_V]),
            "ucp_worker_progress": (ctypes.c_uint, [_V]),
            "ucp_ep_query": (_STATUS, [_V, ctypes.POINTER(EpAttr)]),
            "ucp_conn_request_query": (_STATUS, [_V, ctypes.POINTER(ConnRequestAttr)]),
            "ucp_listener_reject": (_STATUS, [_V, _V]),
        }
        for name, (res, args) in sig.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
        _lib = lib
        return lib


def ptr_status(ptr: int | None) -> int | None:
    """``ucs_status_ptr_t`` -> status when it is one (NULL = UCS_OK), None for a request."""
    if not ptr:
        return UCS_OK
    signed = ptr - (1 << 64) if ptr >= 1 << 63 else ptr
    if UCS_ERR_LAST <= signed < 0:
        return signed
    return None


def map_for_remote_read(context: int, address: int, length: int,
                        memory_type: int) -> tuple[int, int | None]:
    """``ucp_mem_map`` of ``length`` bytes at ``address`` for local read/write and **remote
    read** only: ``(status, memh)``, memh None on failure."""
    params = MemMapParams(
        field_mask=MAP_FIELD_ADDRESS | MAP_FIELD_LENGTH | MAP_FIELD_PROT | MAP_FIELD_MEMORY_TYPE,
        address=address, length=length,
        prot=PROT_LOCAL_READ | PROT_LOCAL_WRITE | PROT_REMOTE_READ, memory_type=memory_type)
    memh = _V()
    status = libucp().ucp_mem_map(context, ctypes.byref(params), ctypes.byref(memh))
    return status, (memh.value if status == UCS_OK else None)


def pack_rkey(context: int, memh: int) -> tuple[int, bytes]:
    """``ucp_rkey_pack`` of a mapped ``memh``: ``(status, packed remote key)``."""
    lib = libucp()
    buf, size = _V(), ctypes.c_size_t()
    status = lib.ucp_rkey_pack(context, memh, ctypes.byref(buf), ctypes.byref(size))
    if status != UCS_OK:
        return status, b""
    rkey = ctypes.string_at(buf, size.value)
    lib.ucp_rkey_buffer_release(buf)
    return UCS_OK, rkey


def unmap(context: int, memh: int) -> None:
    libucp().ucp_mem_unmap(context, memh)


def unpack_rkey(ep_handle: int, packed: bytes) -> tuple[int, int | None]:
    """``ucp_ep_rkey_unpack``: ``(status, rkey handle)``. The function takes no length, so a
    truncated key from the wire would make UCX parse past its end: zero padding keeps any
    over-read inside the buffer."""
    buf = ctypes.create_string_buffer(bytes(packed), len(packed) + RKEY_PAD)
    rkey = _V()
    status = libucp().ucp_ep_rkey_unpack(ep_handle, buf, ctypes.byref(rkey))
    return status, (rkey.value if status == UCS_OK else None)


def endpoint_transports(ep_handle: int) -> tuple[str, ...] | None:
    """The names of the transports an endpoint's lanes use (``ucp_ep_query``), e.g.
    ``("cma", "posix")`` to a process on this host; None where libucp cannot tell."""
    entries = (TransportEntry * MAX_EP_TRANSPORTS)()
    attr = EpAttr(field_mask=EP_ATTR_FIELD_TRANSPORTS)
    attr.transports.entries = entries
    attr.transports.num_entries = MAX_EP_TRANSPORTS
    attr.transports.entry_size = ctypes.sizeof(TransportEntry)
    try:
        status = libucp().ucp_ep_query(ep_handle, ctypes.byref(attr))
    except AttributeError:  # a libucp without the call
        return None
    if status != UCS_OK:
        return None
    n = min(attr.transports.num_entries, MAX_EP_TRANSPORTS)
    return tuple((entries[i].transport_name or b"").decode("ascii", "replace")
                 for i in range(n))


def endpoint_remote_ip(ep_handle: int) -> str | None:
    """The remote IP address of an endpoint made from a listener's connection request
    (``ucp_ep_query``'s remote sockaddr); None where libucp has none to give."""
    attr = EpAttr(field_mask=EP_ATTR_FIELD_REMOTE_SOCKADDR)
    try:
        if libucp().ucp_ep_query(ep_handle, ctypes.byref(attr)) != UCS_OK:
            return None
    except (AttributeError, OSError):
        return None
    return _sockaddr_ip(bytes(attr.remote_sockaddr))


def conn_request_ip(conn_request: int) -> str | None:
    """The client IP address of a listener's connection request
    (``ucp_conn_request_query``); None where libucp has none to give."""
    attr = ConnRequestAttr(field_mask=CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR)
    if libucp().ucp_conn_request_query(conn_request, ctypes.byref(attr)) != UCS_OK:
        return None
    return _sockaddr_ip(bytes(attr.client_address))


def _sockaddr_ip(raw: bytes) -> str | None:
    """The address of a ``struct sockaddr_storage`` holding IPv4 or IPv6, else None."""
    family = int.from_bytes(raw[:2], sys.byteorder)
    try:
        if family == socket.AF_INET:
            return socket.inet_ntop(socket.AF_INET, raw[4:8])
        if family == socket.AF_INET6:
            return socket.inet_ntop(socket.AF_INET6, raw[8:24])
    except (OSError, ValueError):
        return None
    return None


def listener_handle(ucx_listener: Any) -> int:
    """The ``ucp_listener_h`` of a ``UCXListener`` (``ucxx::Listener::getHandle()`` of the
    C++ listener it points to; ucxx's Python API has no getter)."""
    handle = _listener_get_handle()(ucx_listener.ucxx_ptr)
    if not handle:
        raise RuntimeError("ucxx listener has no UCP handle")
    return int(handle)


@functools.cache
def _listener_get_handle() -> Any:
    import_ucxx()
    lib = ctypes.CDLL(_loaded("libucxx.so") or "libucxx.so")
    fn = lib._ZN4ucxx8Listener9getHandleEv  # ucxx::Listener::getHandle() (Itanium ABI)
    fn.restype, fn.argtypes = _V, [_V]
    return fn


def destroy_rkey(handle: int) -> None:
    libucp().ucp_rkey_destroy(handle)


def read_poster(memory_type: int, *, iov: bool = False,
                ) -> Callable[[int, int, int, int, int], int | None]:
    """``post(ep_handle, local, count, remote, rkey)``: one ``ucp_get_nbx`` into local
    memory of ``memory_type``; returns its ``ucs_status_ptr_t`` (see :func:`ptr_status`).
    ``local`` is ``count`` bytes, or with ``iov`` an array of ``count`` ``ucp_dt_iov_t``
    (address, length) the contiguous remote bytes are scattered over, in order. Made once
    per kind (its parameters are only read, by any thread)."""
    return _read_poster(memory_type, iov)


@functools.cache
def _read_poster(memory_type: int, iov: bool) -> Callable[[int, int, int, int, int], int | None]:
    get = libucp().ucp_get_nbx
    param = RequestParam(op_attr_mask=OP_ATTR_FIELD_MEMORY_TYPE, memory_type=memory_type)
    if iov:
        param.op_attr_mask |= OP_ATTR_FIELD_DATATYPE
        param.datatype = DATATYPE_IOV
    pref = ctypes.byref(param)

    def post(ep_handle: int, local: int, count: int, remote: int, rkey: int) -> int | None:
        return get(ep_handle, local, count, remote, rkey, pref)  # pref keeps param alive

    return post


def request_calls() -> tuple[Callable[[int], int], Callable[[int], None],
                             Callable[[int], int]]:
    """The bound ``ucp_request_check_status(request)``, ``ucp_request_free(request)`` and
    ``ucp_worker_progress(worker)`` (nonzero when it did something), for polling loops that
    call them per request."""
    lib = libucp()
    return lib.ucp_request_check_status, lib.ucp_request_free, lib.ucp_worker_progress
