"""Helpers for tests, benchmarks and the demo (never imported by library code paths)."""
