"""Weighted mixtures of caches: the mixture file, the mixing arithmetic, and the components behind the
single-cache interfaces."""
