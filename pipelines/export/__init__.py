"""The Beam export of a cache to Megatron (``python -m pipelines.export``): plan, parts, finalize."""
