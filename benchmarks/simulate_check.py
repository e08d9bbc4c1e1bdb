"""The simulator's step model against measured training steps, on 4 gloo ranks: see
moebalance/lab/bench/simcheck.py.

    python benchmarks/simulate_check.py [--quick]     # same as: moebalance bench simcheck [--quick]
    python benchmarks/simulate_check.py --calibrate   # only measure this machine (calibration.json)
"""

import sys

from moebalance.lab.bench.simcheck import main

if __name__ == "__main__":
    sys.exit(main())
