"""Step 2, packing: replicas onto devices (heaviest first, to the neediest device), then the
slots packing left free as share-0 valves.

Kernels (:func:`~._jit.kernel`); ``dev`` is the :class:`~.core.Devices` structure. Shapes: E
experts, G devices, S slots (grouped by device).
"""

from __future__ import annotations

import numpy as np

from ._heap import heap_pop, heap_push, heap_replace_top
from ._jit import kernel

# pack_replicas modes, combined with |: PACK_PER_SLOT ranks devices by need per free slot (else
# by need); PACK_DISTINCT never gives a device a second replica of an expert.
PACK_BY_NEED = 0
PACK_PER_SLOT = 1
PACK_DISTINCT = 2


@kernel
def pack_replicas(w, r, dev, phy2log, share, mode):
    """Fill phy2log [S] / share [S] (equal split) with ``r`` [E] replicas of the experts of
    loads ``w`` [E]: heaviest first, each to the device that still needs the most load (with
    ``PACK_PER_SLOT`` in ``mode``: per free slot).

    A device's need is its fair load ``W * speed / sum(speed)`` minus what it holds; dividing by
    its free slots makes devices with few slots and much to carry take the big pieces and
    devices with many slots the small ones. Without ``PACK_PER_SLOT`` on alike devices this is
    EPLB's balanced packing (the lightest device with room). Devices sit in a max-heap on that
    need (ties: lower device id, so replicas of one expert tend to stay on one node). With
    ``PACK_DISTINCT`` a device never takes a second replica of an expert.
    """
    speed, slots, slot_offsets = dev.speed, dev.slots, dev.slot_offsets
    per_slot = (mode & PACK_PER_SLOT) != 0
    distinct = (mode & PACK_DISTINCT) != 0
    E = w.shape[0]
    G = speed.shape[0]
    piece = np.empty(E, dtype=np.float64)
    for e in range(E):
        piece[e] = w[e] / r[e]
    order = np.argsort(-piece, kind="mergesort")
    total_w = w.sum()
    total_speed = speed.sum()
    need = np.empty(G, dtype=np.float64)
    used = np.zeros(G, dtype=np.int64)
    holds = np.zeros((G, E), dtype=np.bool_)
    slot_piece = np.zeros(phy2log.shape[0], dtype=np.float64)
    keys = np.empty(G, dtype=np.float64)
    ids = np.empty(G, dtype=np.int64)
    size = 0
    for g in range(G):
        need[g] = total_w * speed[g] / total_speed
        size = heap_push(keys, ids, size, need[g] / slots[g] if per_slot else need[g], g)
    skipped = np.empty(G, dtype=np.int64)
    for i in range(E):
        e = order[i]
        u = piece[e]
        for _ in range(r[e]):
            # the neediest device that does not hold e yet
            n_skipped = 0
            best = -1
            while size > 0:
                g = ids[0]
                if used[g] >= slots[g]:
                    size = heap_pop(keys, ids, size)  # filled by make_room while in the heap
                elif distinct and holds[g, e]:
                    skipped[n_skipped] = g
                    n_skipped += 1
                    size = heap_pop(keys, ids, size)
                else:
                    best = g
                    break
            if best >= 0:
                s = slot_offsets[best] + used[best]
                used[best] += 1
                if used[best] < slots[best]:
                    heap_replace_top(keys, ids, size, (need[best] - u) / (
                        slots[best] - used[best]) if per_slot else need[best] - u, best)
                else:
                    size = heap_pop(keys, ids, size)
            else:
                best, s = make_room(e, dev, phy2log, slot_piece, used, holds, need)
            for j in range(n_skipped):
                g = skipped[j]
                if used[g] < slots[g]:  # make_room may have filled it
                    size = heap_push(keys, ids, size, need[g] / (slots[g] - used[g])
                                     if per_slot else need[g], g)
            if best < 0:
                # No device can take this replica: drop it; its slot becomes a valve.
                r[e] -= 1
                continue
            phy2log[s] = e
            slot_piece[s] = u
            need[best] -= u
            holds[best, e] = True
    for s in range(phy2log.shape[0]):
        if phy2log[s] >= 0:
            share[s] = 1.0 / r[phy2log[s]]


@kernel
def make_room(e, dev, phy2log, slot_piece, used, holds, need):
    """Every device with a free slot already holds ``e``: move another expert ``f`` from a full
    device ``h`` into such a free slot, freeing a slot on ``h`` for ``e``. Returns (h, slot),
    or (-1, -1) when no such move exists (a device that must hold every expert, say)."""
    slots, slot_offsets = dev.slots, dev.slot_offsets
    G = slots.shape[0]
    for g in range(G):
        if used[g] >= slots[g]:
            continue
        for h in range(G):
            if h == g or holds[h, e]:
                continue
            for s in range(slot_offsets[h], slot_offsets[h] + used[h]):
                f = phy2log[s]
                if holds[g, f]:
                    continue
                free = slot_offsets[g] + used[g]
                used[g] += 1
                phy2log[free] = f
                slot_piece[free] = slot_piece[s]
                need[g] -= slot_piece[s]
                need[h] += slot_piece[s]
                holds[g, f] = True
                holds[h, f] = False
                return h, s
    return -1, -1


@kernel
def add_valves(w, r, dev, phy2log, share):
    """Fill the slots packing left free with extra replicas (share 0 until balanced), each a
    valve through which load can flow from a hot device to a cool one.

    Free slots are filled coolest device first; each takes a replica of a piece on the device
    that is hottest after the valves placed so far, and the load the valve could carry is
    moved in the running estimate, so that later valves serve the next-hottest devices.
    Updates r in place.
    """
    speed, slot_offsets, slot_device = dev.speed, dev.slot_offsets, dev.slot_device
    E = w.shape[0]
    G = speed.shape[0]
    S = phy2log.shape[0]
    est = np.zeros(G, dtype=np.float64)
    free = np.zeros(G, dtype=np.int64)
    holds = np.zeros((G, E), dtype=np.bool_)
    for s in range(S):
        if phy2log[s] >= 0:
            est[slot_device[s]] += w[phy2log[s]] * share[s]
            holds[slot_device[s], phy2log[s]] = True
        else:
            free[slot_device[s]] += 1
    remaining = free.sum()
    while remaining > 0:
        g = -1
        for d in range(G):
            if free[d] > 0 and (g < 0 or est[d] / speed[d] < est[g] / speed[g]):
                g = d
        # the heaviest piece, on the hottest device, of an expert g does not hold yet
        best = -1
        tried = np.zeros(G, dtype=np.bool_)
        for _ in range(G):
            h = -1
            for d in range(G):
                if not tried[d] and d != g and (h < 0 or est[d] / speed[d] > est[h] / speed[h]):
                    h = d
            if h < 0:
                break
            tried[h] = True
            for t in range(slot_offsets[h], slot_offsets[h + 1]):
                e = phy2log[t]
                if e >= 0 and not holds[g, e] and (
                        best < 0 or w[e] * share[t] > w[phy2log[best]] * share[best]):
                    best = t
            if best >= 0:
                break
        slot = slot_offsets[g + 1] - free[g]
        free[g] -= 1
        remaining -= 1
        if best < 0:
            # g already holds every expert that has a piece elsewhere: any expert it lacks
            for e in range(E):
                if not holds[g, e]:
                    phy2log[slot] = e
                    share[slot] = 0.0
                    holds[g, e] = True
                    r[e] += 1
                    break
            continue
        e = phy2log[best]
        h = slot_device[best]
        phy2log[slot] = e
        share[slot] = 0.0
        holds[g, e] = True
        r[e] += 1
        # what this valve could carry: enough to level h and g, at most e's piece on h
        level = (est[h] + est[g]) / (speed[h] + speed[g])
        flow = min(w[e] * share[best], max(0.0, est[h] - level * speed[h]))
        est[h] -= flow
        est[g] += flow
