"""Helpers for the reader.jax tests (the multi-process worker and the toy training step)."""
