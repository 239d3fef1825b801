"""Real vLLM engines, each in its own OS process (:mod:`tests.vllm.engine`), with the kvkern
connector. Needs vLLM (``make test-vllm`` builds the venv); skipped elsewhere."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is installed by `make test-vllm`")

from tests.vllm.tiny_model import write_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 240.0
ANSWER_TIMEOUT_S = 120.0


class Engine:
    """One engine process; :meth:`ask` sends a command and reads its answer (bounded)."""

    def __init__(self, name: str, model: Path, port: int, log_dir: Path, *extra: str) -> None:
        self.name, self.port = name, port
        self.log_path = log_dir / f"{name}.log"
        env = dict(os.environ, PYTHONPATH=str(ROOT),  # the fleet secret: tests/conftest.py
                   VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS="1")
        self._log = open(self.log_path, "w")  # noqa: SIM115  (the process outlives this call)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.vllm.engine", "--model", str(model),
             "--listen", f"127.0.0.1:{port}", *extra],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
            text=True, cwd=ROOT, env=env, start_new_session=True)
        self.ready: dict | None = None

    def _read(self, timeout: float) -> dict:
        box: list = []
        reader = threading.Thread(target=lambda: box.append(self.proc.stdout.readline()),
                                  daemon=True)
        reader.start()
        reader.join(timeout)
        if not box or not box[0]:
            tail = self.log_path.read_text()[-3000:]
            raise AssertionError(f"engine {self.name} gave no answer in {timeout} s "
                                 f"(exit {self.proc.poll()}); log tail:\n{tail}")
        return json.loads(box[0])

    def wait_ready(self) -> dict:
        if self.ready is None:
            self.ready = self._read(START_TIMEOUT_S)
        return self.ready

    def ask(self, op: str, timeout: float = ANSWER_TIMEOUT_S, **fields) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.proc.stdin.flush()
        answer = self._read(timeout)
        assert "error" not in answer, answer
        return answer

    def generate(self, *requests: dict) -> dict:
        return self.ask("generate", requests=list(requests))["results"]

    def signal(self, sig: int) -> None:
        os.killpg(self.proc.pid, sig)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"op": "quit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                pass
        if self.proc.poll() is None:
            self.signal(signal.SIGKILL)
            self.proc.wait(10)
        self._log.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def engines(tiny_model, tmp_path_factory):
    """Source ``a`` (its pool read one-sided: ``b`` on this host reads it straight into the
    blocks vLLM allocated), destination ``b`` (signed hints only) and ``c`` (a source that
    streams, which the tests may kill), started together."""
    logs = tmp_path_factory.mktemp("vllm-logs")
    extra = {"a": ("--remote-read", "host")}
    made = {name: Engine(name, tiny_model, free_port(), logs, *extra.get(name, ()))
            for name in ("a", "b", "c")}
    try:
        t0 = time.monotonic()
        for e in made.values():
            e.wait_ready()
        print(f"3 engines ready in {time.monotonic() - t0:.1f} s")
        yield made
    finally:
        for e in made.values():
            e.close()
