"""Offline validation of the deployment files (compose, Dockerfiles, monitoring)."""
