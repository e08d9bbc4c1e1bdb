"""Live-migration cost in training, on 4 gloo ranks: see moebalance/lab/bench/train.py.

    python benchmarks/train_bench.py [--quick]        # same as: moebalance bench train [--quick]
"""

import sys

from moebalance.lab.bench.train import main

if __name__ == "__main__":
    sys.exit(main())
