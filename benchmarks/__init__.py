"""Benchmarks of mig-exporter: run ``python -m benchmarks`` (see benchmarks/run.py)."""
