"""Every usage mistake of ``kvkern worker`` and ``kvkern router`` is one line on stderr naming
the problem (and the fix), exit status 2, no traceback; the start-up warnings; help text with
a default for every flag and no internal option listed."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time

import pytest
import torch

from kvkern.serve.procs import WorkerProcess

TINY = ["--model", "tiny", "--num-blocks", "16"]


def kvkern(*args: str, env: dict[str, str] | None = None,
           timeout: float = 120.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvkern", *args], capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                          env={**os.environ, **(env or {})})


def assert_one_line_error(r: subprocess.CompletedProcess, prog: str, *words: str) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"kvkern {prog}: error: "), lines[0]
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.fixture
def short_secret(tmp_path):
    path = tmp_path / "fleet.key"
    path.write_text("abcd\n")
    return str(path)


WORKER_MISTAKES = {
    "bad-allow": (["--allow", "10.0.0.0/33"], {}, ["allowlist entry", "10.0.0.0/33", "CIDR"]),
    "bad-allow-env": ([], {"KVKERN_ALLOWLIST": "10.0.0.0/8, host:99999"}, ["host:99999"]),
    "bad-device": (["--device", "tpu"], {}, ["--device", "cpu, cuda"]),
    "negative-timeout": (["--metadata-timeout-s", "-1"], {}, ["--metadata-timeout-s", "> 0"]),
    "zero-deadline": (["--deadline-s", "0"], {}, ["--deadline-s"]),
    "nan-lease": (["--lease-s", "nan"], {}, ["--lease-s"]),
    "zero-blocks": (["--num-blocks", "0"], {}, ["--num-blocks", ">= 1"]),
    "word-threads": (["--threads", "many"], {}, ["--threads", "many"]),
    "port-range": (["--port", "70000"], {}, ["--port", "0..65535"]),
    "huge-chunk": (["--chunk-mib", "99999"], {}, ["--chunk-mib", "16384"]),
    "bad-log-level": (["--log-level", "loud"], {}, ["--log-level"]),
    "any-host-no-advertise": (["--host", "0.0.0.0"], {}, ["--advertise-host"]),
    "unknown-flag": (["--alow", "10.0.0.0/8"], {}, ["--alow"]),
    "bad-accept-from": (["--accept-from", "10.0.0.0/33"], {}, ["--accept-from", "10.0.0.0/33"]),
    "long-worker-id": (["--worker-id", "w" * 300], {}, ["--worker-id", "256"]),
    "bad-accept-from-env": ([], {"KVKERN_ACCEPT_FROM": "fleet.example"},
                            ["--accept-from", "fleet.example"]),
    "missing-secret-file": (["--fleet-secret-file", "/nonexistent/fleet.key"], {},
                            ["/nonexistent/fleet.key", "kvkern secret"]),
    "short-secret-env": ([], {"KVKERN_FLEET_SECRET": "too-short"},
                         ["at least 32 bytes", "kvkern secret"]),
}


@pytest.mark.parametrize("case", sorted(WORKER_MISTAKES))
def test_worker_usage_mistake_is_one_line(case):
    args, env, words = WORKER_MISTAKES[case]
    r = kvkern("worker", *TINY, *args, env=env)
    assert_one_line_error(r, "worker", *words)


def test_worker_short_secret_file(short_secret):
    r = kvkern("worker", *TINY, "--fleet-secret-file", short_secret)
    assert_one_line_error(r, "worker", short_secret, "at least 32 bytes", "kvkern secret")


def test_worker_port_in_use(busy_port):
    t0 = time.monotonic()
    r = kvkern("worker", *TINY, "--port", str(busy_port))
    assert_one_line_error(r, "worker", str(busy_port), "in use", "--port")
    assert time.monotonic() - t0 < 60  # found before the model loads


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has CUDA")
def test_worker_cuda_without_cuda():
    r = kvkern("worker", *TINY, "--device", "cuda")
    assert_one_line_error(r, "worker", "no CUDA device", "--device cpu")


def test_worker_warns_when_nothing_is_allowed_and_there_is_no_secret():
    """No allowlist and no fleet secret: the worker starts, and says at once what that
    means and how to fix it."""
    env = {"KVKERN_FLEET_SECRET": "", "KVKERN_FLEET_SECRET_FILE": "", "KVKERN_ALLOWLIST": ""}
    with WorkerProcess("bare", [*TINY, "--port", "0"], env=env) as w:
        w.wait_ready(90)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            out = w.output(50)
            if "no fleet credential" in out and "no source is allowed" in out:
                break
            time.sleep(0.2)
    warnings = [ln for ln in out.splitlines() if " WARNING " in ln]
    assert any("no source is allowed" in ln and "--allow" in ln for ln in warnings), out
    assert any("no fleet credential" in ln and "kvkern secret" in ln for ln in warnings), out


def test_worker_with_allowlist_and_secret_does_not_warn():
    with WorkerProcess("ok", [*TINY, "--port", "0", "--allow", "127.0.0.0/8"]) as w:
        w.wait_ready(90)
        out = w.output(50)
    assert "no source is allowed" not in out and "no fleet credential" not in out, out


ROUTER_MISTAKES = {
    "no-worker": ([], ["--worker"]),
    "bad-worker-url": (["--worker", "a=ftp://x"], ["ftp://x", "http"]),
    "bad-worker-port": (["--worker", "http://h:port"], ["http://h:port"]),
    "duplicate-ids": (["--worker", "a=http://h:1", "--worker", "a=http://h:2"], ["distinct"]),
    "zero-block-size": (["--worker", "http://h:1", "--block-size", "0"], ["--block-size"]),
    "negative-refresh": (["--worker", "http://h:1", "--refresh-s", "-1"], ["--refresh-s"]),
    "negative-timeout": (["--worker", "http://h:1", "--request-timeout-s", "-5"],
                         ["--request-timeout-s"]),
    "long-hint-ttl": (["--worker", "http://h:1", "--hint-ttl-s", "9999"], ["--hint-ttl-s", "600"]),
    "bad-dialect": (["--worker", "http://h:1", "--dialect", "grpc"], ["--dialect"]),
    "missing-secret-file": (["--worker", "http://h:1", "--fleet-secret-file", "/nonexistent/k"],
                            ["/nonexistent/k", "kvkern secret"]),
}


@pytest.mark.parametrize("case", sorted(ROUTER_MISTAKES))
def test_router_usage_mistake_is_one_line(case):
    args, words = ROUTER_MISTAKES[case]
    r = kvkern("router", "--block-size", "4", *args) if "--block-size" not in args else \
        kvkern("router", *args)
    assert_one_line_error(r, "router", *words)


def test_router_short_secret_file(short_secret):
    r = kvkern("router", "--worker", "http://h:1", "--block-size", "4",
               "--fleet-secret-file", short_secret)
    assert_one_line_error(r, "router", "at least 32 bytes")


def test_router_port_in_use(busy_port):
    r = kvkern("router", "--worker", "http://127.0.0.1:1", "--block-size", "4",
               "--port", str(busy_port))
    assert_one_line_error(r, "router", str(busy_port), "in use")


# ------------------------------------------------------------------------------- help


def _options(help_text: str) -> dict[str, str]:
    """``--flag`` -> its help text, from argparse's option listing."""
    out: dict[str, str] = {}
    current = None
    for line in help_text.splitlines():
        m = re.match(r"^  (-\w, )?(--[\w-]+)(.*)$", line)
        if m:
            current = m.group(2)
            out[current] = m.group(3)
        elif current and line.startswith("   "):
            out[current] += " " + line.strip()
        else:
            current = None
    return out


# flags whose help says in words what happens without them (no value to show)
UNSET_DEFAULT_OK = {"--advertise-host", "--allow", "--worker-id", "--fleet-secret-file",
                    "--trust-unsigned-hints", "--model-id", "--prefill-chunk", "--worker",
                    "--block-size", "--json"}


@pytest.mark.parametrize("command", [("worker",), ("router",), ("bench", "xfer"), ("demo",),
                                     ("check-endpoint",)],
                         ids=lambda c: " ".join(c))
def test_help_gives_every_flag_a_text_and_a_default(command):
    r = kvkern(*command, "--help")
    assert r.returncode == 0, r.stderr
    assert "SUPPRESS" not in r.stdout and "--debug-" not in r.stdout
    opts = _options(r.stdout)
    opts.pop("--help")
    assert len(opts) >= 5, r.stdout
    for flag, text in opts.items():
        assert re.sub(r"^ \S+", "", text).strip(), f"{flag} has no help text"
        if flag not in UNSET_DEFAULT_OK:
            assert "default" in text, f"{flag} shows no default: {text}"


def test_bench_help_lists_no_internal_subcommand():
    r = kvkern("bench", "--help")
    assert r.returncode == 0
    assert "_peer" not in r.stdout and "SUPPRESS" not in r.stdout


def test_router_prints_the_port_it_listens_on():
    """With --port 0 the start line names the port the OS chose, once it listens."""
    import urllib.request

    proc = subprocess.Popen([sys.executable, "-m", "kvkern", "router", "--worker",
                             "a=http://127.0.0.1:1", "--block-size", "4", "--port", "0",
                             "--refresh-s", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    try:
        line = proc.stdout.readline()
        m = re.match(r"kvkern router on http://127\.0\.0\.1:(\d+) -> a=http://127\.0\.0\.1:1$",
                     line.strip())
        assert m and int(m.group(1)) > 0, line
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(f"http://127.0.0.1:{m.group(1)}/healthz", timeout=10) as r:
            assert r.read() == b"ok"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert proc.returncode == 0, proc.stderr.read()
