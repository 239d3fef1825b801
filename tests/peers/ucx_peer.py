"""A test peer: a tiny pull source on 127.0.0.1 driven by PullRequest messages.

Run as ``python tests/peers/ucx_peer.py PORT_FILE``. It listens on a free port, writes the
port number to PORT_FILE (via a rename, so a reader never sees half a number; never stdout:
UCX writes warnings there) and serves until killed.

For each PullRequest the stream is ``sum(piece.length)`` bytes of ``pattern(transfer_id, n)``
cut into ``chunk_bytes`` chunks. ``request_id`` picks a behaviour:

    ok        reply, then send every chunk
    silent    reply, then never send data (the receiver must time out)
    noreply   never reply
    die       reply, send the first chunk, then SIGKILL itself mid-transfer
    stop      reply, send the first chunk, then SIGSTOP itself (frozen, connection open)
    sink      reply, then *receive* the stream from the requester and answer with a second
              PullReply whose reason is the hex sha256 of what arrived
    reuse     reply, send every chunk with a 1 ms progress timeout (less than a large chunk's
              copy); once that fails (an abort), overwrite the chunks' memory, as a source
              reusing its staging does
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import sys

import numpy as np

from kvkern.xfer.messages import Cancel, PullRequest, Status, StreamReply
from kvkern.xfer.transport import Lane, Listener, TransportError, tag_for


def pattern(transfer_id: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(transfer_id).integers(0, 256, nbytes, dtype=np.uint8)


def chunk_sizes(total: int, chunk_bytes: int) -> list[int]:
    sizes = [chunk_bytes] * (total // chunk_bytes)
    if total % chunk_bytes or total == 0:
        sizes.append(total % chunk_bytes)
    return sizes


async def serve_one(conn, req: PullRequest) -> None:
    total = sum(p.length for p in req.pieces)
    sizes = chunk_sizes(total, req.chunk_bytes)
    reply = StreamReply(transfer_id=req.transfer_id, status=Status.OK,
                        served_blocks=req.count, block_hashes=req.requested_hashes,
                        total_bytes=total, n_chunks=len(sizes), chunk_sizes=sizes)
    mode = req.request_id
    if mode == "noreply":
        return
    await conn.send_msg(reply, tag_for(req.transfer_id, Lane.REPLY))
    if mode == "silent":
        return
    offsets = np.cumsum([0, *sizes])
    if mode == "sink":
        data = np.empty(total, dtype=np.uint8)
        await conn.recv_chunks(req.transfer_id,
                               [data[offsets[i]:offsets[i + 1]] for i in range(len(sizes))],
                               timeout=10)
        digest = hashlib.sha256(data.tobytes()).hexdigest()
        done = StreamReply(transfer_id=req.transfer_id, status=Status.OK, reason=digest)
        await conn.send_msg(done, tag_for(req.transfer_id, Lane.REPLY, 1))
        return
    data = pattern(req.transfer_id, total)

    def produce(i: int):
        if mode in ("die", "stop") and i == 1:
            os.kill(os.getpid(), signal.SIGKILL if mode == "die" else signal.SIGSTOP)
        return data[offsets[i]:offsets[i + 1]]

    if mode == "reuse":
        try:
            await conn.send_stream(req.transfer_id, produce, len(sizes), timeout=0.001)
        except TransportError:
            np.bitwise_not(data, out=data)  # the next request's bytes, in the same memory
        return
    await conn.send_stream(req.transfer_id, produce, len(sizes), timeout=10,
                           max_in_flight=1 if mode in ("die", "stop") else 4)


async def handler(conn) -> None:
    tasks = set()
    try:
        while True:
            msg = await conn.recv_msg(timeout=None)
            if isinstance(msg, Cancel):
                continue
            t = asyncio.ensure_future(serve_one(conn, msg))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
    except TransportError:
        pass
    finally:
        for t in tasks:
            t.cancel()


async def main(port_file: str) -> None:
    listener = await Listener(handler, host="127.0.0.1").start()
    tmp = port_file + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(listener.port))
    os.replace(tmp, port_file)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
