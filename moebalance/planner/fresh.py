"""Step 7, the fresh plan: per layer the valve chain, and where no chain is exact the packing of
replica counts with optimal shares and improving moves; the layer keeps the best.

Kernels (:func:`~._jit.kernel`); ``dev`` is the :class:`~.core.Devices` structure. Shapes: E
experts, G devices, S slots (grouped by device), L layers, V reserve rows.
"""

from __future__ import annotations

import numpy as np

from ..topology import Topology
from ._jit import kernel
from .chain import CHAIN_BY_ROOM, CHAIN_BY_ROOM_PER_SLOT, CHAIN_SNAKE, chain_layer, reserves
from .core import EXHAUSTIVE_SIZE, MAX_SWEEPS, devices_of
from .counts import replica_counts
from .improve import improve_layer
from .packing import PACK_DISTINCT, PACK_PER_SLOT, add_valves, pack_replicas
from .shares import balance_shares, device_loads, max_time

# How pack_layer counts replicas: SPLIT_TO_SLOT splits heavy experts until no piece exceeds
# what one slot should carry; SPLIT_WHOLE_DEVICE splits only experts larger than a whole
# device (the rest become valves).
SPLIT_TO_SLOT = 0
SPLIT_WHOLE_DEVICE = 1
# Improving moves a fresh plan makes per layer when the layer is small enough to search
# exhaustively (slots x experts <= EXHAUSTIVE_SIZE).
SMALL_LAYER_MOVES = 16


@kernel
def ties_in_index_order(w, order):
    """Sort each run of equal loads in ``order`` [E] (sorted by load) by expert id, in place."""
    E = order.shape[0]
    start = 0
    while start < E:
        end = start + 1
        while end < E and w[order[end]] == w[order[start]]:
            end += 1
        for a in range(start + 1, end):
            b = a
            while b > start and order[b] < order[b - 1]:
                order[b], order[b - 1] = order[b - 1], order[b]
                b -= 1
        start = end


@kernel
def plan_fresh(loads, order_LE, vol_LE, dev, reserves, improve_moves, max_sweeps):
    """From-scratch placement of every layer: (phy2log [L,S] int64, share [L,S] float64).

    ``order_LE`` [L, E]: each layer's experts by load, heaviest first, in any order among equal
    loads (a fast unstable sort); ties are put in expert order here, so plans never depend on
    how the sort broke them. ``vol_LE`` [L, E]: how much each expert's load moves from step to
    step (the loads themselves when unknown), for the choice of ring valves.

    First the valves of :func:`chain_layer`, for each row of ``reserves`` [V, G] (free slots
    per device) in turn until one is exact: on alike devices the boustrophedon packing, then
    (if that missed) the packing by room; elsewhere the packing by room per free slot. A layer
    no chain balances exactly (too few free slots, or no piece large enough for a deficit)
    also tries the packing of replica counts: split heavy experts until no piece exceeds what
    one slot should carry, and, when devices differ, split only experts larger than a whole
    device and make the rest valves; each then gets optimal shares and up to
    ``improve_moves`` improving moves per layer. The layer keeps whichever finishes earliest.
    """
    speed, slots = dev.speed, dev.slots
    L = loads.shape[0]
    G = speed.shape[0]
    S = dev.slot_device.shape[0]
    phy2log = np.empty((L, S), dtype=np.int64)
    share = np.empty((L, S), dtype=np.float64)
    trial_p = np.empty(S, dtype=np.int64)
    trial_s = np.empty(S, dtype=np.float64)
    total_speed = speed.sum()
    alike = True
    for g in range(1, G):
        if speed[g] != speed[0] or slots[g] != slots[0]:
            alike = False
    exact = 1.0 + 1e-9
    for layer in range(L):
        w = loads[layer]
        total = w.sum()
        order = order_LE[layer]
        ties_in_index_order(w, order)
        best_ratio = np.inf
        for v in range(reserves.shape[0]):
            even = alike
            for g in range(1, G):
                if reserves[v, g] != reserves[v, 0]:
                    even = False
            for attempt in range(2 if even else 1):
                if best_ratio <= exact:
                    break
                if not even:
                    mode = CHAIN_BY_ROOM_PER_SLOT
                elif attempt == 0:
                    mode = CHAIN_SNAKE
                else:
                    mode = CHAIN_BY_ROOM
                ratio = chain_layer(w, order, vol_LE[layer], dev, reserves[v], mode, trial_p,
                                    trial_s)
                if ratio > exact and total > 0.0:
                    load = device_loads(w, dev, trial_p, trial_s)
                    balance_shares(w, dev, trial_p, trial_s, load, max_sweeps)
                    ratio = max_time(load, speed) * total_speed / total
                if ratio < best_ratio:
                    best_ratio = ratio
                    phy2log[layer] = trial_p
                    share[layer] = trial_s
        if best_ratio <= exact:
            continue
        for split in (SPLIT_TO_SLOT, SPLIT_WHOLE_DEVICE):
            if split == SPLIT_WHOLE_DEVICE and alike:
                break
            ratio = pack_layer(w, dev, split, improve_moves, max_sweeps, trial_p, trial_s)
            if ratio < best_ratio:
                best_ratio = ratio
                phy2log[layer] = trial_p
                share[layer] = trial_s
    return phy2log, share


@kernel
def pack_layer(w, dev, split, improve_moves, max_sweeps, out_p, out_s):
    """The packing of replica counts for one layer into ``out_p``/``out_s`` [S]; returns its
    hottest time over the ideal. ``split``: ``SPLIT_TO_SLOT`` or ``SPLIT_WHOLE_DEVICE``.
    Optimal shares, then up to ``improve_moves`` improving moves."""
    speed, slots = dev.speed, dev.slots
    G = speed.shape[0]
    S = dev.slot_device.shape[0]
    total = w.sum()
    total_speed = speed.sum()
    cap = 0.0
    for g in range(G):
        if split == SPLIT_TO_SLOT:
            cap = max(cap, total * speed[g] / total_speed / slots[g])
        else:
            cap = max(cap, total * speed[g] / total_speed)
    r = replica_counts(w, S, G, cap)
    out_p[:] = -1
    pack_replicas(w, r, dev, out_p, out_s, PACK_PER_SLOT | PACK_DISTINCT)
    add_valves(w, r, dev, out_p, out_s)
    load = device_loads(w, dev, out_p, out_s)
    balance_shares(w, dev, out_p, out_s, load, max_sweeps)
    improve_layer(w, dev, out_p, out_s, load, total / total_speed * (1.0 + 1e-6), improve_moves,
                  max_sweeps)
    return max_time(load, speed) * total_speed / total if total > 0.0 else 1.0


@kernel
def plan_packed(loads, dev, split, improve_moves, max_sweeps):
    """:func:`pack_layer` for every layer: (phy2log [L,S], share [L,S])."""
    L = loads.shape[0]
    S = dev.slot_device.shape[0]
    phy2log = np.empty((L, S), dtype=np.int64)
    share = np.empty((L, S), dtype=np.float64)
    for layer in range(L):
        pack_layer(loads[layer], dev, split, improve_moves, max_sweeps, phy2log[layer],
                   share[layer])
    return phy2log, share


def fresh(k, w: np.ndarray, vol: np.ndarray, topology: Topology, polish: int):
    """The fresh plan (phy2log [L, S], share [L, S]) of loads ``w`` [L, E] with the kernels
    ``k``, ring valves chosen by ``vol`` [L, E]; ``polish``: improving moves per large layer."""
    # quicksort: the kernel puts equal loads in expert order, so the sort need not be stable
    order = np.argsort(-w, axis=1, kind="quicksort")
    E = w.shape[1]
    moves = SMALL_LAYER_MOVES if topology.num_slots * E <= EXHAUSTIVE_SIZE else polish
    return k.plan_fresh(w, order, np.ascontiguousarray(vol), devices_of(topology),
                        reserves(topology, E), moves, MAX_SWEEPS)
