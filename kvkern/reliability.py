"""``python -m kvkern.reliability``: the reliability report (:mod:`kvkern.tools.reliability`)."""

from __future__ import annotations

import sys

from kvkern.tools.reliability import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
