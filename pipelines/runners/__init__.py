"""Which Beam runner a build runs on, and local workers forked from a warm process."""
