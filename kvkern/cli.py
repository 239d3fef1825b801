"""The ``kvkern`` command line. Each subcommand imports its module only when it runs."""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, function, help). The function takes the remaining argv and returns an
# exit code; each module owns its own argparse so its flags live beside its code.
SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "demo": ("kvkern.tools.demo", "main", "run the demo on the embedded default (CPU, loopback)"),
    "bench": ("kvkern.tools.benchcli", "main", "benchmarks: `kvkern bench xfer`"),
    "check-endpoint": ("kvkern.xfer.endpoint", "check_endpoint_main",
                       "resolve an endpoint and check it against an allowlist"),
    "worker": ("kvkern.serve.worker", "main", "run one worker (model, pool, source, puller)"),
    "router": ("kvkern.serve.router", "main", "run the KV-aware router"),
    "secret": ("kvkern.xfer.auth", "secret_main", "print a fresh fleet secret (SECURITY.md)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="kvkern", description=__doc__)
    parser.add_argument("command", choices=sorted(SUBCOMMANDS), help="subcommand")
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        for name, (_, _, text) in sorted(SUBCOMMANDS.items()):
            print(f"  {name:16s} {text}")
        return 0 if argv else 2
    ns = parser.parse_args(argv[:1])
    module, func, _ = SUBCOMMANDS[ns.command]
    try:
        entry = getattr(importlib.import_module(module), func)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("kvkern"):
            print(f"kvkern {ns.command}: not available in this build ({exc.name})", file=sys.stderr)
            return 2
        raise
    return int(entry(argv[1:]) or 0)
