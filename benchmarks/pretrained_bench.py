"""Peak memory of mb.from_pretrained per rank: see moebalance/lab/bench/pretrained.py.

    python benchmarks/pretrained_bench.py [--quick]  # or: moebalance bench pretrained [--quick]
"""

import sys

from moebalance.lab.bench.pretrained import main

if __name__ == "__main__":
    sys.exit(main())
