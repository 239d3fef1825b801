"""A UCX listener under a flood of tagged messages that nothing will ever receive.

Run as ``python tests/peers/flood_peer.py ACCEPT_FROM SECONDS SIZE [unproven]``. The process
starts a kvkern :class:`~kvkern.xfer.transport.Listener` on 127.0.0.1 whose ``accept_from`` is
``ACCEPT_FROM`` ("any" for none) and, with ``unproven``, whose
:class:`~kvkern.xfer.networks.ProvenHosts` names no host yet (as a source's before any
destination fetched its state), then a second process (``--attack HOST PORT SECONDS
SIZE``) that connects with a UCX context of its own and, without any exchange of kvkern's,
sends ``SIZE``-byte messages with random tags for ``SECONDS``. UCX keeps each such message in
the listening worker's queue of unexpected messages. One JSON line is printed when the
attacker is done::

    FLOOD {"rss_growth_mib": 812, "rejected": 0, "accepted": 1, "sent": 200000}
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import time


def attack(host: str, port: int, seconds: float, size: int) -> None:
    from ucxx._lib import libucxx as lib
    from ucxx._lib.arr import Array
    from ucxx.types import Tag

    ctx = lib.UCXContext({}, (lib.Feature.TAG, lib.Feature.WAKEUP, lib.Feature.STREAM))
    worker = lib.UCXWorker(ctx)
    ep = lib.UCXEndpoint.create(worker, host, port, True)
    buf = Array(bytearray(size))
    sent, reqs = 0, []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            reqs.append(ep.tag_send(buf, Tag(random.getrandbits(63))))
        except Exception:  # (the endpoint was rejected or closed: nothing more goes out)
            break
        worker.progress()
        if len(reqs) >= 256:
            while not all(r.completed for r in reqs) and time.monotonic() < end:
                worker.progress()
            sent += sum(1 for r in reqs if r.completed)
            reqs = []
    print(json.dumps({"sent": sent}), flush=True)
    os._exit(0)


def _rss_mib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) // 1024
    return 0


async def listen(accept_from: str, seconds: float, size: int, unproven: bool) -> None:
    from kvkern.xfer.networks import Networks, ProvenHosts
    from kvkern.xfer.transport import Listener

    async def hold(conn) -> None:
        await asyncio.sleep(60)

    networks = None if accept_from == "any" else Networks.parse(accept_from)
    proven = ProvenHosts() if unproven else None
    async with Listener(hold, accept_from=networks, connect_timeout=30.0,
                        proven=proven) as lst:
        await asyncio.sleep(0.3)
        before = _rss_mib()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--attack", "127.0.0.1", str(lst.port), str(seconds),
            str(size), stdout=subprocess.PIPE)
        out, _ = await asyncio.wait_for(proc.communicate(), seconds + 60)
        await asyncio.sleep(0.3)
        sent = next((json.loads(x)["sent"] for x in out.decode().splitlines()
                     if x.startswith("{")), None)
        print("FLOOD " + json.dumps({"rss_growth_mib": _rss_mib() - before,
                                     "rejected": lst.rejected_connections,
                                     "accepted": lst.accepted, "sent": sent}), flush=True)
    os._exit(0)


if __name__ == "__main__":
    if sys.argv[1] == "--attack":
        attack(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5]))
    else:
        asyncio.run(listen(sys.argv[1], float(sys.argv[2]), int(sys.argv[3]),
                           sys.argv[4:] == ["unproven"]))
