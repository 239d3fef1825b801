"""The documentation runs as written: every ```python runnable block of docs/*.md and the
README executes (CPU, small), every `kvkern ...` command it names exists with the flags it
uses, every `make` target exists, and the reference pages cover every reason, metric, flag and
route the code has."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md", ROOT / "SECURITY.md"]
RUNNABLE = re.compile(r"^```python runnable\n(.*?)^```", re.S | re.M)
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`([^`\n]+)`")
COMMAND = re.compile(r"(?:\.venv/bin/kvkern|python3? -m kvkern|(?<![\w/.-])kvkern)[ \t]+"
                     r"([a-z][a-z-]*)([^\n|;&>#]*)")
MAKE = re.compile(r"(?<![\w-])make[ \t]+([a-z][a-z-]*)")


def _rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


def runnable_blocks() -> list[tuple[str, int, str]]:
    out = []
    for page in PAGES:
        for i, m in enumerate(RUNNABLE.finditer(page.read_text())):
            out.append((_rel(page), i, m.group(1)))
    return out


BLOCKS = runnable_blocks()


def test_the_pages_that_promise_examples_have_them():
    pages = {p for p, _, _ in BLOCKS}
    assert {"README.md", "docs/hints.md", "docs/integration.md"} <= pages, pages
    assert sum(p == "README.md" for p, _, _ in BLOCKS) >= 3


@pytest.mark.parametrize("page, index, code", BLOCKS, ids=[f"{p}#{i}" for p, i, _ in BLOCKS])
def test_runnable_block(page, index, code, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.setdefault("TRITON_INTERPRET", "1")  # CPU: the kernels run under the interpreter
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, f"{page} block {index} failed:\n{r.stdout[-2000:]}{r.stderr[-4000:]}"


# ------------------------------------------------------------------------- commands


def _code_text(text: str) -> str:
    """Fenced blocks (continuation lines joined) and inline code spans."""
    parts = [m.group(1).replace("\\\n", " ") for m in FENCE.finditer(text)]
    parts += [m.group(1) for m in INLINE.finditer(FENCE.sub("", text))]
    return "\n".join(parts)


def commands() -> list[tuple[str, str, str]]:
    found = []
    for page in PAGES:
        for m in COMMAND.finditer(_code_text(page.read_text())):
            found.append((_rel(page), m.group(1), m.group(2)))
    return found


@functools.cache
def help_text(*command: str) -> str:
    r = subprocess.run([sys.executable, "-m", "kvkern", *command, "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (command, r.stderr[-2000:])
    return r.stdout


def test_every_kvkern_command_in_the_docs_exists_with_its_flags():
    from kvkern.cli import SUBCOMMANDS

    found = commands()
    assert len(found) >= 15, found  # the extraction itself works
    problems = []
    for page, sub, rest in found:
        if sub not in SUBCOMMANDS:
            problems.append(f"{page}: `kvkern {sub}` is not a subcommand")
            continue
        words = rest.split()
        command = (sub, "xfer") if sub == "bench" and words[:1] == ["xfer"] else (sub,)
        text = help_text(*command)
        for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", rest):
            if flag != "--help" and not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text):
                problems.append(f"{page}: `kvkern {' '.join(command)}` has no {flag}")
    assert not problems, "\n".join(problems)


def test_every_make_target_in_the_docs_exists():
    targets = set(re.findall(r"^([a-z][a-z-]*):", (ROOT / "Makefile").read_text(), re.M))
    named = {(_rel(p), t) for p in PAGES for t in MAKE.findall(_code_text(p.read_text()))}
    assert named, "no make target found in the docs"
    missing = sorted((p, t) for p, t in named if t not in targets)
    assert not missing, missing


def test_the_readme_keeps_the_quickstart():
    readme = (ROOT / "README.md").read_text()
    assert "make demo" in readme and "make test" in readme


# ------------------------------------------------------------------------- coverage


def test_every_outcome_reason_is_documented():
    from kvkern.xfer.hints import REASONS
    from kvkern.xfer.outcome import Reason

    page = (ROOT / "docs" / "http-api.md").read_text()
    missing = [r for r in [*(x.value for x in Reason), *REASONS] if f"`{r}`" not in page]
    assert not missing, missing


def _metric_names(text: str) -> set[str]:
    names = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
        if name.endswith("_created"):  # prometheus_client's creation-time series
            continue
        names.add(f"{name}_total" if kind == "counter" and not name.endswith("_total")
                  else name)
    return names


def test_every_metric_is_documented():
    from kvkern.serve.routermetrics import RouterMetrics
    from kvkern.xfer.metrics import XferMetrics

    router = RouterMetrics()
    router.add_worker("w")
    names = _metric_names(router.render().decode())
    names |= _metric_names(XferMetrics().render().decode())
    assert len(names) > 20, names
    page = (ROOT / "docs" / "operations.md").read_text()
    missing = sorted(n for n in names if f"`{n}`" not in page)
    assert not missing, missing


@pytest.mark.parametrize("command", ["worker", "router"])
def test_every_flag_is_documented(command):
    flags = set(re.findall(r"^\s+(--[a-z][a-z0-9-]*)", help_text(command), re.M)) - {"--help"}
    assert len(flags) > 8
    page = (ROOT / "docs" / "operations.md").read_text()
    missing = sorted(f for f in flags if f"`{f}`" not in page)
    assert not missing, missing


def test_every_route_is_documented():
    from kvkern.serve.router import KVRouter, build_app

    router = KVRouter(4)
    app = build_app(router, refresh_s=None, credential=None)
    paths = {r.resource.canonical for r in app.router.routes()}
    worker = (ROOT / "kvkern" / "serve" / "worker.py").read_text()
    paths |= set(re.findall(r'web\.(?:get|post)\("(/[^"]+)"', worker))
    paths |= {"/kvkern/v1/state", "/kvkern/v1/blocks", "/metrics", "/healthz"}
    page = (ROOT / "docs" / "http-api.md").read_text()
    missing = sorted(p for p in paths if f"{p}`" not in page)
    assert not missing, missing


def test_every_allowlist_entry_in_the_docs_parses():
    from kvkern.xfer.endpoint import Allowlist

    entries = {(_rel(p), v.strip("'\""))
               for p in PAGES for v in re.findall(r"--allow[ =](\S+)", _code_text(p.read_text()))}
    assert len(entries) >= 3, entries
    bad = []
    for page, entry in sorted(entries):
        try:
            Allowlist.parse([entry])
        except ValueError as exc:
            bad.append(f"{page}: {exc}")
    assert not bad, bad


def test_the_pages_speak_about_the_product_only():
    """No dates, commit hashes, development phases or "here" measurements in the README or
    the guides (recorded results live in bench/results/ with their environment)."""
    patterns = {"a date": r"\b20\d\d-\d\d-\d\d\b", "a session": r"\bsessions?\b",
                "a commit": r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b",
                "'here'": r"\bhere\b", "'this machine'": r"\bthis (machine|box|host)\b"}
    found = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = page.read_text()
        for what, pattern in patterns.items():
            for m in re.finditer(pattern, text, re.I if what != "a commit" else 0):
                found.append(f"{_rel(page)}: {what}: {text[max(0, m.start() - 30):m.end() + 30]!r}")
    assert not found, "\n".join(found)
