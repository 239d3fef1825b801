"""Which source tree a recorded result was measured on: the commit, and whether the working
tree's tracked files differed from it (a record of uncommitted code says so); the records and
the results generated from them do not count."""

from __future__ import annotations

import subprocess
from pathlib import Path

__all__ = ["git_state"]

_HERE = Path(__file__).resolve().parent
# what recording results changes: not the code a record was measured on
_RECORDS = ("bench/results", "bench/RESULTS.md")


def _git(cwd: Path, *args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def git_state(cwd: str | Path | None = None, *, length: int = 7) -> dict[str, object]:
    """``{"commit": <short hash or "unknown">, "dirty": bool}`` of the repository at ``cwd``
    (default: the one this package is in)."""
    where = Path(cwd) if cwd is not None else _HERE
    commit = _git(where, "rev-parse", f"--short={length}", "HEAD")
    status = _git(where, "status", "--porcelain", "--untracked-files=no", "--", ":(top)",
                  *(f":(top,exclude){p}" for p in _RECORDS))
    return {"commit": commit or "unknown", "dirty": bool(status)}
