"""Reproducible benchmarks, run by ``moebalance bench``.

- :mod:`moebalance.lab.bench.planner`: ``plan()`` against the EPLB baseline (balance, moves,
  plan time) on the built-in clusters and workloads; the default ``moebalance bench``.
- ``moebalance.lab.bench.dispatch``: the token dispatch path (``moebalance bench dispatch``).
- :mod:`moebalance.lab.report`: the tables and the machine record both share.

Each prints a table and writes ``results.json`` (with the machine, versions and command line),
``summary.md`` and a plot to an output folder.
"""
