"""Probes: each answers one question about where time or memory goes (bench/README.md lists them)."""
