"""Dispatch benchmark: the same as ``moebalance bench dispatch``.

    python benchmarks/dispatch_bench.py --quick --out bench-out/dispatch
"""

import sys

from moebalance.lab.bench.dispatch import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
