"""What the framework loaders (:mod:`reader.jax`, :mod:`reader.torch`) share or keep apart from their
library: torch-free pieces of ``reader.torch`` (its resume state, its DataLoader-worker watch)."""
