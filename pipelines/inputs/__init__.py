"""Input files: matching and checking them, their (decompressed) bytes and lines, Cloud Storage checks."""
