"""Conformance matrix (issue #11): FSDP2 ``prepare`` with the plugin vs stock accelerate, across architecture
families and settings. ``python -m tests.conformance --help``; the reduced set runs under pytest."""
