"""The asyncio thread the transfer path runs on.

ucxx ties its progress to one event loop, and an engine's scheduler is synchronous, so the
source service and the puller share one :class:`EventLoopThread`: a daemon thread running an
asyncio loop. Engine threads hand it work with :meth:`EventLoopThread.run` (blocking, bounded)
or :meth:`EventLoopThread.submit` (a ``concurrent.futures.Future``)::

    engine thread                      kvkern-xfer thread (asyncio loop)
    ----------------------------       -----------------------------------
    rt.run(source.start(), 10)  ---->  await source.start()
          <- result / exception  <---
    rt.submit(puller.pull(...))  --->  task; the engine polls future.done()
    rt.close()                   --->  cancel every task, stop, join

``close()`` is idempotent and bounded; a coroutine handed to a closed runtime is closed
without running (no "never awaited" warning) and raises ``RuntimeError``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["EventLoopThread", "spawn", "through_cancels"]

log = logging.getLogger(__name__)
T = TypeVar("T")


class EventLoopThread:
    """A daemon thread running one asyncio event loop until :meth:`close`."""

    def __init__(self, name: str = "kvkern-xfer", *, start_timeout: float = 10.0) -> None:
        self.name = name
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._closed = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        if not self._ready.wait(start_timeout):
            raise RuntimeError(f"event loop thread {name!r} did not start in {start_timeout} s")

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.call_soon(self._ready.set)
        try:
            self._loop.run_forever()
        finally:
            with contextlib.suppress(Exception):
                self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    @property
    def closed(self) -> bool:
        return self._closed

    def in_loop(self) -> bool:
        """Whether the caller runs on this runtime's thread."""
        return threading.current_thread() is self._thread

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; returns a thread-safe future (cancel it to cancel
        the task)."""
        with self._lock:
            if self._closed:
                coro.close()
                raise RuntimeError(f"event loop thread {self.name!r} is closed")
            return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run ``coro`` on the loop and wait for its result, at most ``timeout`` seconds
        (then the task is cancelled and ``TimeoutError`` raised). Call from any thread but
        the loop's own (that would deadlock: ``RuntimeError``)."""
        if self.in_loop():
            coro.close()
            raise RuntimeError("EventLoopThread.run called from its own loop; await instead")
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"coroutine on {self.name!r} did not finish in {timeout} s") \
                from None

    def call_soon(self, fn: Callable[..., object], *args: object) -> None:
        """Run the plain callable ``fn(*args)`` on the loop soon (thread-safe)."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"event loop thread {self.name!r} is closed")
            self._loop.call_soon_threadsafe(fn, *args)

    def close(self, timeout: float = 10.0) -> None:
        """Cancel every pending task, wait for them (bounded), stop the loop and join the
        thread. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if not self._thread.is_alive():
            return
        if self.in_loop():
            raise RuntimeError("EventLoopThread.close called from its own loop")
        fut = asyncio.run_coroutine_threadsafe(self._cancel_all(timeout), self._loop)
        try:
            fut.result(timeout + 1.0)
        except Exception as exc:  # noqa: BLE001 (closing is best effort past this point)
            log.warning("cancelling tasks on %r: %r", self.name, exc)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("event loop thread %r did not stop within %s s", self.name, timeout)

    async def _cancel_all(self, timeout: float) -> None:
        """Cancel every task, and those the cancelled ones start as they end (a pull's
        cancel message to its source), until none is left or ``timeout`` has passed."""
        me = asyncio.current_task()
        deadline = self._loop.time() + timeout
        while tasks := [t for t in asyncio.all_tasks() if t is not me and not t.done()]:
            left = deadline - self._loop.time()
            if left <= 0:
                break
            for t in tasks:
                t.cancel()
            await asyncio.wait(tasks, timeout=left)

    def __enter__(self) -> EventLoopThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def through_cancels(fut: asyncio.Future) -> bool:
    """Wait until ``fut`` is done, however often the waiting task is cancelled meanwhile
    (``fut`` itself is never cancelled from here); whether it was."""
    cancelled = False
    while not fut.done():
        try:
            await asyncio.wait([fut])
        except asyncio.CancelledError:
            cancelled = True
    return cancelled


def spawn(tasks: set[asyncio.Task], coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
    """Run ``coro`` as a fire-and-forget task on the running loop, kept in ``tasks`` until it
    ends (the loop holds tasks only weakly; the owner awaits or cancels ``tasks`` on close)."""
    task = asyncio.ensure_future(coro)
    tasks.add(task)
    task.add_done_callback(tasks.discard)
    return task
