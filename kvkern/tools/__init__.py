"""The tools around the library: the demo (``kvkern demo``), the kernel demo, the transfer
benchmark (``kvkern bench``) and the reliability report (``python -m kvkern.reliability``).
They use the library's public API; nothing in the library imports them."""
