"""Per-step re-split benchmark: the same as ``moebalance bench resplit``.

    python benchmarks/resplit_bench.py --quick --out bench-out/resplit
"""

import sys

from moebalance.lab.bench.resplit import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
