"""Transient replicas: for one step, a hot expert's weights copied to a cold device's spare slot.

FineMoE-style: each step, an expert whose tokens make one device the slowest gets a copy of its
WEIGHTS (not its optimizer state) on a cold device that has a free *transient slot*; that copy
serves part of the expert's tokens in this step (the per-step re-split now counts it as one more
replica), its gradient is reduced back to the owner in backward, and the owner's optimizer update
is unchanged. The copy is gone after the step.

**The greedy rule** (:func:`transient_choose`, per layer and step, on a guide's counts ``w_E``):
re-split ``w_E`` over the placement's replicas (:func:`~moebalance.dispatch.resplit_kernel.
resplit_layer`, sweeps then the exact flow); then repeatedly

1. take the slowest device ``h`` (largest load / speed) and its heaviest piece, expert ``e``;
2. two targets for a copy of ``e``: the coolest device with a free transient slot on a node
   that holds ``e`` (the copy crosses NVLink only) and the coolest such device anywhere (the
   copy may cross the network); neither may hold ``e`` already. A copy costs the links the
   weights' bytes in forward and the gradient's (the same bytes) back in backward:
   ``2 * bytes / bandwidth``, the slower end's bandwidth of the link class;
3. try them in the order of an estimate: ``h`` and the target alone evening out their times
   (at most the piece moving), the drop of ``h``'s expert seconds less the copy's cost;
4. a try re-splits ``w_E`` with the copy as one more replica (from the split so far, the copy
   starting with no share); keep the first copy whose slowest device's expert seconds drop by
   more than it costs (no re-split where its lower bound,
   :func:`~moebalance.dispatch.resplit_kernel.resplit_bound`, already says it cannot);
   stop when neither does.

The copy comes from a holder of ``e`` on the target's node when there is one, else from ``h``.
An expert takes at most :data:`MAX_COPIES` transient copies a step (the scratch table's width).

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

from ...dispatch.resplit_kernel import (
    RESPLIT_SWEEPS,
    resplit_bound,
    resplit_columns,
    resplit_layer,
    resplit_order,
)
from ...planner._jit import kernel

__all__ = ["MAX_COPIES", "GUIDES", "transient_choose", "transient_loads", "link_seconds"]

# Transient copies one expert may take in one step (columns added to the replica table).
MAX_COPIES = 16

# Counts the copies are chosen on: the previous step's (made ahead) or this step's.
GUIDES = ("previous", "current")


@kernel
def _hottest(load_G, speed_G):
    """(device, time) of the largest load / speed."""
    best = 0
    top = load_G[0] / speed_G[0]
    for g in range(1, load_G.shape[0]):
        v = load_G[g] / speed_G[g]
        if v > top:
            top = v
            best = g
    return best, top


@kernel
def _slowest_time(load_G, speed_G):
    return _hottest(load_G, speed_G)[1]


@kernel
def _source(e, c, h, device_EX, n, node_G):
    """The device a copy of expert ``e`` to ``c`` comes from: its first holder on ``c``'s node
    among its ``n`` replicas, else ``h`` (the slowest device, which holds it)."""
    for j in range(n):
        if node_G[device_EX[e, j]] == node_G[c]:
            return device_EX[e, j]
    return h


@kernel
def _resplit_into(w_E, device_EX, start_EX, speed_G, share_EX, load_G):
    """Re-split ``w_E`` over ``device_EX`` from the shares ``start_EX`` (0 for a replica without
    one); share_EX and load_G are written. Runs on the table's used columns only (the
    re-split's cost grows with X)."""
    E, X = device_EX.shape
    width = 1
    for e in range(E):
        for j in range(width, X):
            if device_EX[e, j] < 0:
                break
            width = j + 1
    used_EX = np.ascontiguousarray(device_EX[:, :width])
    split_EX = np.ascontiguousarray(start_EX[:, :width])
    order_V, _ = resplit_order(used_EX, speed_G.shape[0])
    resplit_layer(w_E, used_EX, speed_G, order_V, split_EX, load_G, RESPLIT_SWEEPS, True)
    share_EX[:, :width] = split_EX
    share_EX[:, width:] = 0.0


@kernel
def transient_choose(w_E, device_EX, start_EX, devices_G5, unit, copy_bytes, load_G):
    """Copies for one layer and step by the module docstring's greedy rule, on counts ``w_E``.

    Args:
        w_E: [E] float64, the guide's tokens (pairs) of each expert.
        device_EX: [E, X] int64, device of each replica (-1 padded); X must leave
            :data:`MAX_COPIES` free columns after the placement's replicas.
        start_EX: [E, X] float64, the placement's shares (0 padded).
        devices_G5: [G, 5] float64, per device: speed, node, transient slots, intra-node and
            network bandwidth (bytes/s).
        unit: seconds of expert work per unit of load / speed (flops per pair over the speed-1
            device's FLOP/s).
        copy_bytes: bytes of one expert's weights (and of its gradient).
        load_G: [G] float64, out: the loads of ``w_E`` re-split with the copies.

    Returns:
        copies_C3: [C, 3] int64, (expert, source device, target device) of every copy, in the
        order chosen. device_EX holds the copies on return (their shares in ``start_EX`` are
        the padding's 0: the re-split fills them).
    """
    E, X = device_EX.shape
    G = devices_G5.shape[0]
    speed_G = np.ascontiguousarray(devices_G5[:, 0])
    node_G = devices_G5[:, 1]
    free_G = devices_G5[:, 2].copy()
    share_EX = np.empty_like(start_EX)
    trial_EX = np.empty_like(start_EX)
    trial_G = np.empty(G, dtype=np.float64)
    count_E = np.zeros(E, dtype=np.int64)
    for e in range(E):
        for j in range(X):
            if device_EX[e, j] >= 0:
                count_E[e] += 1
    limit_E = count_E + MAX_COPIES
    copies = np.empty((int(free_G.sum()), 3), dtype=np.int64)
    made = 0
    _resplit_into(w_E, device_EX, start_EX, speed_G, share_EX, load_G)
    holds_G = np.zeros(G, dtype=np.bool_)
    near_G = np.zeros(G, dtype=np.bool_)
    while made < copies.shape[0]:
        h, now = _hottest(load_G, speed_G)
        # the heaviest piece on the slowest device
        e = -1
        piece = 0.0
        for f in range(E):
            for j in range(count_E[f]):
                if device_EX[f, j] == h and w_E[f] * share_EX[f, j] > piece:
                    piece = w_E[f] * share_EX[f, j]
                    e = f
        if e < 0 or count_E[e] >= limit_E[e]:
            break
        holds_G[:] = False
        near_G[:] = False
        for j in range(count_E[e]):
            holds_G[device_EX[e, j]] = True
        for g in range(G):
            if holds_G[g]:
                for d in range(G):
                    if node_G[d] == node_G[g]:
                        near_G[d] = True
        # the coolest free device near a holder, and the coolest free device anywhere
        near = -1
        far = -1
        for g in range(G):
            if free_G[g] < 1 or holds_G[g]:
                continue
            t = load_G[g] / speed_G[g]
            if near_G[g] and (near < 0 or t < load_G[near] / speed_G[near]):
                near = g
            if far < 0 or t < load_G[far] / speed_G[far]:
                far = g
        # targets in the order of a two-device estimate: ``h`` and the target alone evening
        # out (at most the piece moving), less the copy's cost
        target_2 = np.full(2, -1, dtype=np.int64)
        source_2 = np.full(2, -1, dtype=np.int64)
        cost_2 = np.zeros(2)
        guess_2 = np.zeros(2)
        for which in range(2):
            d = near if which == 0 else far
            if d < 0 or (which == 1 and d == near):
                continue
            s = _source(e, d, h, device_EX, count_E[e], node_G)
            k = 3 if node_G[s] == node_G[d] else 4
            target_2[which] = d
            source_2[which] = s
            cost_2[which] = 2.0 * copy_bytes / min(devices_G5[d, k], devices_G5[s, k])
            moved = (load_G[h] * speed_G[d] - load_G[d] * speed_G[h]) / (speed_G[h] + speed_G[d])
            guess_2[which] = min(piece, max(moved, 0.0)) / speed_G[h] * unit - cost_2[which]
        first = 1 if target_2[0] < 0 or (target_2[1] >= 0 and guess_2[1] > guess_2[0]) else 0
        c = -1
        src = -1
        n = count_E[e]
        for which in (first, 1 - first):
            d = target_2[which]
            if d < 0:
                continue
            device_EX[e, n] = d
            # the re-split cannot beat its lower bound: no trial where even that saves too little
            if (now - resplit_bound(w_E, device_EX, speed_G, load_G)) * unit > cost_2[which]:
                _resplit_into(w_E, device_EX, share_EX, speed_G, trial_EX, trial_G)
                if (now - _slowest_time(trial_G, speed_G)) * unit > cost_2[which]:
                    c = d
                    src = source_2[which]
                    break
            device_EX[e, n] = -1
        if c < 0:
            break
        count_E[e] += 1
        free_G[c] -= 1
        copies[made, 0] = e
        copies[made, 1] = src
        copies[made, 2] = c
        made += 1
        share_EX[:] = trial_EX
        load_G[:] = trial_G
    return copies[:made]


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
                                     unit_bytes_2[1], load_G)
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
