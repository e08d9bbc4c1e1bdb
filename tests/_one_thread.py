"""Imported first by the fork server of the suite's shared ranks (see ``_dist.py``): each rank
runs one thread, and OpenMP must be sized so before torch loads it in the server (ranks forked
from an OpenMP of the default size spin). Set here, not in the pytest process, whose other
threads start commands that read its environment."""

import os

os.environ["OMP_NUM_THREADS"] = "1"
os.environ["NUMBA_NUM_THREADS"] = "1"
