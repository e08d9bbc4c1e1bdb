#!/usr/bin/env bash
# Set up .venv for moebalance: it sees a torch the user already has (system site packages);
# only where no torch is importable does it install the pinned CPU build (an unpinned torch
# would pull a multi-GB CUDA build). Then installs the package, editable, with the given extras
# (none: "" as the argument), and compiles the Numba kernels once: every part, or those KERNELS
# names (comma separated: planner, rebalance_experts, dispatch, and simulator for the
# simulator's transient copies; the others compile on first use).
# Every step says what it does and how long it took.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
EXTRAS=${1-test}
KERNELS=${KERNELS:-planner,rebalance_experts,dispatch,simulator}
SPEC="."
[ -n "$EXTRAS" ] && SPEC=".[${EXTRAS}]"
START=$(date +%s)
STEP_START=$START

step() {  # step N TEXT: announce a step
    STEP_START=$(date +%s)
    echo "== setup [$1/4] $2"
}

done_step() {  # done_step TEXT: close the step with its time
    echo "== setup: $1 ($(( $(date +%s) - STEP_START )) s)"
}

step 1 "virtual environment .venv (sees the packages of $("$PYTHON" -c 'import sys; print(sys.executable)'))"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv --system-site-packages .venv
    done_step "created .venv"
else
    done_step ".venv already there, reused"
fi

step 2 "torch"
if TORCH=$(.venv/bin/python -c "import torch; print(torch.__version__)" 2>/dev/null); then
    done_step "found torch $TORCH; left as it is"
else
    echo "   no torch importable: installing the CPU build torch==2.13.0 (a 190 MB wheel, 750 MB" \
         "installed)"
    .venv/bin/python -m pip install --progress-bar on "torch==2.13.0"
    done_step "installed torch 2.13.0"
fi

step 3 "moebalance, editable, with extras [${EXTRAS:-none}] (pip lists what it finds and installs)"
.venv/bin/python -m pip install --progress-bar on -e "$SPEC"
done_step "installed moebalance"

step 4 "Numba kernels (${KERNELS}): compile once now (kept in Numba's on-disk cache)"
KERNELS="$KERNELS" .venv/bin/python - <<'PY'
import os
import time

import moebalance
from moebalance.backends import has_numba
from moebalance.warmup import PARTS, jit_counts

start = time.perf_counter()
parts = os.environ["KERNELS"].split(",")
unknown = sorted(set(parts) - {*PARTS, "simulator"})
if unknown:
    raise SystemExit(f"KERNELS names {unknown}: give a comma-separated list of "
                     f"{', '.join(PARTS)} and simulator")
spent = moebalance.warm_up(progress=lambda part: print(f"   {part} kernels ...", flush=True),
                           parts=[p for p in parts if p != "simulator"])
if "simulator" in parts and has_numba():   # a tool's kernel: the library's warm_up leaves it out
    from moebalance.lab.sim import transient

    print("   simulator kernels ...", flush=True)
    begin = time.perf_counter()
    transient.warm_up()
    spent["simulator"] = time.perf_counter() - begin
loaded, compiled = jit_counts()
if not spent:
    print("   numba is not installed: the planner and dispatch run their numpy/torch references")
elif compiled:
    print(f"   compiled the kernels ({', '.join(f'{k} {v:.0f} s' for k, v in spent.items())})")
else:
    print(f"   all kernels were in Numba's cache already: loaded in {time.perf_counter() - start:.1f} s")
PY
done_step "kernels ready"
echo "== setup: finished in $(( $(date +%s) - START )) s"
