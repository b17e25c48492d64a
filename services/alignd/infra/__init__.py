"""Pieces every service shares: settings, wire schemas, Redis bus and stores, telemetry."""
