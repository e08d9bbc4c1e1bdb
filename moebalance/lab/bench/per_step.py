"""Per-step view of the planner benchmark's trace rows.

A placement is planned for the mean load of one window of a recorded router trace; the steps
of the next window then arrive one at a time. Per step and layer this reports the imbalance
with the placement's own shares (static) and with the best re-split of each step's tokens over
the replicas the placement has: a linear program (``scipy.optimize.linprog``, HiGHS) per step
and layer, minimising ``max_g load_g / speed_g``. Layers add up as in DESIGN.md (``sum_l
max_l / sum_l ideal_l``); steps are averaged.

Shapes: T steps, L layers, E experts, S slots, G devices.
"""

from __future__ import annotations

import numpy as np

from ...metrics import summary_imbalance
from ...placement import Placement
from ...topology import Topology


def best_resplit(w_E: np.ndarray, phy2log_S: np.ndarray, topology: Topology
                 ) -> tuple[float, np.ndarray]:
    """The least ``max_g load_g / speed_g`` any split of ``w_E`` over the slots' replicas
    reaches (one layer, one step), and the device loads [G] of that split."""
    from scipy.optimize import linprog

    S, G, E = phy2log_S.shape[0], topology.num_devices, w_E.shape[0]
    if w_E.sum() <= 0:
        return 0.0, np.zeros(G)
    # variables: tokens per slot x[S], then T; minimise T
    cost = np.zeros(S + 1)
    cost[-1] = 1.0
    a_eq = np.zeros((E, S + 1))
    a_eq[phy2log_S, np.arange(S)] = 1.0
    a_ub = np.zeros((G, S + 1))
    a_ub[topology.slot_device, np.arange(S)] = 1.0
    a_ub[:, -1] = -topology.speed
    res = linprog(cost, A_ub=a_ub, b_ub=np.zeros(G), A_eq=a_eq, b_eq=w_E, bounds=(0, None),
                  method="highs")
    if res.status != 0:
        raise RuntimeError(f"per-step re-split LP failed: {res.message}")
    x = res.x[:-1]
    return float(res.x[-1]), np.bincount(topology.slot_device, weights=x, minlength=G)


def per_step_figures(counts_TLE: np.ndarray, placement: Placement, topology: Topology
                     ) -> dict[str, float]:
    """Mean over the steps of ``counts_TLE`` of the summary imbalance with static shares and
    with the best per-step re-split, and the figure for the steps' mean load."""
    static, resplit = [], []
    for step in range(counts_TLE.shape[0]):
        w = counts_TLE[step]
        ideal = (w.sum(axis=1) / topology.speed.sum()).sum()
        if ideal <= 0:
            continue
        static.append(summary_imbalance(w, placement, topology))
        best = sum(best_resplit(w[layer], placement.phy2log[layer], topology)[0]
                   for layer in range(w.shape[0]))
        resplit.append(best / ideal)
    return {"window_mean": summary_imbalance(counts_TLE.mean(axis=0), placement, topology),
            "per_step_static": float(np.mean(static)),
            "per_step_resplit": float(np.mean(resplit)),
            "steps": len(static)}


def optimal_share_figures(loads_LE: np.ndarray, placement: Placement, topology: Topology
                          ) -> tuple[float, float, float]:
    """(summary imbalance, worst layer, mean balancedness) of ``placement``'s replicas with the
    best shares for ``loads_LE`` (EPLB's placement judged with optimal shares)."""
    times, ideals, balanced = [], [], []
    for layer in range(loads_LE.shape[0]):
        t, load = best_resplit(loads_LE[layer], placement.phy2log[layer], topology)
        times.append(t)
        ideals.append(loads_LE[layer].sum() / topology.speed.sum())
        balanced.append(load.mean() / load.max() if load.max() > 0 else 1.0)
    times, ideals = np.array(times), np.array(ideals)
    per_layer = np.where(ideals > 0, times / np.where(ideals > 0, ideals, 1.0), 1.0)
    return float(times.sum() / ideals.sum()), float(per_layer.max()), float(np.mean(balanced))
