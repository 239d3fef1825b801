"""NIXL's block-list READ between two processes, measured the way vLLM's NIXL connector uses
it, on pools shaped like ``kvkern bench xfer``'s: the peer baseline for kvkern's pull.

    python -m kvkern.tools.nixlbench --sizes 16MiB,64MiB,256MiB --json
    kvkern bench xfer --compare nixl          # both, in one run, with kvkern / NIXL ratios

A target process allocates a host pool (huge pages, as kvkern's pools), fills block ``b`` with
``arange + b * 1_000_003`` (int64), registers it with a NIXL agent (UCX backend) and publishes
its agent metadata and pool address. The initiator (this process)
registers its own pool, loads the target's metadata, prepares one descriptor per block on
both sides once (``prep_xfer_dlist``), and then, per transfer, ``make_prepped_xfer("READ",
...)`` + ``transfer`` + polling ``check_xfer_state`` until DONE: no per-transfer control
message, as in vLLM. Each transfer is timed two ways: the READ alone (from ``transfer``), and
per request as vLLM's connector issues one (from the descriptor ids, with ``notif_msg``, the
notification that lets the target free the blocks; the target counts what it receives and
the run fails unless every one arrived). Block mappings: ``consecutive`` (remote blocks ``0..n-1``) and
``scattered`` (the first ``n`` of :func:`scattered_order` of the whole pool: where kvkern's
scattered source keeps a pull's blocks). After every transfer each block it wrote is
compared with what the target holds, then poisoned (off the clock; the pool starts
poisoned), so a figure is never of bytes that did not move.

Two agent configurations (``--agent``, :data:`AGENTS`): ``vllm``, what vLLM's NIXL connector
creates by default (``num_threads=4``, NIXL's progress thread on), and ``lean`` (no progress
thread, one worker: the initiator polls its READs itself). ``--agent both`` measures each in
turn and keeps, per size and way, the faster (its ``agent`` says which);
``kvkern bench xfer --compare nixl`` runs both after its pulls.

:class:`Server` runs one session (lean agent) in a process of its own, one READ per request
over its stdin and stdout: ``kvkern bench xfer --compare nixl`` interleaves those READs with
its pulls, round by round, and judges kvkern / NIXL on them. The lean agent was the faster
configuration in most recorded runs of both, not all (``agent`` in each record's
``compare.nixl`` says which was, per size and way).

Both processes run with kvkern's UCX settings (:mod:`kvkern.xfer.ucx_env`), so NIXL's UCX
and kvkern's pull choose among the same transports, and under the same engine load when the
run asks for one (:mod:`kvkern.tools.engineload`: each of NIXL's processes starts its own).
NIXL is an optional bench dependency: ``make bench-nixl`` installs ``nixl`` and ``nixl-cu12``
without their dependencies (they would replace the CPU torch build).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvkern.tools import engineload, threadpools

__all__ = ["AGENTS", "BLOCK_BYTES", "MAPPINGS", "Server", "compare", "faster",
           "kvkern_ratios", "main", "run", "scattered_order", "serve", "summary"]

MAPPINGS = ("consecutive", "scattered")
BLOCK_BYTES = 512 << 10  # kvkern bench xfer's block: 8 layers x 2 x 8 heads x 16 x 128 x bf16
STRIDE = 1_000_003
NOTIFY_WAIT_S = 5.0  # how long a stopping target waits for notifications still on their way
# The target's pause between polls for notifications (a READ over shared memory or RDMA
# completes without the target): an idle target polling every 1 / 10 / 50 ms takes 8 / 3 /
# 0.6% of a core, which kvkern's pulls beside it lose (64 MiB 8.8 ms at 1 ms, 7.2 at 10 ms,
# three runs each), while NIXL's READs measured the same at either rate.
TARGET_POLL_S = 0.05
MiB = 1 << 20
# nixl_agent_config arguments of each agent configuration
AGENTS = {"lean": {"enable_prog_thread": False, "backends": ["UCX"]},
          "vllm": {"num_threads": 4}}  # vLLM's NixlConnector default (extra config num_threads)


def _parse_size(text: str) -> int:
    units = {"KIB": 1 << 10, "MIB": MiB, "GIB": 1 << 30}
    for u, m in units.items():
        if text.upper().endswith(u):
            return int(float(text[: -len(u)]) * m)
    return int(text)


def _agent(name: str, config: str):
    from nixl._api import nixl_agent, nixl_agent_config  # noqa: PLC0415

    return nixl_agent(name, nixl_agent_config(**AGENTS[config]))


def _pool(n_blocks: int, fill: bool):
    import torch  # noqa: PLC0415

    from kvkern.layout.hostmem import host_buffer  # noqa: PLC0415

    buf = host_buffer(n_blocks * BLOCK_BYTES)
    words = buf.view(torch.int64).view(n_blocks, BLOCK_BYTES // 8)
    if fill:
        words.copy_(torch.arange(BLOCK_BYTES // 8, dtype=torch.int64)
                    + torch.arange(n_blocks, dtype=torch.int64)[:, None] * STRIDE)
    else:
        buf.fill_(0xA5)
    return buf, words


def _target(workdir: Path, n_blocks: int, parent: int, config: str) -> int:
    """The target process: hold the pool registered until ``stop`` appears or the parent
    dies; poll for notifications meanwhile (progress for transports that need it)."""
    buf, _ = _pool(n_blocks, fill=True)
    agent = _agent("target", config)
    agent.register_memory([(buf.data_ptr(), buf.numel(), 0, "")], "DRAM")
    (workdir / "meta.tmp").write_bytes(agent.get_agent_metadata())
    (workdir / "meta.tmp").rename(workdir / "meta.bin")
    (workdir / "info.json").write_text(json.dumps({"base": buf.data_ptr(),
                                                   "n_blocks": n_blocks}))
    deadline = time.monotonic() + 900
    notifs = 0
    while not (workdir / "stop").exists() and time.monotonic() < deadline:
        try:
            os.kill(parent, 0)
        except OSError:
            break
        notifs += sum(len(msgs) for msgs in agent.get_new_notifs().values())
        time.sleep(TARGET_POLL_S)
    # the stop names how many were sent: the last ones may still be on their way
    stop = workdir / "stop"
    sent = int(stop.read_text() or 0) if stop.exists() else 0
    deadline = time.monotonic() + NOTIFY_WAIT_S
    while True:
        notifs += sum(len(msgs) for msgs in agent.get_new_notifs().values())
        if notifs >= sent or time.monotonic() >= deadline:
            break
        time.sleep(0.001)
    (workdir / "notifs.json").write_text(json.dumps({"received": notifs}))
    return 0


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"NIXL target exited with {proc.returncode} before publishing")
        if time.monotonic() > end:
            raise RuntimeError("NIXL target did not publish its metadata in time")
        time.sleep(0.01)


def scattered_order(n_blocks: int) -> list[int]:
    """Where a scattered pool keeps its blocks: block ``i`` (in a prompt's order) at position
    ``order[i]`` of ``n_blocks`` (``torch.randperm``, seed 0; reversed in the rare case it
    comes out sorted). kvkern's scattered source and NIXL's scattered READ use the same
    order, so a pull of ``n < n_blocks`` blocks reads the same positions on both."""
    import torch  # noqa: PLC0415

    order = torch.randperm(n_blocks, generator=torch.Generator().manual_seed(0)).tolist()
    if order == sorted(order):
        order.reverse()
    return order


def _remote_ids(n: int, mapping: str, n_max: int) -> list[int]:
    """The remote blocks a READ of ``n`` blocks of a pool of ``n_max`` reads, in order:
    ``consecutive`` or ``scattered`` (:func:`scattered_order`)."""
    if mapping == "consecutive":
        return list(range(n))
    if mapping == "scattered":
        return scattered_order(n_max)[:n]
    raise ValueError(f"mapping must be consecutive or scattered, got {mapping!r}")


class _Session:
    """A target process and this process's initiator, each with a pool of ``n_max`` blocks
    registered with a NIXL agent of configuration ``agent``, one descriptor per block
    prepared on both sides; :meth:`read` runs one timed, verified READ. Leaving the
    ``with`` stops the target and, unless an error is leaving too, checks that it received
    every notification sent."""

    def __init__(self, n_max: int, agent: str, timeout_s: float) -> None:
        if agent not in AGENTS:
            raise ValueError(f"agent must be one of {sorted(AGENTS)}, got {agent!r}")
        self.n_max, self.agent, self.timeout_s = n_max, agent, timeout_s
        self.sent = 0

    def __enter__(self) -> _Session:
        import torch  # noqa: PLC0415

        from kvkern.xfer.ucx_env import configure_ucx_env  # noqa: PLC0415

        configure_ucx_env()  # before NIXL loads UCX, in this process and (inherited) the target
        self._tmp = tempfile.TemporaryDirectory(prefix="kvkern-nixl-")
        self.work = work = Path(self._tmp.name)
        self.proc = subprocess.Popen([sys.executable, "-m", "kvkern.tools.nixlbench",
                                      "_target", str(work), str(self.n_max), str(os.getpid()),
                                      self.agent],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     env=dict(os.environ))
        try:
            _wait_for(work / "info.json", self.proc, 60)
            info = json.loads((work / "info.json").read_text())
            self.nx = nx = _agent("initiator", self.agent)
            self.local, self.words = _pool(self.n_max, fill=False)
            nx.register_memory([(self.local.data_ptr(), self.local.numel(), 0, "")], "DRAM")
            remote = nx.add_remote_agent((work / "meta.bin").read_bytes())
            base = info["base"]
            self.local_h = nx.prep_xfer_dlist("NIXL_INIT_AGENT", [
                (self.local.data_ptr() + i * BLOCK_BYTES, BLOCK_BYTES, 0)
                for i in range(self.n_max)], "DRAM")
            self.remote_h = nx.prep_xfer_dlist(remote, [
                (base + i * BLOCK_BYTES, BLOCK_BYTES, 0) for i in range(self.n_max)], "DRAM")
        except BaseException:
            self._stop()
            raise
        self.expect = torch.arange(BLOCK_BYTES // 8, dtype=torch.int64)
        return self

    def read(self, n: int, remote_ids: list[int], per_request: bool = False) -> float:
        """One READ of blocks ``remote_ids`` into local blocks ``0..n-1``, timed from
        ``transfer``; ``per_request``: from the descriptor ids on, with the notification
        that tells the target the blocks were read, as vLLM's connector issues every
        request (``make_prepped_xfer(..., notif_msg=)``). The local blocks it writes are
        compared with the target's after, then poisoned for the next READ, off the clock
        (the pool is poisoned when made), so no READ finds the bytes it should move already
        there. Interleaved with other transfers, a READ mostly starts after others ran
        since that poison; back to back (NIXL's own run, or two of its ways side by side
        in a round) it starts right behind it, its blocks in the caches, dirty."""
        import torch  # noqa: PLC0415

        if not 1 <= n <= self.n_max or len(remote_ids) != n:
            raise ValueError(f"a READ of {n} blocks ({len(remote_ids)} ids) from a pool of "
                             f"{self.n_max}")
        nx = self.nx
        deadline = time.monotonic() + self.timeout_s
        t0 = time.perf_counter()
        h = nx.make_prepped_xfer(
            "READ", self.local_h, list(range(n)), self.remote_h, list(remote_ids),
            **({"notif_msg": f"req-{self.sent}:1".encode()} if per_request else {}))
        self.sent += per_request
        if not per_request:
            t0 = time.perf_counter()
        state = nx.transfer(h)
        while state not in ("DONE", "ERR"):
            if time.monotonic() > deadline:
                raise RuntimeError("NIXL READ did not finish in time")
            state = nx.check_xfer_state(h)
        dt = time.perf_counter() - t0
        nx.release_xfer_handle(h)
        if state != "DONE":
            raise RuntimeError("NIXL READ failed")
        for j, r in enumerate(remote_ids):
            if not torch.equal(self.words[j], self.expect + r * STRIDE):
                raise RuntimeError(f"NIXL READ: local block {j} is not remote {r}")
        self.local[:n * BLOCK_BYTES].fill_(0xA5)
        return dt

    def _stop(self) -> int | None:
        """Stop the target; the notifications it received (None if it did not say)."""
        try:
            (self.work / "stop.tmp").write_text(str(self.sent))
            (self.work / "stop.tmp").rename(self.work / "stop")
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
            got = self.work / "notifs.json"
            return json.loads(got.read_text())["received"] if got.exists() else None
        finally:
            self._tmp.cleanup()

    def __exit__(self, kind: Any, *_: Any) -> None:
        received = self._stop()
        if kind is None and received != self.sent:  # what per-request figures claim arrived
            raise RuntimeError(f"NIXL target received {received} notifications of "
                               f"{self.sent} sent")


def run(sizes: list[int], repeats: int = 5, timeout_s: float = 300.0,
        agent: str = "lean") -> dict[str, Any]:
    """Measure NIXL READ of each size, consecutive and scattered, with the agent
    configuration ``agent`` (:data:`AGENTS`); returns the result document (GB/s medians and
    ranges, every transfer verified)."""
    n_max = max(1, max(sizes) // BLOCK_BYTES)
    out: dict[str, Any] = {"bench": "nixl_read", "block_bytes": BLOCK_BYTES, "agents": [agent],
                           "cases": {}}
    with _Session(n_max, agent, timeout_s) as session:
        for size in sizes:
            n = max(1, size // BLOCK_BYTES)
            row: dict[str, Any] = {"bytes": n * BLOCK_BYTES, "blocks": n}
            for mapping in MAPPINGS:
                ids = _remote_ids(n, mapping, n_max)
                for per_request in (False, True):
                    session.read(n, ids, per_request)  # warm-up: connection, caches
                    times = [session.read(n, ids, per_request) for _ in range(repeats)]
                    key = f"{mapping}_per_request" if per_request else mapping
                    row[key] = {**summary(n * BLOCK_BYTES, times), "verified": repeats + 1,
                                "agent": agent}
            out["cases"][str(n * BLOCK_BYTES)] = row
        out["notifications"] = session.sent
    out["env"] = _environment()
    return out


def _loaded_ucx_version() -> str | None:
    """The version of the libucp this process has loaded (NIXL's wheel bundles its own,
    not necessarily ucxx's), from the loaded library itself; None if none is."""
    import ctypes  # noqa: PLC0415

    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libucp" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
            lib.ucp_get_version_string.restype = ctypes.c_char_p
            return lib.ucp_get_version_string().decode()
        except (OSError, AttributeError):
            continue
    return None


def summary(nbytes: int, times: list[float]) -> dict[str, Any]:
    """GB/s median, 20th and 80th percentiles (as kvkern's pulls are summarised) and range
    (min-max), and the median ms, of READs of ``nbytes`` taking ``times``."""
    gbps = sorted(nbytes / t / 1e9 for t in times)
    q = statistics.quantiles(gbps, n=5) if len(gbps) >= 2 else [gbps[0]] * 4
    return {"gbps": round(statistics.median(gbps), 3), "gbps_p20": round(q[0], 3),
            "gbps_p80": round(q[3], 3), "gbps_range": [round(gbps[0], 3), round(gbps[-1], 3)],
            "ms": round(statistics.median(times) * 1e3, 3)}


def _environment() -> dict[str, Any]:
    import nixl  # noqa: PLC0415

    return {"python": platform.python_version(), "cpus": os.cpu_count(),
            "nixl": getattr(nixl, "__version__", _dist_version("nixl")),
            "ucx": _loaded_ucx_version(), **threadpools.record(),
            "ucx_env": {k: v for k, v in os.environ.items() if k.startswith("UCX")},
            "engine_load": float(os.environ.get(engineload.ENV) or 0.0)}


def serve(n_max: int, agent: str, timeout_s: float = 300.0) -> int:
    """A session driven over stdin/stdout, one JSON object per line, for a benchmark that
    interleaves NIXL's READs with its own transfers: ``{"ready": true, "env": ...}`` once
    set up; per request ``{"blocks": n, "mapping": "consecutive" | "scattered",
    "per_request": bool}`` one reply, ``{"s": seconds}`` or ``{"error": ...}``; at the end
    of input (or ``{"stop": true}``) ``{"notifications": sent}`` once the target confirmed
    receiving them all."""
    # the replies on stdout alone: whatever else prints there (NIXL's own log lines) goes
    # to stderr
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())

    def say(doc: dict[str, Any]) -> None:
        print(json.dumps(doc), file=replies, flush=True)

    with _Session(n_max, agent, timeout_s) as session:
        say({"ready": True, "env": _environment()})
        for line in sys.stdin:
            try:
                cmd = json.loads(line)
                if cmd.get("stop"):
                    break
                n = int(cmd["blocks"])
                say({"s": session.read(n, _remote_ids(n, cmd["mapping"], n_max),
                                       bool(cmd.get("per_request")))})
            except Exception as exc:  # noqa: BLE001 (reported to the driver, which stops)
                say({"error": f"{type(exc).__name__}: {exc}"})
        sent = session.sent
    say({"notifications": sent})
    return 0


class Server:
    """:func:`serve` in a process of its own, driven from an event loop: NIXL's READs
    interleaved with the caller's own transfers, under the same conditions."""

    def __init__(self, proc: Any, env: dict[str, Any], timeout_s: float) -> None:
        self._proc, self.env, self._timeout_s = proc, env, timeout_s

    @classmethod
    async def start(cls, n_max: int, agent: str = "lean",
                    timeout_s: float = 120.0) -> Server:
        """A server with pools of ``n_max`` blocks; RuntimeError if it is not ready within
        ``timeout_s`` (nixl missing, a UCX failure)."""
        import asyncio  # noqa: PLC0415

        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvkern.tools.nixlbench", "_serve", str(n_max), agent,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            env=dict(os.environ))
        server = cls(proc, {}, timeout_s)
        try:
            server.env = (await server._reply())["env"]
        except BaseException:
            await server.close()
            raise
        return server

    async def _reply(self) -> dict[str, Any]:
        import asyncio  # noqa: PLC0415

        try:
            line = await asyncio.wait_for(self._proc.stdout.readline(), self._timeout_s)
        except TimeoutError:
            raise RuntimeError(f"NIXL server did not answer within {self._timeout_s} s") \
                from None
        if not line:
            raise RuntimeError(f"NIXL server exited ({await self._proc.wait()})")
        doc = json.loads(line)
        if "error" in doc:
            raise RuntimeError(f"NIXL server: {doc['error']}")
        return doc

    async def read(self, n: int, mapping: str, per_request: bool = False) -> float:
        """Seconds of one verified READ of ``n`` blocks (see :meth:`_Session.read`)."""
        self._proc.stdin.write(json.dumps({"blocks": n, "mapping": mapping,
                                           "per_request": per_request}).encode() + b"\n")
        await self._proc.stdin.drain()
        return float((await self._reply())["s"])

    async def close(self) -> int | None:
        """Stop the server; the notifications it sent, all received by its target (None
        when it did not end cleanly)."""
        import asyncio  # noqa: PLC0415

        sent = None
        try:
            self._proc.stdin.close()
            sent = (await self._reply()).get("notifications")
            await asyncio.wait_for(self._proc.wait(), 30)
        except (RuntimeError, TimeoutError, OSError, ValueError):
            sent = None
        finally:
            if self._proc.returncode is None:
                self._proc.kill()
                await self._proc.wait()
        return sent


def faster(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One result document from runs of several agent configurations (same sizes): per
    size and way, the run with the higher median GB/s (its ``agent`` names it)."""
    out = {**results[0], "cases": {}, "agents": [a for r in results for a in r["agents"]],
           "notifications": sum(r.get("notifications", 0) for r in results)}
    for size in results[0]["cases"]:
        rows = [r["cases"][size] for r in results]
        out["cases"][size] = {k: (max((row[k] for row in rows), key=lambda c: c["gbps"])
                                  if isinstance(v, dict) else v)
                              for k, v in rows[0].items()}
    return out


def compare(kvkern_result: dict[str, Any], timeout_s: float = 600.0) -> dict[str, Any]:
    """Run this benchmark in a process of its own (NIXL and ucxx each load a UCX) for the
    sizes of ``kvkern_result`` (a ``kvkern bench xfer`` result with its pull case) and add
    kvkern / NIXL ratios per size: the pull against NIXL's consecutive READ, the scattered
    pull against NIXL's scattered READ."""
    pull = kvkern_result.get("cases", {}).get("pull", {})
    sizes = [s for s, r in pull.items() if s.isdigit()]
    if not sizes:
        return {"error": "no pull case to compare (run with --cases including pull)"}
    cmd = [sys.executable, "-m", "kvkern.tools.nixlbench", "--json", "--agent", "both",
           "--sizes", ",".join(sizes)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return {"error": f"NIXL benchmark did not finish within {timeout_s:.0f} s"}
    if done.returncode != 0:
        tail = (done.stderr or "").strip().splitlines()[-1:] or [f"exit {done.returncode}"]
        return {"error": f"NIXL benchmark failed: {tail[0]}"}
    nixl = json.loads(done.stdout.strip().splitlines()[-1])
    for size, row in nixl["cases"].items():
        row.update(kvkern_ratios(pull.get(size, {}), row))
    return nixl


def kvkern_ratios(ours: dict[str, Any], ways: dict[str, Any]) -> dict[str, float]:
    """kvkern / NIXL for one size: the pull (``ours``: a pull case's row) against NIXL's
    consecutive READs, the scattered pull against its scattered ones, each against the READ
    alone and per request (``ways``: NIXL's GB/s per way, those it has). Also, not judged,
    the same pull read through UCX (``ucx_pull_gbps``: as a source on another host is read,
    where the headline reads a source on its own host with kvkern's own system calls)
    against NIXL's consecutive READ (``kvkern_ucx_vs_nixl``), and kvkern's copy phase alone
    (``copy_gbps``: no admission, look-up, confirmation, hand-offs or commit, which NIXL's
    READ does not have either) against it (``kvkern_copy_vs_nixl``)."""
    out = {}
    for key, mapping, suffix in (("pull_gbps", "consecutive", ""),
                                 ("scattered_pull_gbps", "scattered", "_scattered")):
        for way, name in ((mapping, "kvkern_vs_nixl"),
                          (f"{mapping}_per_request", "kvkern_vs_nixl_per_request")):
            if key in ours and way in ways:
                out[f"{name}{suffix}"] = round(ours[key] / ways[way]["gbps"], 3)
    for key, name in (("ucx_pull_gbps", "kvkern_ucx_vs_nixl"),
                      ("copy_gbps", "kvkern_copy_vs_nixl")):
        if key in ours and "consecutive" in ways:
            out[name] = round(ours[key] / ways["consecutive"]["gbps"], 3)
    return out


def _dist_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415

    try:
        return version(name)
    except PackageNotFoundError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    threadpools.settle()  # (before torch loads; the target and the server inherit it)
    argv = list(sys.argv[1:] if argv is None else argv)
    engineload.from_env()  # this process's engine, when the run asks for one (initiator, target)
    if argv[:1] == ["_target"]:
        return _target(Path(argv[1]), int(argv[2]), int(argv[3]), argv[4])
    if argv[:1] == ["_serve"]:
        return serve(int(argv[1]), argv[2])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="16MiB,64MiB,256MiB", help="comma list (default %(default)s)")
    ap.add_argument("--repeats", type=int, default=5, help="timed transfers per case (default %(default)s)")
    ap.add_argument("--agent", choices=[*AGENTS, "both"], default="both",
                    help="NIXL agent configuration: vllm (vLLM's connector default), lean, "
                         "or both, keeping the faster per size and way (default %(default)s)")
    ap.add_argument("--json", action="store_true", help="print the result document as one JSON line")
    args = ap.parse_args(argv)
    try:
        import nixl  # noqa: F401, PLC0415
    except ImportError:
        print("nixl is not installed: `make bench-nixl` installs it into the project venv",
              file=sys.stderr)
        return 2
    sizes = [_parse_size(s) for s in args.sizes.split(",") if s]
    res = faster([run(sizes, repeats=args.repeats, agent=a)
                  for a in (AGENTS if args.agent == "both" else [args.agent])])
    if args.json:
        print(json.dumps(res))
    else:
        for size, row in res["cases"].items():
            print(f"{int(size) / MiB:8.0f} MiB  consecutive {row['consecutive']['gbps']:6.2f} "
                  f"GB/s  scattered {row['scattered']['gbps']:6.2f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
