"""Benchmarks and the fleet-wan link simulator; each script prints a table and writes JSON. By part:
``kernels/`` (kernels and memory), ``pipeline/`` (the pipeline and users), ``wan/`` (the WAN), ``builds/``
(models and builds). What they share with the tests (processes, builds, machine facts, reports) is
``bench/harness.py``, beside the benches' clients, ``--model`` builds, random GGUFs of real shapes and
reference models."""
