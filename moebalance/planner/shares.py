"""Step 3, token shares: device loads of a placement and the water filling that re-splits every
replicated expert's tokens so its devices finish together; the per-step forms of both.

Kernels (:func:`~._jit.kernel`); ``dev`` is the :class:`~.core.Devices` structure. Shapes: T
steps, E experts, G devices, S slots (grouped by device), L layers.
"""

from __future__ import annotations

import numpy as np

from ..topology import Topology
from ._jit import kernel
from .core import EXHAUSTIVE_SIZE

# Share sweeps stop when no device load changes by more than this fraction of the mean load.
SWEEP_TOL = 1e-7


@kernel
def expert_slots(phy2log, num_experts):
    """CSR of each expert's slots: (starts [E+1], slot ids [S]) in slot order."""
    S = phy2log.shape[0]
    starts = np.zeros(num_experts + 1, dtype=np.int64)
    for s in range(S):
        starts[phy2log[s] + 1] += 1
    for e in range(num_experts):
        starts[e + 1] += starts[e]
    fill = starts[:-1].copy()
    members = np.empty(S, dtype=np.int64)
    for s in range(S):
        e = phy2log[s]
        members[fill[e]] = s
        fill[e] += 1
    return starts, members


@kernel
def device_loads(w, dev, phy2log, share):
    """[G] tokens of each device: every slot's piece ``w[phy2log[s]] * share[s]``."""
    slot_device = dev.slot_device
    load = np.zeros(dev.speed.shape[0], dtype=np.float64)
    for s in range(phy2log.shape[0]):
        load[slot_device[s]] += w[phy2log[s]] * share[s]
    return load


@kernel
def balance_shares(w, dev, phy2log, share, load, max_sweeps):
    """Re-split the tokens of every replicated expert so its devices finish together.

    Updates ``share`` [S] and ``load`` [G] in place (load must match share on entry). Small
    layers (cheap, and where extreme speed ratios converge slowly) get 16x the sweeps.
    """
    starts, members = expert_slots(phy2log, w.shape[0])
    water_fill(w, dev, starts, members, share, load, max_sweeps)


@kernel
def water_fill(w, dev, starts, members, share, load, max_sweeps):
    """:func:`balance_shares` on the placement's CSR of each expert's slots (``starts`` [E+1],
    ``members`` [S], from :func:`expert_slots`), which callers re-splitting one placement for
    many steps build once."""
    speed, slot_device = dev.speed, dev.slot_device
    E = w.shape[0]
    G = speed.shape[0]
    valves = np.empty(E, dtype=np.int64)
    n_valves = 0
    max_rep = 1
    total = 0.0
    for e in range(E):
        n = starts[e + 1] - starts[e]
        max_rep = max(max_rep, n)
        total += w[e]
        if n >= 2 and w[e] > 0.0:
            valves[n_valves] = e
            n_valves += 1
    if n_valves == 0 or total <= 0.0:
        return
    if members.shape[0] * E <= EXHAUSTIVE_SIZE:
        max_sweeps *= 16
    tol = SWEEP_TOL * total / G
    base = np.empty(max_rep, dtype=np.float64)
    rate = np.empty(max_rep, dtype=np.float64)
    level = np.empty(max_rep, dtype=np.float64)
    order = np.empty(max_rep, dtype=np.int64)
    for _ in range(max_sweeps):
        biggest_change = 0.0
        for v in range(n_valves):
            e = valves[v]
            n = starts[e + 1] - starts[e]
            if n == 2:
                # the same arithmetic, unrolled: about half the valves of a re-planned layer
                # have two replicas (a repair move adds one), and the repair re-balances after
                # each of its steps (RESULTS.md, "Re-plans within 50 ms")
                change = pair_fill(w[e], members[starts[e]], members[starts[e] + 1], speed,
                                   slot_device, share, load)
                if change > biggest_change:
                    biggest_change = change
                continue
            for j in range(n):
                s = members[starts[e] + j]
                g = slot_device[s]
                base[j] = load[g] - w[e] * share[s]
                rate[j] = speed[g]
                level[j] = base[j] / rate[j]
                order[j] = j
            # insertion sort by finishing time without this expert (n is small)
            for a in range(1, n):
                b = a
                while b > 0 and level[order[b]] < level[order[b - 1]]:
                    order[b], order[b - 1] = order[b - 1], order[b]
                    b -= 1
            # water level: the k coolest devices rise to a common time lam
            acc_load = w[e]
            acc_rate = 0.0
            lam = 0.0
            for k in range(n):
                j = order[k]
                acc_load += base[j]
                acc_rate += rate[j]
                lam = acc_load / acc_rate
                if k + 1 == n or lam <= level[order[k + 1]]:
                    break
            placed = 0.0
            for j in range(n):
                x = lam * rate[j] - base[j]
                if x < 0.0:
                    x = 0.0
                level[j] = x  # reuse as the new piece
                placed += x
            for j in range(n):
                s = members[starts[e] + j]
                g = slot_device[s]
                new_share = level[j] / placed
                new_piece = w[e] * new_share
                change = abs(new_piece - w[e] * share[s])
                if change > biggest_change:
                    biggest_change = change
                share[s] = new_share
                load[g] = base[j] + new_piece
        if biggest_change <= tol:
            break


@kernel
def pair_fill(we, s0, s1, speed, slot_device, share, load):
    """:func:`water_fill`'s step for an expert of ``we`` tokens on two slots: the same
    operations in the same order, so the same floats. Returns the larger change of a piece."""
    g0 = slot_device[s0]
    g1 = slot_device[s1]
    base0 = load[g0] - we * share[s0]
    base1 = load[g1] - we * share[s1]
    rate0 = speed[g0]
    rate1 = speed[g1]
    # the cooler device first (the earlier on a tie); lam: the level both reach, unless the
    # cooler one alone takes every token below the other's level
    if base1 / rate1 < base0 / rate0:
        lam = (we + base1) / rate1
        if not lam <= base0 / rate0:
            lam = (we + base1 + base0) / (rate1 + rate0)
    else:
        lam = (we + base0) / rate0
        if not lam <= base1 / rate1:
            lam = (we + base0 + base1) / (rate0 + rate1)
    x0 = lam * rate0 - base0
    if x0 < 0.0:
        x0 = 0.0
    x1 = lam * rate1 - base1
    if x1 < 0.0:
        x1 = 0.0
    placed = 0.0 + x0 + x1
    new0 = we * (x0 / placed)
    new1 = we * (x1 / placed)
    change = abs(new0 - we * share[s0])
    change1 = abs(new1 - we * share[s1])
    if change1 > change:
        change = change1
    share[s0] = x0 / placed
    load[g0] = base0 + new0
    share[s1] = x1 / placed
    load[g1] = base1 + new1
    return change


@kernel
def hottest(load, speed):
    best = 0
    for g in range(1, load.shape[0]):
        if load[g] / speed[g] > load[best] / speed[best]:
            best = g
    return best


@kernel
def max_time(load, speed):
    return load[hottest(load, speed)] / speed[hottest(load, speed)]


@kernel
def step_times(counts_TLE, dev, phy2log, share, max_sweeps):
    """[L]: mean over the steps of ``counts_TLE`` [T, L, E] of each layer's hottest time when
    each step's tokens are re-split over the placement's replicas (water filling from the
    placement's shares), the figure a spread-aware plan minimises."""
    T, L = counts_TLE.shape[0], counts_TLE.shape[1]
    speed = dev.speed
    out = np.zeros(L, dtype=np.float64)
    trial = np.empty(share.shape[1], dtype=np.float64)
    for layer in range(L):
        starts, members = expert_slots(phy2log[layer], counts_TLE.shape[2])
        for t in range(T):
            w = counts_TLE[t, layer]
            trial[:] = share[layer]
            load = device_loads(w, dev, phy2log[layer], trial)
            water_fill(w, dev, starts, members, trial, load, max_sweeps)
            out[layer] += max_time(load, speed)
        out[layer] /= T
    return out


@kernel
def resplit_device_loads(counts_TE, dev, phy2log, share, max_sweeps):
    """[T, G] device loads of one layer at every step of ``counts_TE`` when each step's tokens
    are re-split over the placement's replicas (water filling from its shares, as the
    dispatcher's per-step re-split does)."""
    T = counts_TE.shape[0]
    G = dev.speed.shape[0]
    out = np.zeros((T, G), dtype=np.float64)
    trial = np.empty(share.shape[0], dtype=np.float64)
    starts, members = expert_slots(phy2log, counts_TE.shape[1])
    for t in range(T):
        w = counts_TE[t]
        trial[:] = share
        load = device_loads(w, dev, phy2log, trial)
        water_fill(w, dev, starts, members, trial, load, max_sweeps)
        out[t] = load
    return out


def max_times(w, phy2log, share, topology: Topology) -> np.ndarray:
    """[L] hottest device time of each layer of loads ``w`` [L, E] under ``phy2log`` /
    ``share`` [L, S] (numpy, all layers at once)."""
    slot_load = np.take_along_axis(w, phy2log, axis=1) * share
    G = topology.num_devices
    loads = np.zeros((w.shape[0], G))
    for layer in range(w.shape[0]):
        loads[layer] = np.bincount(topology.slot_device, weights=slot_load[layer], minlength=G)
    return (loads / topology.speed).max(axis=1)
