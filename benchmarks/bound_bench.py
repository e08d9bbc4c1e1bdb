"""The planner against a floor: the same as ``moebalance bench bound``.

    python benchmarks/bound_bench.py --cluster heterogeneous --time-limit 150
"""

import sys

from moebalance.lab.bench.bound import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
