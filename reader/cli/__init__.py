"""``python -m reader``: inspect, validate, batches, report, export and the imports."""
