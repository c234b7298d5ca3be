"""Inputs to chunks on the workers: the Beam transforms, one work unit, one chunk, split routing."""
