"""Kernel and end-to-end benchmarks; each that measures prints a table and writes JSON (python -m benchmarks.<name>)."""
