"""Kernel and end-to-end benchmarks; each prints a table and can write JSON (python -m benchmarks.<name>)."""
