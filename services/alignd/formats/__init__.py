"""alignd/formats."""
