"""Waits written once, run on a thread or on an event loop.

A one-sided read is posted and then polled until UCX reports it done; what differs between a
read lane's thread and kvkern's event loop is only how to pass the time between two polls
(sleep the thread, or let the loop run other work). So the waiting code is a generator that
polls, and **yields the pause** it wants before its next poll; a driver runs it::

    def waiting(...) -> Steps[float | None]:   run_blocking(steps): time.sleep(pause)
        while not done():                     the loop lane's driver (kvkern.xfer.read_lanes):
            yield pause                           await asyncio.sleep(0), or the pause
        return first_byte_time

Steps compose with ``yield from`` (a script of dependent reads yields its reads' pauses), and
a step's return value travels back as the generator's. A driver that stops early (a closed
or collected generator) raises ``GeneratorExit`` at the pause; code that must clean up after
a failed read checks for it and cleans up without pausing again.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from typing import TypeVar

__all__ = ["Steps", "run_blocking"]

T = TypeVar("T")
Steps = Generator[float, None, T]  # yields pauses in seconds, returns the result


def run_blocking(steps: Steps[T]) -> T:
    """Run ``steps`` on this thread, sleeping each pause."""
    while True:
        try:
            pause = next(steps)
        except StopIteration as done:
            return done.value
        time.sleep(pause)
