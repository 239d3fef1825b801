"""Where a pull's kernels run on a GPU, and how everything else waits for exactly them.

A pull's pack (source) and unpack (destination) must neither stall the engine's forward pass
nor be read, overwritten or used too early. On a CUDA pool (:class:`CudaStream`):

* they run on a side stream of the pool's device, created at CUDA's lowest priority, with at
  most ``max_programs`` Triton programs per launch (:class:`StreamConfig`), so the SMs they
  do not take stay with the forward pass;
* every ordering is an event, never a whole-stream or device synchronisation::

    compute stream  ..kernels that wrote / still read the blocks..[fence]....[wait ready]..prefill
                                                                   |               ^
    side stream                      [wait fence]..pack/unpack chunk i..[ready i]--+ (destination:
                                                                            |        publish)
    host (source)            ready i .synchronize() on a packing thread, then UCX sends chunk i

  - :meth:`fence` records an event on the compute stream; a launch ``after`` it starts only
    once the engine's work enqueued before it is done: at the source the kernels that wrote
    the pinned blocks, at the destination those still reading the freshly allocated blocks'
    previous contents.
  - :meth:`run` launches on the side stream and records ``ready``, an event that fires when
    exactly that launch (and what the side stream held before it) is done.
  - :meth:`synchronize` blocks the calling thread on one event (a packing thread, never the
    event loop's); :meth:`wait` awaits one without blocking the loop (``query()``, else the
    blocking wait on a helper thread), bounded by a timeout.
  - :meth:`publish` makes the compute stream wait for an event (enqueued; the host does not
    wait): the destination's pull completion, before the engine may schedule the prefill.

CPU pools use :data:`HOST`: launches run at once in the calling thread and every event has
already fired, so the same code path runs, unchanged in behaviour, in the CPU tests.

:func:`for_device` gives the stream of a device (made on first use); :func:`install` replaces
it: an engine whose forward pass runs on its own stream installs
``CudaStream.create(device, compute=that_stream)``, and tests install recording fakes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

from kvkern.xfer.tuning import DEFAULT_PROGRAM_FRACTION

__all__ = ["DONE", "HOST", "CudaStream", "DeviceStream", "HostStream", "Ready", "StreamConfig",
           "for_device", "install", "launched", "serve_devices", "warm_kernels"]

T = TypeVar("T")

log = logging.getLogger("kvkern.xfer")



@dataclass(frozen=True, kw_only=True)
class StreamConfig:
    """How a device's pull kernels share the GPU with the engine.

    ``program_fraction``: the Triton programs one pack or unpack launch may use, as a
    fraction of the device's SMs (at least one program); the kernel's grid-stride loop still
    covers every row. ``1.0`` leaves the grid uncapped.
    """

    program_fraction: float = DEFAULT_PROGRAM_FRACTION

    def __post_init__(self) -> None:
        f = self.program_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
            raise ValueError(f"program_fraction {f!r} must be a number in (0, 1]")

    def max_programs(self, sm_count: int) -> int | None:
        """The grid cap for a device with ``sm_count`` SMs (None: uncapped)."""
        if sm_count < 1:
            raise ValueError(f"sm_count {sm_count} must be >= 1")
        if self.program_fraction >= 1:
            return None
        return max(1, int(sm_count * self.program_fraction))


class Ready(Protocol):
    """An event: ``torch.cuda.Event``'s ``query`` and ``synchronize``."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class DeviceStream(Protocol):
    """What the source and the puller need of a device (see the module docstring)."""

    max_programs: int | None

    def fence(self) -> Ready: ...

    def run(self, fn: Callable[[], T], *, after: Ready | None = None) -> tuple[T, Ready]: ...

    def synchronize(self, ready: Ready) -> None: ...

    async def wait(self, ready: Ready, timeout: float) -> None: ...

    def publish(self, ready: Ready) -> None: ...


class _Done:
    """An event that has already fired."""

    __slots__ = ()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def __repr__(self) -> str:
        return "DONE"


DONE: Ready = _Done()


class HostStream:
    """CPU pools: the copy runs in the calling thread, so it is done when :meth:`run`
    returns; there is no grid to cap and nothing to wait for."""

    max_programs: int | None = None

    def fence(self) -> Ready:
        return DONE

    def run(self, fn: Callable[[], T], *, after: Ready | None = None) -> tuple[T, Ready]:
        return fn(), DONE

    def synchronize(self, ready: Ready) -> None:
        ready.synchronize()

    async def wait(self, ready: Ready, timeout: float) -> None:
        await wait_ready(ready, timeout)

    def publish(self, ready: Ready) -> None:
        return None


HOST = HostStream()

_WAITERS: concurrent.futures.ThreadPoolExecutor | None = None
_WAITERS_LOCK = threading.Lock()


def _waiters() -> concurrent.futures.ThreadPoolExecutor:
    global _WAITERS
    with _WAITERS_LOCK:
        if _WAITERS is None:
            _WAITERS = concurrent.futures.ThreadPoolExecutor(
                max_workers=4, thread_name_prefix="kvkern-event")
        return _WAITERS


async def wait_ready(ready: Ready, timeout: float) -> None:
    """Wait until ``ready`` fired without blocking the event loop: an event already done
    costs one ``query()``; else its ``synchronize()`` runs on a helper thread, awaited for at
    most ``timeout`` seconds (``asyncio.TimeoutError``; the helper thread returns when the
    device finishes)."""
    if ready.query():
        return
    fut = asyncio.wrap_future(_waiters().submit(_synchronize_on_its_device, ready))
    await asyncio.wait_for(fut, timeout)


def _synchronize_on_its_device(ready: Ready) -> None:
    """``ready.synchronize()`` with the event's device current on this helper thread: a CUDA
    call on a thread with no device set makes device 0's context there, which a rank serving
    another GPU would otherwise create (and hold memory on) on GPU 0."""
    device = getattr(ready, "device", None)
    if getattr(device, "type", None) == "cuda":
        with torch.cuda.device(device):
            ready.synchronize()
    else:
        ready.synchronize()


def launched(exc: BaseException) -> Ready | None:
    """The event after the kernels a failed :meth:`DeviceStream.run` launched (None for a
    host stream, whose work was done when it raised)."""
    return getattr(exc, "ready", None)


class CudaStream:
    """A CUDA device's side stream for pull kernels, and the engine's compute stream it
    orders against (see the module docstring). Build it with :meth:`create`; the
    constructor takes the stream objects themselves so the ordering logic can be driven by
    recording fakes off-GPU."""

    def __init__(self, *, side: torch.cuda.Stream, compute: torch.cuda.Stream,
                 max_programs: int | None, new_event: Callable[[], torch.cuda.Event],
                 use: Callable[[torch.cuda.Stream], AbstractContextManager[object]],
                 on_device: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext,
                 ) -> None:
        self.side = side
        self.compute = compute
        self.max_programs = max_programs
        self._new_event = new_event
        self._use = use  # context manager making a stream current (torch.cuda.stream)
        # ... and one making the side stream's device current (torch.cuda.device): leaving a
        # stream restores the previous stream of the current device, which on a thread whose
        # device is another GPU's makes that GPU's context
        self._on_device = on_device

    @classmethod
    def create(cls, device: torch.device | str, *, compute: torch.cuda.Stream | None = None,
               config: StreamConfig | None = None) -> CudaStream:
        """The side stream of ``device``: priority 0, the lowest CUDA has (PyTorch's default
        stream has it too; an engine whose forward runs on a higher-priority stream has the
        scheduler's preference over pulls). ``compute``: the stream the engine's forward
        pass runs on, its device's default stream unless given."""
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"CudaStream needs a CUDA device, got {device}")
        config = config or StreamConfig()
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        side = torch.cuda.Stream(device=device, priority=0)
        if compute is None:
            compute = torch.cuda.default_stream(device)
        elif compute.device != device:
            raise ValueError(f"compute stream is on {compute.device}, the pool on {device}")

        def new_event() -> torch.cuda.Event:
            # blocking: a thread waiting on it sleeps instead of spinning a CPU core that the
            # engine's host thread may need
            return torch.cuda.Event(blocking=True)

        return cls(side=side, compute=compute, max_programs=config.max_programs(sms),
                   new_event=new_event, use=torch.cuda.stream,
                   on_device=lambda: torch.cuda.device(device))

    def fence(self) -> Ready:
        ev = self._new_event()
        ev.record(self.compute)
        return ev

    def run(self, fn: Callable[[], T], *, after: Ready | None = None) -> tuple[T, Ready]:
        """``fn()`` on the side stream, after ``after``; its result and the event after it.
        When ``fn`` raises, kernels it launched before may still run: the event after them
        rides on the exception as ``ready`` (:func:`launched`), for the caller to wait on
        before it reuses what they touch."""
        with self._on_device():
            if after is not None:
                self.side.wait_event(after)
            with self._use(self.side):
                try:
                    out = fn()
                except BaseException as exc:
                    ready = self._new_event()
                    ready.record(self.side)
                    exc.ready = ready  # type: ignore[attr-defined]
                    raise
                ready = self._new_event()
                ready.record(self.side)
        return out, ready

    def synchronize(self, ready: Ready) -> None:
        with self._on_device():
            ready.synchronize()

    async def wait(self, ready: Ready, timeout: float) -> None:
        await wait_ready(ready, timeout)

    def publish(self, ready: Ready) -> None:
        self.compute.wait_event(ready)


_STREAMS: dict[str, DeviceStream] = {}
_STREAMS_LOCK = threading.Lock()


def _key(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return str(device)


def for_device(device: torch.device | str) -> DeviceStream:
    """The stream pull kernels on ``device`` use: the installed one, else a
    :class:`CudaStream` made on first use for a CUDA device, :data:`HOST` for the CPU."""
    key = _key(device)
    with _STREAMS_LOCK:
        ds = _STREAMS.get(key)
        if ds is None and key.startswith("cuda"):
            ds = _STREAMS[key] = CudaStream.create(key)
            _check_ucx_tls()
    return HOST if ds is None else ds


def _check_ucx_tls() -> None:
    """Log, once per device, what the user's ``UCX_TLS`` takes from pulls of device memory
    (:mod:`kvkern.xfer.ucx_env`)."""
    from kvkern.xfer.ucx_env import CUDA_TRANSPORTS, cuda_tls_gaps, ucx_tls_problem  # noqa: PLC0415

    problem = ucx_tls_problem(device_memory=True)
    if problem is not None:
        log.error("%s", problem)
    for t in cuda_tls_gaps():
        if t != "cuda_copy":
            log.warning("UCX_TLS rules out %s: %s", t, CUDA_TRANSPORTS[t])


def install(device: torch.device | str, stream: DeviceStream | None) -> DeviceStream | None:
    """Make ``stream`` the one :func:`for_device` gives for ``device`` (None: the default
    again); returns the one installed before, if any."""
    key = _key(device)
    with _STREAMS_LOCK:
        prev = _STREAMS.pop(key, None)
        if stream is not None:
            _STREAMS[key] = stream
    return prev


@contextlib.contextmanager
def installed(device: torch.device | str, stream: DeviceStream):
    """:func:`install` for the duration of a ``with`` block."""
    prev = install(device, stream)
    try:
        yield stream
    finally:
        install(device, prev)


def serve_devices(ranks: Iterable[Any], name: str = "kvkern-warm-up") -> threading.Thread | None:
    """Ready this process for the device pools among ``ranks`` (as :func:`warm_kernels`
    takes them), before its first connection: the first pool's device is the one ucxx's
    progress thread makes current (:func:`kvkern.xfer.ucxcompat.note_cuda_device`), and every
    pool's kernels compile now (:func:`warm_kernels`, whose thread is returned)."""
    from kvkern.xfer import ucxcompat  # noqa: PLC0415

    ranks = list(ranks)
    for r in ranks:
        ucxcompat.note_cuda_device(r.device)
    return warm_kernels(ranks, name)


def warm_kernels(ranks: Iterable[Any], name: str = "kvkern-warm-up") -> threading.Thread | None:
    """Compile the pack and unpack kernels of every device pool among ``ranks`` (objects with
    ``pool``, ``layout`` and ``device``, as :class:`~kvkern.xfer.kvgroup.RankKV`) on a thread
    of their own, started now: a first launch compiles on the host for about a second, on the
    thread that launches it, which is otherwise a first pull's or send's. The thread (None
    where no pool is on a device); a failure is logged, never raised."""
    from kvkern.kernels.pack import warm_up  # noqa: PLC0415

    todo = [r for r in ranks if r.device.type == "cuda"]
    if not todo:
        return None

    def run() -> None:
        for r in todo:
            try:
                with torch.cuda.device(r.device):
                    warm_up(r.pool, r.layout)
            except Exception as exc:  # noqa: BLE001 (the first pull compiles instead)
                log.warning("kvkern: compiling the kernels of %s ahead failed: %s: %s",
                            r.device, type(exc).__name__, exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread
