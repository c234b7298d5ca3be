"""Pure index arithmetic, no I/O: the global chunk order and streams, the shuffle's permutation, document
pieces and best-fit packing."""
