"""``python -m kvkern.benchcli``: the transfer benchmark (:mod:`kvkern.tools.benchcli`)."""

from __future__ import annotations

import sys

from kvkern.tools.benchcli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
