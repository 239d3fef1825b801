"""Serving pieces for the worker and the demo: a small paged-KV transformer."""
