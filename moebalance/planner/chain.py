"""Step 4, the valve chain: whole experts, then valves in the free slots that bring every device
to its ideal load exactly (a ring of valves, else a north-west-corner chain).

Kernels (:func:`~._jit.kernel`); ``dev`` is the :class:`~.core.Devices` structure. Shapes: E
experts, G devices, S slots (grouped by device), V reserve rows.
"""

from __future__ import annotations

import numpy as np

from ..topology import Topology
from ._heap import heap_pop, heap_push, heap_replace_top
from ._jit import kernel

# How chain_layer places the whole experts: CHAIN_SNAKE in boustrophedon device order (alike
# devices), CHAIN_BY_ROOM to the device with the most room below its ideal load, and
# CHAIN_BY_ROOM_PER_SLOT to the one with the most such room per free slot.
CHAIN_SNAKE = 0
CHAIN_BY_ROOM = 1
CHAIN_BY_ROOM_PER_SLOT = 2


@kernel
def chain_layer(w, order, vol, dev, reserve, mode, phy2log, share):
    """Fresh plan of one layer that reaches every device's ideal load exactly when it can.

    1. Whole experts, heaviest first (``order``), keeping ``reserve[g]`` slots of device ``g``
       free, placed as ``mode`` says (``CHAIN_SNAKE``, ``CHAIN_BY_ROOM``,
       ``CHAIN_BY_ROOM_PER_SLOT``).
    2. Valves, in the free slots, to reach every ideal load exactly. With a free slot on every
       device, :func:`ring_valves` (McNaughton's wrap-around, closed into a ring with
       mid-range valves). Otherwise the valve chain: every device below its ideal load
       takes a replica of the largest piece of a device above it, carrying its deficit
       (north-west-corner order: the sender with the most excess first; several pieces while
       it has several free slots). A sender that gives more than its excess turns receiver and
       takes its deficit the same way from the next sender, so every transfer settles one
       device: at most G - 1 valves.
    3. Slots still free hold share-0 valves (:func:`finish_chain`).

    Fills ``phy2log`` [S] and ``share`` [S]; returns the largest device time over ideal time
    (1.0: exact). Needs ``sum(slots - reserve) >= E``.
    """
    slots, slot_offsets = dev.slots, dev.slot_offsets
    per_slot = mode == CHAIN_BY_ROOM_PER_SLOT
    E = w.shape[0]
    G = slots.shape[0]
    S = phy2log.shape[0]
    total, cap = ideal_loads(w, dev.speed)
    load = np.zeros(G, dtype=np.float64)
    used = np.zeros(G, dtype=np.int64)
    amount = np.zeros(S, dtype=np.float64)
    if mode == CHAIN_SNAKE:
        # alike devices: heaviest first in boustrophedon order, 0..G-1 then G-1..0, ...: the
        # LPT packing's choice without its heap (the valves even out the rest)
        for i in range(E):
            e = order[i]
            lap = i // G
            g = i - lap * G
            if lap % 2 == 1:
                g = G - 1 - g
            s = slot_offsets[g] + used[g]
            phy2log[s] = e
            amount[s] = w[e]
            used[g] += 1
            load[g] += w[e]
    else:
        # whole experts; a max-heap of devices on room (per free whole slot)
        keys = np.empty(G, dtype=np.float64)
        ids = np.empty(G, dtype=np.int64)
        size = 0
        for g in range(G):
            if slots[g] - reserve[g] > 0:
                size = heap_push(keys, ids, size,
                                 cap[g] / (slots[g] - reserve[g]) if per_slot else cap[g], g)
        for i in range(E):
            e = order[i]
            g = ids[0]
            s = slot_offsets[g] + used[g]
            phy2log[s] = e
            amount[s] = w[e]
            used[g] += 1
            load[g] += w[e]
            left = slots[g] - reserve[g] - used[g]
            if left > 0:
                heap_replace_top(keys, ids, size,
                                 (cap[g] - load[g]) / left if per_slot else cap[g] - load[g], g)
            else:
                size = heap_pop(keys, ids, size)
    tiny = 1e-12 * total
    if ring_valves(vol, dev, used, phy2log, amount, load, cap):
        return finish_chain(w, order, dev, used, phy2log, amount, share)
    # step 2: the chain. Senders by excess, largest first; receivers in a queue.
    excess = np.empty(G, dtype=np.float64)
    for g in range(G):
        excess[g] = load[g] - cap[g]
    senders = np.argsort(-excess, kind="mergesort")
    queue = np.empty(2 * G, dtype=np.int64)
    n_send = 0
    head = 0
    tail = 0
    for i in range(G):
        if excess[senders[i]] > tiny:
            n_send += 1
    for i in range(G - 1, -1, -1):
        g = senders[i]
        if excess[g] >= -tiny:
            break
        queue[tail] = g
        tail += 1
    queued = np.zeros(G, dtype=np.bool_)
    for i in range(tail):
        queued[queue[i]] = True
    cur = 0
    while head < tail:
        d = queue[head]
        head += 1
        while -excess[d] > tiny and used[d] < slots[d]:
            need = -excess[d]
            last = used[d] + 1 == slots[d]
            while cur < n_send and excess[senders[cur]] <= tiny:
                cur += 1
            # the first sender with excess left whose largest piece d lacks can carry the whole
            # deficit (any piece will do while d has more than one free slot); failing that,
            # the largest such piece anywhere
            pick = -1
            src = -1
            spare_pick = -1
            spare_src = -1
            for j in range(cur, n_send):
                h = senders[j]
                if excess[h] <= tiny:
                    continue
                best = -1
                for t in range(slot_offsets[h], slot_offsets[h] + used[h]):
                    if amount[t] > 0.0 and (best < 0 or amount[t] > amount[best]) and not \
                            holds_expert(phy2log, slot_offsets[d], slot_offsets[d] + used[d],
                                         phy2log[t]):
                        best = t
                if best < 0:
                    continue
                if not last or amount[best] >= need * (1.0 - 1e-12):
                    pick = h
                    src = best
                    break
                if spare_src < 0 or amount[best] > amount[spare_src]:
                    spare_pick = h
                    spare_src = best
            if pick < 0:
                pick = spare_pick
                src = spare_src
            if pick < 0:
                break  # nothing can reach d: it stays short
            give = min(need, amount[src])
            if used[pick] >= slots[pick]:
                give = min(give, excess[pick])  # a full sender could not take load back
            s = slot_offsets[d] + used[d]
            used[d] += 1
            phy2log[s] = phy2log[src]
            amount[s] = give
            amount[src] -= give
            load[d] += give
            load[pick] -= give
            excess[d] += give
            excess[pick] -= give
            if excess[pick] < -tiny and not queued[pick]:
                queue[tail] = pick  # gave more than its excess: it takes the rest from the next
                tail += 1
                queued[pick] = True
    return finish_chain(w, order, dev, used, phy2log, amount, share)


@kernel
def ring_valves(vol, dev, used, phy2log, amount, load, cap):
    """The valve chain closed into a ring: along a cyclic order of the devices, each device
    gives the next a replica of its largest piece carrying ``a_{k+1} = a_0 + sum_{i<=k} b_i``
    (``b = load - cap``, in ring order), so every device ends at its ideal load. The ring
    alternates devices above and below their ideal (largest first), which keeps the partial
    sums small, and the free circulation ``a_0`` puts every valve as far from share 0 and
    share 1 as the pieces allow: after a drift, a re-split moves load through every valve
    either way, around the ring both ways.

    Each device's valve is its piece of the largest ``vol`` [E] among its pieces of at least
    half its largest (``vol``: loads, or the per-step spread of the loads, so the re-split of
    every step can move a volatile expert's tokens between two devices). Needs a free slot on
    every device; returns False (nothing changed) when some device has none or no ``a_0`` keeps
    every valve strictly inside its piece.
    """
    slots, slot_offsets = dev.slots, dev.slot_offsets
    G = cap.shape[0]
    if G < 2:
        return False
    big = np.empty(G, dtype=np.int64)
    b = np.empty(G, dtype=np.float64)
    for g in range(G):
        if used[g] == 0 or used[g] >= slots[g]:
            return False
        largest = 0.0
        for t in range(slot_offsets[g], slot_offsets[g] + used[g]):
            largest = max(largest, amount[t])
        # the valve: the most volatile expert among the device's pieces of at least half its
        # largest (with vol = loads: the largest piece)
        big[g] = -1
        for t in range(slot_offsets[g], slot_offsets[g] + used[g]):
            if amount[t] >= 0.5 * largest and (
                    big[g] < 0 or vol[phy2log[t]] > vol[phy2log[big[g]]]):
                big[g] = t
        b[g] = load[g] - cap[g]
    by_b = np.argsort(b, kind="mergesort")  # most below first ... most above last
    ring = np.empty(G, dtype=np.int64)
    low = 0
    high = G - 1
    prefix = 0.0
    for k in range(G):
        if prefix > 0.0:
            g = by_b[low]
            low += 1
        else:
            g = by_b[high]
            high -= 1
        ring[k] = g
        prefix += b[g]
    lo = -np.inf
    hi = np.inf
    prefix = 0.0
    for k in range(G):
        g = ring[k]
        prefix += b[g]
        lo = max(lo, -prefix)
        hi = min(hi, amount[big[g]] - prefix)
    if not lo < hi:
        return False
    a0 = 0.5 * (lo + hi)
    prefix = 0.0
    for k in range(G):
        g = ring[k]
        prefix += b[g]
        flow = a0 + prefix
        d = ring[k + 1] if k + 1 < G else ring[0]
        s = slot_offsets[d] + used[d]
        used[d] += 1
        phy2log[s] = phy2log[big[g]]
        amount[s] = flow
        amount[big[g]] -= flow
    return True


@kernel
def finish_chain(w, order, dev, used, phy2log, amount, share):
    """Last step of :func:`chain_layer`: share-0 valves in the slots still free, shares from
    the amounts, and the largest device load over its ideal load (1.0 for an exact plan, or
    for a layer without load)."""
    slots, slot_offsets, slot_device = dev.slots, dev.slot_offsets, dev.slot_device
    total, cap = ideal_loads(w, dev.speed)
    E = w.shape[0]
    G = cap.shape[0]
    S = phy2log.shape[0]
    for g in range(G):
        lo = slot_offsets[g]
        nxt = g + 1 if g + 1 < G else 0
        while used[g] < slots[g]:
            # the largest piece of the next device that g lacks (valves between neighbours
            # spread over many experts), else the heaviest expert g lacks
            pick = -1
            for t in range(slot_offsets[nxt], slot_offsets[nxt] + used[nxt]):
                if (pick < 0 or amount[t] > amount[pick]) and not holds_expert(
                        phy2log, lo, lo + used[g], phy2log[t]):
                    pick = t
            if pick >= 0 and nxt != g:
                e = phy2log[pick]
            else:
                e = -1
                for i in range(E):
                    if not holds_expert(phy2log, lo, lo + used[g], order[i]):
                        e = order[i]
                        break
            phy2log[lo + used[g]] = e
            amount[lo + used[g]] = 0.0
            used[g] += 1
    # an expert without load keeps all of it on its first slot
    seen = np.zeros(E, dtype=np.bool_)
    load = np.zeros(G, dtype=np.float64)
    for s in range(S):
        e = phy2log[s]
        if w[e] > 0.0:
            share[s] = amount[s] / w[e]
        else:
            share[s] = 0.0 if seen[e] else 1.0
        seen[e] = True
        load[slot_device[s]] += amount[s]
    if total <= 0.0:
        return 1.0
    worst = 0.0
    for g in range(G):
        if cap[g] > 0.0:
            worst = max(worst, load[g] / cap[g])
    return worst


@kernel
def ideal_loads(w, speed):
    """(total tokens, [G] every device's ideal load ``total * speed_g / sum(speed)``), summed
    in index order (:func:`chain_layer` and :func:`finish_chain` must get the same figures)."""
    total = 0.0
    for e in range(w.shape[0]):
        total += w[e]
    total_speed = 0.0
    for g in range(speed.shape[0]):
        total_speed += speed[g]
    ideal = total / total_speed
    cap = np.empty(speed.shape[0], dtype=np.float64)
    for g in range(speed.shape[0]):
        cap[g] = ideal * speed[g]
    return total, cap


@kernel
def holds_expert(phy2log, lo, hi, e):
    for s in range(lo, hi):
        if phy2log[s] == e:
            return True
    return False


def reserves(topology: Topology, num_experts: int) -> np.ndarray:
    """[V, G] int64: the ways the valve chain tries to keep slots free of whole experts.

    One free slot on every device when S - E >= G (every device can take a valve), then the
    spare slots where whole experts in proportion to speed leave them (see
    :func:`speed_reserve`); only the second when spare slots are fewer than devices.
    """
    key = (topology, num_experts)
    if key not in _RESERVES:
        G = topology.num_devices
        rows = []
        if topology.num_slots - num_experts >= G:
            rows.append(np.minimum(1, topology.slots))
        by_speed = speed_reserve(topology, num_experts)
        if not any(np.array_equal(by_speed, r) for r in rows):
            rows.append(by_speed)
        if len(_RESERVES) > 64:
            _RESERVES.clear()
        _RESERVES[key] = np.ascontiguousarray(np.stack(rows), dtype=np.int64)
    return _RESERVES[key]


_RESERVES: dict = {}


def speed_reserve(topology: Topology, num_experts: int) -> np.ndarray:
    """[G] int64: free slots per device when whole experts are spread in proportion to speed
    (at most a device's slots; largest remainders round)."""
    speed = topology.speed
    slots = topology.slots.astype(np.float64)
    E = num_experts
    # water level lam: sum_g min(slots_g, lam * speed_g) = E, by bisection
    lo, hi = 0.0, float(slots.max() / speed.min())
    for _ in range(60):
        lam = 0.5 * (lo + hi)
        if np.minimum(slots, lam * speed).sum() < E:
            lo = lam
        else:
            hi = lam
    share = np.minimum(slots, hi * speed)
    whole = np.floor(share + 1e-9).astype(np.int64)
    short = E - int(whole.sum())
    if short > 0:
        rest = np.where(whole < topology.slots, share - whole, -1.0)
        whole[np.argsort(-rest, kind="stable")[:short]] += 1
    return topology.slots - whole
