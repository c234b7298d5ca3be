"""From a step to arrays: the example order's placements, the assembler and its layouts, the batch schema,
prefetch and release of row groups."""
