"""Modelled step time of every balancing policy on described clusters: ``moebalance simulate``.

    python benchmarks/simulate_bench.py --quick
    python benchmarks/simulate_bench.py --cluster h100-64,h100-a100-64,h100-256,h100-1024
"""

import sys

from moebalance.lab.sim.command import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
