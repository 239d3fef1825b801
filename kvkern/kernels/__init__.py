"""Triton pack/unpack of paged KV blocks to and from contiguous staging, the pure-torch
reference, and the vectorized CPU path. No networks, hints or requests here."""

from kvkern.kernels.pack import pack, unpack
from kvkern.kernels.reference import reference_pack, reference_unpack

__all__ = ["pack", "unpack", "reference_pack", "reference_unpack"]
