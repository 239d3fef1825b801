"""The transfer path: hints and their dialects, endpoint resolution and the allowlist,
control messages, the UCXX transport, the source service, the destination puller, policies,
the request lifecycle and metrics.

Submodules are imported explicitly (``from kvkern.xfer.hints import ...``); this package
imports nothing heavy on its own so that ``import kvkern`` stays light.
"""
