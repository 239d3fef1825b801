"""The pull's performance targets, judged on one ``kvkern bench xfer`` run.

``kvkern bench xfer --compare nixl`` measures, in one invocation: the pull against a raw send
and against NIXL's READ at each size (NIXL's READs interleaved with the pulls, round by round;
NIXL's own later run where a size lacks them), the stream path, one-block pulls on a warm
connection, and (``--reshards``, on by default with ``--compare``) TP and PP reshards, each
against a raw send of the same bytes between the same two processes. :func:`evaluate` turns
that result into one verdict per target and place (size, reshard)::

    {"target": "reshard_vs_raw", "where": "TP 2:1, 64 MiB", "value": 0.68,
     "bound": ">= 0.9", "met": false, "what": "a reshard's pull / raw send of its bytes"}

Every value comes from the same run. A target with nothing measured for it is never met by
default: with ``complete`` (a targets run, ``--compare``) each place the targets name (16, 64
and 256 MiB, each reshard) that the run did not measure is a verdict of its own, ``value``
None and ``measured`` false, counted as not met.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from typing import Any

__all__ = ["RESHARDS", "TARGETS", "evaluate", "format_lines", "parse_reshards",
           "run_reshards"]

# name -> ((TP source, destination), (PP source, destination)), all on the bench's model
RESHARDS: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {
    "tp2:1": ((2, 1), (1, 1)),
    "tp1:2": ((1, 2), (1, 1)),
    "pp2:1": ((1, 1), (2, 1)),
    "pp1:2": ((1, 1), (1, 2)),
}

# target -> (bound, ">=" or "<=", what it measures)
TARGETS: dict[str, tuple[float, str, str]] = {
    "kvkern_vs_nixl": (1.0, ">=", "pull / NIXL (its faster way) of the same blocks, consecutive"),
    "kvkern_vs_nixl_scattered": (1.0, ">=", "pull / NIXL (its faster way) of the same blocks, scattered"),
    # (NIXL's figure is the faster of its READ alone and its READ issued per request as
    # vLLM's connector does, descriptor ids and notification included: the stricter bound)
    "hint_to_first_byte_ms": (0.5, "<=", "hint to first byte of a 1-block pull, warm (ms)"),
    "one_block_overhead_ms": (0.5, "<=", "a warm 1-block pull less its block's copy (ms)"),
    "pull_overhead_ms": (0.5, "<=", "a pull less its copy phase (ms)"),
    "stream_ratio": (0.9, ">=", "stream / raw send, consecutive blocks (sent and landing unstaged)"),
    "stream_scattered_ratio": (0.8, ">=", "stream / raw send, scattered blocks"),
    "reshard_vs_raw": (0.9, ">=", "a reshard's pull / raw send of its bytes"),
}

_OPS = {">=": operator.ge, "<=": operator.le}


def parse_reshards(text: str | None, *, compare: bool) -> tuple[str, ...]:
    """``--reshards``: ``none``, ``all`` or a comma list of :data:`RESHARDS` names; unset, all
    of them with ``--compare`` and none without. ValueError for an unknown name."""
    if text is None:
        text = "all" if compare else "none"
    text = text.strip().lower()
    if text == "none":
        return ()
    if text == "all":
        return tuple(RESHARDS)
    names = tuple(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    unknown = [n for n in names if n not in RESHARDS]
    if unknown or not names:
        raise ValueError(f"unknown reshards {unknown or [text]}; known: {', '.join(RESHARDS)}, "
                         "all, none")
    return names


def run_reshards(settings: Any, names: tuple[str, ...],
                 run: Callable[[Any], dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``run(settings')`` (``benchcli.run_xfer``) once per reshard, with the raw and pull cases
    only and the pull's headline, scattered and stream variants; a run that fails is
    recorded as ``{"error": ...}`` and the next one runs."""
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        tp, pp = RESHARDS[name]
        sub = dataclasses.replace(settings, cases=("raw", "pull"), pull_tp=tp, pull_pp=pp,
                                  all_variants=False, nixl=False)
        try:
            res = run(sub)
        except Exception as exc:  # noqa: BLE001 (recorded; the other reshards still run)
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        res.pop("env", None)  # the main run's
        out[name] = res
    return out


def _where(size: str | None, reshard: str | None = None) -> str:
    parts = []
    if reshard is not None:
        kind, split = reshard[:2].upper(), reshard[2:]
        parts.append(f"{kind} {split}")
    if size is not None:
        n = int(size)
        parts.append(f"{n >> 20} MiB" if n % (1 << 20) == 0 else f"{n} B")
    return ", ".join(parts) or "-"


def _verdict(target: str, where: str, value: Any) -> dict[str, Any] | None:
    if not isinstance(value, (int, float)):
        return None
    bound, op, what = TARGETS[target]
    return {"target": target, "where": where, "value": round(float(value), 3),
            "bound": f"{op} {bound}", "met": bool(_OPS[op](value, bound)), "what": what}


REQUIRED_SIZES = (16 << 20, 64 << 20, 256 << 20)  # where the size-bound targets are judged


def evaluate(res: dict[str, Any], *, complete: bool = False) -> list[dict[str, Any]]:
    """One verdict per target and place measured in ``res`` (a ``kvkern bench xfer`` result,
    with its ``compare`` and ``reshards`` when run); ``complete``: and one, not met, per
    place the targets name that it did not measure."""
    out: list[dict[str, Any] | None] = []
    pull = res.get("cases", {}).get("pull", {})
    sizes = sorted((k for k in pull if k.isdigit()), key=int)
    nixl = res.get("compare", {}).get("nixl", {}).get("cases", {})
    for size in sorted(set(nixl) | {k for k in sizes if "nixl" in pull[k]}, key=int):
        # NIXL's READs interleaved with the pulls where the run has them, else its own run's
        # (said in the verdict's place: measured minutes apart, not round by round)
        interleaved = "nixl" in pull.get(size, {})
        row = pull[size] if interleaved else nixl[size]
        where = _where(size) if interleaved else f"{_where(size)} (NIXL's own run)"
        for key, suffix in (("kvkern_vs_nixl", ""), ("kvkern_vs_nixl_scattered", "_scattered")):
            ratios = [r for r in (row.get(key), row.get(f"kvkern_vs_nixl_per_request{suffix}"))
                      if isinstance(r, (int, float))]
            out.append(_verdict(key, where, min(ratios, default=None)))
    for key in ("hint_to_first_byte_ms", "one_block_overhead_ms"):
        out.append(_verdict(key, "1 block", pull.get(key)))
    for size in sizes:
        out.append(_verdict("pull_overhead_ms", _where(size), pull[size].get("overhead_ms")))
        for key in ("stream_ratio", "stream_scattered_ratio"):
            out.append(_verdict(key, _where(size), pull[size].get(key)))
    for name, sub in res.get("reshards", {}).items():
        sub_pull = sub.get("cases", {}).get("pull", {})
        for size in sorted((k for k in sub_pull if k.isdigit()), key=int):
            out.append(_verdict("reshard_vs_raw", _where(size, name),
                                sub_pull[size].get("ratio")))
    found = [v for v in out if v is not None]
    return found + (_unmeasured(found) if complete else [])


def _unmeasured(found: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A verdict, not met, for each place the targets name that ``found`` has none for (a
    NIXL figure from NIXL's own run counts for its size)."""
    have = {(v["target"], v["where"].removesuffix(" (NIXL's own run)")) for v in found}
    places = [(t, "1 block") for t in ("hint_to_first_byte_ms", "one_block_overhead_ms")]
    for size in map(str, REQUIRED_SIZES):
        places += [(t, _where(size)) for t in ("kvkern_vs_nixl", "kvkern_vs_nixl_scattered",
                                               "pull_overhead_ms", "stream_ratio",
                                               "stream_scattered_ratio")]
        places += [("reshard_vs_raw", _where(size, name)) for name in RESHARDS]
    out = []
    for target, where in places:
        if (target, where) not in have:
            bound, op, what = TARGETS[target]
            out.append({"target": target, "where": where, "value": None,
                        "bound": f"{op} {bound}", "met": False, "measured": False,
                        "what": what})
    return out


def format_lines(verdicts: list[dict[str, Any]]) -> list[str]:
    """The verdicts as aligned text lines, met or missed first in each."""
    return [f"  {'met   ' if v['met'] else 'MISSED'} {v['target']:26s} {v['where']:18s} "
            + (f"{v['value']:8.3f}" if v["value"] is not None else "    none")
            + f"  (want {v['bound']})" for v in verdicts]
