"""Python client of the libalign control API."""

__version__ = "0.1.0"
