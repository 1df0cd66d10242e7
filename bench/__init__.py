"""Benchmarks and the fleet-wan link simulator; each script prints a table and writes JSON."""
