#!/usr/bin/env bash
# Set up .venv for moebalance: it sees a torch the user already has (system site packages);
# only where no torch is importable does it install the pinned CPU build (an unpinned torch
# would pull a multi-GB CUDA build). Then installs the package, editable, with the given extras.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
EXTRAS=${1:-test}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv --system-site-packages .venv
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
    .venv/bin/python -m pip install --quiet "torch==2.13.0"
fi
.venv/bin/python -m pip install --quiet -e ".[${EXTRAS}]"
# Compile the Numba kernels once now (cached on disk), not in the first benchmark or job.
.venv/bin/python -c "import moebalance; moebalance.warm_up()"
