"""Weighted mixtures of caches: the mixture file, the quota arithmetic, and the components behind the
single-cache interfaces."""
