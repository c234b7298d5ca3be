"""Tokenizers in the builder: specs resolved and loaded, the fast backends and their conformance guard,
supervised (SFT) records."""
