"""Other formats in and out: Megatron ``.bin``/``.idx`` and seqax flat-tokens, exported from a cache or
imported into one without re-tokenizing."""
