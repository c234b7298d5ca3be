"""Helpers for the reader.torch tests (item comparison, the torch.distributed worker process)."""
