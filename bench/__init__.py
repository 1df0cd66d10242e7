"""Benchmarks and the fleet-wan link simulator; each script prints a table and writes JSON. What they share
with the tests (processes, builds, machine facts, reports) is ``bench/harness.py``."""
