"""chunkledger pipelines: the Beam cache builder."""
