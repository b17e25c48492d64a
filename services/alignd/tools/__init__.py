"""alignd/tools."""
