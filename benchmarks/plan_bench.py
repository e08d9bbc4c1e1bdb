"""Planner benchmark, moebalance vs EPLB: the same as ``moebalance bench``.

    python benchmarks/plan_bench.py --quick --out bench-out
"""

import sys

from moebalance.lab.bench.planner import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
