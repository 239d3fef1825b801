"""Shared test harness. Runs on a CPU-only machine.

Triton kernels run under the interpreter on CPU: TRITON_INTERPRET must be set before triton
decorates the kernels, so it is set here, before any kvkern kernel module is imported, unless
a GPU is present (then the `gpu` tests run the compiled kernels).
"""

from __future__ import annotations

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Every source, puller and router of the suite (and the peer processes it starts, which
# inherit the environment) belongs to one test fleet; tests of unauthenticated peers pass
# their own credential or none explicitly.
TEST_FLEET_SECRET = "5e" * 32
os.environ.pop("KVKERN_FLEET_SECRET_FILE", None)
os.environ["KVKERN_FLEET_SECRET"] = TEST_FLEET_SECRET

import pytest  # noqa: E402

POISON_BYTE = 0xA5


def poisoned(shape, dtype, device="cpu") -> torch.Tensor:
    """A tensor whose every byte is POISON_BYTE (never a value a copy would produce by chance
    for random data in more than a few bytes)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    t.view(torch.uint8).fill_(POISON_BYTE) if t.numel() else None
    return t


@pytest.fixture
def device() -> str:
    return "cuda" if HAS_CUDA else "cpu"


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (none on this machine)")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
