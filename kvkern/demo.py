"""``kvkern demo``: until the two-worker demo lands, the kernel demo."""

from __future__ import annotations

from kvkern.kernel_demo import main as kernel_main


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    if "--kernels" in argv:
        argv.remove("--kernels")
    return kernel_main(argv)
