"""A wrapped transformers MoE model against one process: see moebalance/lab/bench/wrap.py.

    python benchmarks/wrap_bench.py [--quick]         # same as: moebalance bench wrap [--quick]
"""

import sys

from moebalance.lab.bench.wrap import main

if __name__ == "__main__":
    sys.exit(main())
