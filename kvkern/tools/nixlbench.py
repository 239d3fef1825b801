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
``scattered`` (remote blocks in the order of ``torch.randperm(n, seed 0)``, kvkern's scattered
source). Before every transfer the local blocks are poisoned; after it every block is compared
with what the target holds, so a figure is never of bytes that did not move.

Two agent configurations (``--agent``, :data:`AGENTS`): ``vllm``, what vLLM's NIXL connector
creates by default (``num_threads=4``, NIXL's progress thread on), and ``lean`` (no progress
thread, one worker: the initiator polls its READs itself). ``--agent both`` measures each in
turn and keeps, per size and way, the faster (its ``agent`` says which);
``kvkern bench xfer --compare nixl`` runs both, so kvkern is judged against NIXL at its best.

Both processes run with kvkern's UCX settings (:mod:`kvkern.xfer.ucx_env`), so NIXL's UCX
and kvkern's pull choose among the same transports. NIXL is an optional bench dependency:
``make bench-nixl`` installs ``nixl`` and ``nixl-cu12`` without their dependencies (they would
replace the CPU torch build).
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

__all__ = ["AGENTS", "BLOCK_BYTES", "compare", "faster", "main", "run"]

BLOCK_BYTES = 512 << 10  # kvkern bench xfer's block: 8 layers x 2 x 8 heads x 16 x 128 x bf16
STRIDE = 1_000_003
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
        time.sleep(0.001)
    notifs += sum(len(msgs) for msgs in agent.get_new_notifs().values())
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


def run(sizes: list[int], repeats: int = 5, timeout_s: float = 300.0,
        agent: str = "lean") -> dict[str, Any]:
    """Measure NIXL READ of each size, consecutive and scattered, with the agent
    configuration ``agent`` (:data:`AGENTS`); returns the result document (GB/s medians and
    ranges, every transfer verified)."""
    if agent not in AGENTS:
        raise ValueError(f"agent must be one of {sorted(AGENTS)}, got {agent!r}")
    import torch  # noqa: PLC0415

    from kvkern.xfer.ucx_env import configure_ucx_env  # noqa: PLC0415

    configure_ucx_env()  # before NIXL loads UCX, in this process and (inherited) the target
    n_max = max(1, max(sizes) // BLOCK_BYTES)
    out: dict[str, Any] = {"bench": "nixl_read", "block_bytes": BLOCK_BYTES, "agents": [agent],
                           "cases": {}}
    with tempfile.TemporaryDirectory(prefix="kvkern-nixl-") as tmp:
        work = Path(tmp)
        proc = subprocess.Popen([sys.executable, "-m", "kvkern.tools.nixlbench", "_target",
                                 str(work), str(n_max), str(os.getpid()), agent],
                                stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, env=dict(os.environ))
        try:
            _wait_for(work / "info.json", proc, 60)
            info = json.loads((work / "info.json").read_text())
            nx = _agent("initiator", agent)
            local, words = _pool(n_max, fill=False)
            nx.register_memory([(local.data_ptr(), local.numel(), 0, "")], "DRAM")
            remote = nx.add_remote_agent((work / "meta.bin").read_bytes())
            base = info["base"]
            local_h = nx.prep_xfer_dlist("NIXL_INIT_AGENT", [
                (local.data_ptr() + i * BLOCK_BYTES, BLOCK_BYTES, 0) for i in range(n_max)],
                "DRAM")
            remote_h = nx.prep_xfer_dlist(remote, [
                (base + i * BLOCK_BYTES, BLOCK_BYTES, 0) for i in range(n_max)], "DRAM")
            expect = torch.arange(BLOCK_BYTES // 8, dtype=torch.int64)
            deadline = time.monotonic() + timeout_s

            sent = [0]

            def read(n: int, remote_ids: list[int], per_request: bool = False) -> float:
                """One READ of blocks ``remote_ids`` into local blocks ``0..n-1``, timed
                from ``transfer``; ``per_request``: from the descriptor ids on, with the
                notification that tells the target the blocks were read, as vLLM's
                connector issues every request (``make_prepped_xfer(..., notif_msg=)``)."""
                local.fill_(0xA5)
                t0 = time.perf_counter()
                h = nx.make_prepped_xfer(
                    "READ", local_h, list(range(n)), remote_h, list(remote_ids),
                    **({"notif_msg": f"req-{sent[0]}:1".encode()} if per_request else {}))
                sent[0] += per_request
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
                    if not torch.equal(words[j], expect + r * STRIDE):
                        raise RuntimeError(f"NIXL READ: local block {j} is not remote {r}")
                return dt

            for size in sizes:
                n = max(1, size // BLOCK_BYTES)
                order = torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()
                row: dict[str, Any] = {"bytes": n * BLOCK_BYTES, "blocks": n}
                for mapping, ids in (("consecutive", list(range(n))), ("scattered", order)):
                    for per_request in (False, True):
                        read(n, ids, per_request)  # warm-up: connection, registration caches
                        times = sorted(read(n, ids, per_request) for _ in range(repeats))
                        gbps = [n * BLOCK_BYTES / t / 1e9 for t in times]
                        key = f"{mapping}_per_request" if per_request else mapping
                        row[key] = {"gbps": round(statistics.median(gbps), 3),
                                    "gbps_range": [round(min(gbps), 3), round(max(gbps), 3)],
                                    "ms": round(statistics.median(times) * 1e3, 3),
                                    "verified": repeats + 1, "agent": agent}
                out["cases"][str(n * BLOCK_BYTES)] = row
        finally:
            (work / "stop").write_text("")
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        got = work / "notifs.json"
        received = json.loads(got.read_text())["received"] if got.exists() else None
        if received != sent[0]:  # what the per-request figures claim was sent, arrived
            raise RuntimeError(f"NIXL target received {received} notifications of "
                               f"{sent[0]} sent")
        out["notifications"] = sent[0]
    import nixl  # noqa: PLC0415

    out["env"] = {"python": platform.python_version(), "cpus": os.cpu_count(),
                  "nixl": getattr(nixl, "__version__", _dist_version("nixl")),
                  "ucx_env": {k: v for k, v in os.environ.items() if k.startswith("UCX")}}
    return out


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
        ours = pull.get(size, {})
        if "pull_gbps" in ours:
            row["kvkern_vs_nixl"] = round(ours["pull_gbps"] / row["consecutive"]["gbps"], 3)
        if "scattered_pull_gbps" in ours:
            row["kvkern_vs_nixl_scattered"] = round(
                ours["scattered_pull_gbps"] / row["scattered"]["gbps"], 3)
        for mapping, key in (("consecutive", "pull_gbps"), ("scattered", "scattered_pull_gbps")):
            per = row.get(f"{mapping}_per_request")
            if per is not None and key in ours:
                suffix = "" if mapping == "consecutive" else "_scattered"
                row[f"kvkern_vs_nixl_per_request{suffix}"] = round(ours[key] / per["gbps"], 3)
    return nixl


def _dist_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415

    try:
        return version(name)
    except PackageNotFoundError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_target"]:
        return _target(Path(argv[1]), int(argv[2]), int(argv[3]), argv[4])
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
