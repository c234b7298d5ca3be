"""Pure index arithmetic, no I/O: the global chunk order and streams, the shuffle's permutation, document
pieces, best-fit packing and where an example lies in its chunk."""
