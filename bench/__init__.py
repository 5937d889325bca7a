"""Benchmarks and trace tooling; each benchmark is `python -m bench.NAME --json`."""
