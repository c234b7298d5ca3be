"""``python -m reader report``: a cache or a mixture as one self-contained HTML page."""
