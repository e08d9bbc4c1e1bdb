"""Transient replicas: for one step, a hot expert's weights copied to a cold device's spare slot.

FineMoE-style: each step, an expert whose tokens make one device the slowest gets a copy of its
WEIGHTS (not its optimizer state) on a cold device that has a free *transient slot*; that copy
serves part of the expert's tokens in this step (the per-step re-split now counts it as one more
replica), its gradient is reduced back to the owner in backward, and the owner's optimizer update
is unchanged. The copy is gone after the step.

The copies are chosen by the library's rule (:func:`moebalance.dispatch.transient.
transient_choose`, the greedy rule of :mod:`moebalance.dispatch.transient`), which the layers
run with ``transient=K``; here it is priced with the cluster's link bandwidths.

**Guides.** The copies of step ``t`` are chosen either on step ``t - 1``'s counts (made ahead,
hidden behind compute; the prediction may miss) or on step ``t``'s own counts (known
once the dispatcher's count exchange is done; the copy then sits on the critical path). Either
way the step's tokens are re-split over the placement plus the copies with step ``t``'s counts.
Adding replicas never raises the re-split's optimum, so a step's slowest device never gets slower.

The step model charges the copies (:meth:`~.stepmodel.StepModel.transient_seconds`).

Legend: T steps, E experts, X replica columns, G devices.
"""

from __future__ import annotations

import numpy as np

from ...backends import has_numba
from ...dispatch.resplit_kernel import resplit_columns
from ...dispatch.transient import MAX_COPIES, _resplit_into, transient_choose
from ...placement import Placement
from ...planner import _jit
from ...planner._jit import kernel

__all__ = ["MAX_COPIES", "GUIDES", "transient_choose", "transient_loads", "link_seconds",
           "warm_up"]

# Counts the copies are chosen on: the previous step's (made ahead) or this step's.
GUIDES = ("previous", "current")


@kernel
def link_seconds(copies_C3, devices_G5, copy_bytes, seconds_G):
    """Adds to ``seconds_G`` [G] each device's transfer time of the copies ``copies_C3``: per
    link class (same node: intra-node bandwidth, else the network) the larger of its in- and
    outgoing bytes over its own bandwidth, summed over the classes."""
    G = devices_G5.shape[0]
    in_2G = np.zeros((2, G), dtype=np.float64)
    out_2G = np.zeros((2, G), dtype=np.float64)
    for i in range(copies_C3.shape[0]):
        src = copies_C3[i, 1]
        dst = copies_C3[i, 2]
        k = 0 if devices_G5[src, 1] == devices_G5[dst, 1] else 1
        in_2G[k, dst] += copy_bytes
        out_2G[k, src] += copy_bytes
    for g in range(G):
        for k in range(2):
            seconds_G[g] += max(in_2G[k, g], out_2G[k, g]) / devices_G5[g, 3 + k]


@kernel
def transient_loads(counts_TE, guide_TE, phy2log_S, share_S, slot_device_S, devices_G5,
                    unit_bytes_2):
    """One layer's device loads and copy seconds at every step with transient copies.

    Args:
        counts_TE: [T, E] float64, each step's tokens per expert (what is re-split).
        guide_TE: [T, E] float64, the counts each step's copies are chosen on (the previous
            step's, or ``counts_TE`` itself).
        phy2log_S, share_S, slot_device_S: the placement's layer (expert, share, device per slot).
        devices_G5: [G, 5] as :func:`transient_choose` takes it.
        unit_bytes_2: [2] (seconds per unit of load / speed, bytes of one expert's weights).

    Returns:
        load_TG: [T, G] loads after the re-split over the placement plus the step's copies.
        seconds_TG: [T, G] each device's transfer time of the step's weight copies (the
            gradient's reduce back moves the same bytes the other way: the same time).
        copies_T: [T] int64 copies made at every step.
    """
    T, E = counts_TE.shape
    G = devices_G5.shape[0]
    speed_G = np.ascontiguousarray(devices_G5[:, 0])
    placed_EX, placed_share_EX = resplit_columns(phy2log_S, slot_device_S, share_S, E)
    X = placed_EX.shape[1] + MAX_COPIES        # room for the copies
    base_EX = np.full((E, X), -1, dtype=np.int64)
    start_EX = np.zeros((E, X), dtype=np.float64)
    base_EX[:, :placed_EX.shape[1]] = placed_EX
    start_EX[:, :placed_EX.shape[1]] = placed_share_EX
    load_TG = np.zeros((T, G), dtype=np.float64)
    seconds_TG = np.zeros((T, G), dtype=np.float64)
    copies_T = np.zeros(T, dtype=np.int64)
    device_EX = np.empty_like(base_EX)
    share_EX = np.empty_like(start_EX)
    w_E = np.empty(E, dtype=np.float64)
    guide_E = np.empty(E, dtype=np.float64)
    load_G = np.empty(G, dtype=np.float64)
    for t in range(T):
        for e in range(E):
            w_E[e] = counts_TE[t, e]
            guide_E[e] = guide_TE[t, e]
        device_EX[:] = base_EX
        copies_C3 = transient_choose(guide_E, device_EX, start_EX, devices_G5, unit_bytes_2[0],
                                     unit_bytes_2[1], share_EX, load_G)
        same = True
        for e in range(E):
            if w_E[e] != guide_E[e]:
                same = False
                break
        if not same:          # chosen on another step's counts: this step's re-split
            _resplit_into(w_E, device_EX, start_EX, speed_G, share_EX, load_G)
        load_TG[t] = load_G
        copies_T[t] = copies_C3.shape[0]
        link_seconds(copies_C3, devices_G5, unit_bytes_2[1], seconds_TG[t])
    return load_TG, seconds_TG, copies_T


def warm_up() -> None:
    """Compile :func:`transient_loads` (``moebalance simulate --transient``) now, or load it from
    Numba's on-disk cache, with the array kinds the simulator hands it: a placement's rows are
    read-only, which Numba compiles apart from writable ones. Set-up calls it; without Numba
    it does nothing."""
    if not has_numba():
        return
    placement = Placement(np.array([[0, 1, 0]]), np.array([[0.5, 1.0, 0.5]]), np.array([0, 1, 1]),
                          num_experts=2)
    counts = np.array([[300.0, 100.0]])
    devices_G5 = np.array([[1.0, 0.0, 1.0, 1e12, 1e11]] * 2)
    _jit.kernels("numba").transient_loads(counts, counts.copy(), placement.phy2log[0],
                                          placement.share[0], placement.slot_device, devices_G5,
                                          np.array([1e-3, 1e9]))
