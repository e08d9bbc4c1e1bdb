"""The tools, never imported by the library: benchmarks (``bench/``), the simulator (``sim/``),
the workloads and models they run, and on this floor what both share (report, EPLB's reference)."""
