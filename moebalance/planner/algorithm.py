"""The planning algorithm, one MoE layer at a time, written once for both executions.

Every function here is a :func:`kernel`: plain Python over numpy arrays in the subset Numba
compiles. Run as it is, it is the reference; :func:`moebalance.planner._jit.compiled` gives the
same functions compiled. Nothing here validates: :func:`moebalance.plan` has checked the inputs.

The method, per layer (E experts with loads ``w``, G devices with ``speed``/``slots``):

Fresh plan (:func:`plan_fresh`). With token shares an expert is a divisible job, so the ideal
``max_g load_g / speed_g = sum(w) / sum(speed)`` is reachable whenever the spare slots leave
room for the split pieces:

1. ``chain_layer``: whole experts on all but ``reserve[g]`` slots of every device, then valves
   in the free slots that bring every device to its ideal load exactly: a ring of valves
   (``ring_valves``, McNaughton's wrap-around closed into a ring, with a free circulation that
   keeps every valve mid-range) or, when that does not fit, a north-west-corner chain (at most
   G - 1 valves). Exact on devices of equal speed and slots with S - E >= G in practice.
2. Where no chain is exact (too few spare slots): ``replica_counts`` (spare slots, one at a
   time, to the expert with the largest load per replica, at most one per device),
   ``pack_replicas`` (replicas, heaviest first, to the device that needs the most load per
   free slot), ``add_valves`` (spare slots as share-0 replicas), ``balance_shares`` (water
   filling of every replicated expert's shares: it minimises ``sum_g load_g^2 / speed_g``, whose
   minimiser also minimises ``max_g load_g/speed_g``; the achievable device loads form a
   polymatroid base polytope, Fujishige 1980) and ``improve_layer`` (single-slot changes that
   lower the hottest device). The layer keeps the best plan.

Re-plan (:func:`plan_repair`): the previous placement with shares re-split for the new loads,
then ``repair_step`` moves, always on the layer with the most tokens above its target time:
progress is the total excess ``sum_g max(0, load_g - target * speed_g)`` (moves on devices tied
at the maximum count), a move puts a piece of a device above the target on a device with room,
in the slot of a replica whose expert's other replicas take its share (their share slack), and
a swap of two pieces serves where no such slot exists. No layer is re-planned from scratch.

The EPLB drop-in (:mod:`.eplb`) uses ``replica_counts`` and ``pack_replicas`` with equal shares.

Shapes: E experts, G devices, S slots (grouped by device), L layers.
"""

from __future__ import annotations

import numpy as np

from ._jit import kernel

# Share sweeps stop when no device load changes by more than this fraction of the mean load.
SWEEP_TOL = 1e-7
MAX_SWEEPS = 16
# Candidate moves tried with a full share re-balance per improvement step, best estimate first.
MOVE_TRIALS = 6
# A repair step considers this many receiving devices (those with the most room).
RECEIVERS = 8
# Layers with slots x experts up to this are improved by exhaustive single-change search.
EXHAUSTIVE_SIZE = 256


# -- a small binary max-heap over (key, id) pairs: larger key first, then smaller id ------------


@kernel
def heap_before(key_a, id_a, key_b, id_b):
    return key_a > key_b or (key_a == key_b and id_a < id_b)


@kernel
def heap_push(keys, ids, size, key, idx):
    i = size
    keys[i] = key
    ids[i] = idx
    while i > 0:
        parent = (i - 1) // 2
        if heap_before(keys[i], ids[i], keys[parent], ids[parent]):
            keys[i], keys[parent] = keys[parent], keys[i]
            ids[i], ids[parent] = ids[parent], ids[i]
            i = parent
        else:
            break
    return size + 1


@kernel
def heap_pop(keys, ids, size):
    """Remove the top; return the new size (the top was keys[0], ids[0] before the call)."""
    size -= 1
    heap_replace_top(keys, ids, size, keys[size], ids[size])
    return size


@kernel
def heap_replace_top(keys, ids, size, key, idx):
    """Replace the top with (key, idx) and restore the heap order (one sift down)."""
    keys[0] = key
    ids[0] = idx
    heap_sift_down(keys, ids, size, 0)


@kernel
def heap_sift_down(keys, ids, size, i):
    while True:
        left = 2 * i + 1
        best = i
        if left < size and heap_before(keys[left], ids[left], keys[best], ids[best]):
            best = left
        if left + 1 < size and heap_before(keys[left + 1], ids[left + 1], keys[best], ids[best]):
            best = left + 1
        if best == i:
            break
        keys[i], keys[best] = keys[best], keys[i]
        ids[i], ids[best] = ids[best], ids[i]
        i = best


# -- step 1: replica counts ----------------------------------------------------------------------


@kernel
def replica_counts(w, num_slots, num_devices, max_piece):
    """[E] int64: replicas per expert that carry load: >= 1, <= num_devices, sum <= num_slots.

    Greedy apportionment: spare slots go, one at a time, to the expert with the largest load per
    replica (ties: lower expert id) until no piece is larger than ``max_piece`` (the most one
    slot of any device should carry) or the slots run out. Slots left over become valves.
    """
    E = w.shape[0]
    r = np.ones(E, dtype=np.int64)
    extra = num_slots - E
    if extra <= 0 or num_devices <= 1:
        return r
    keys = w.copy()
    ids = np.arange(E)
    size = E
    for i in range(E // 2 - 1, -1, -1):  # bottom-up heapify, O(E)
        heap_sift_down(keys, ids, size, i)
    while extra > 0 and size > 0 and keys[0] > max_piece:
        e = ids[0]
        size = heap_pop(keys, ids, size)
        r[e] += 1
        extra -= 1
        if r[e] < num_devices:
            size = heap_push(keys, ids, size, w[e] / r[e], e)
    return r


@kernel
def add_valves(w, r, speed, slots, slot_offsets, phy2log, share, slot_device):
    """Fill the slots packing left free with extra replicas (share 0 until balanced), each a
    valve through which load can flow from a hot device to a cool one.

    Free slots are filled coolest device first; each takes a replica of a piece on the device
    that is hottest after the valves placed so far, and the load the valve could carry is
    moved in the running estimate, so that later valves serve the next-hottest devices.
    Updates r in place.
    """
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


# -- step 2: packing -----------------------------------------------------------------------------


@kernel
def pack_replicas(w, r, speed, slots, node, slot_offsets, phy2log, share, per_slot, distinct):
    """Fill phy2log [S] / share [S] (equal split): replicas, heaviest first, each to the device
    that still needs the most load (``per_slot``: per free slot).

    A device's need is its fair load ``W * speed / sum(speed)`` minus what it holds; dividing by
    its free slots makes devices with few slots and much to carry take the big pieces and
    devices with many slots the small ones. Without ``per_slot`` on alike devices this is
    EPLB's balanced packing (the lightest device with room). Devices sit in a max-heap on that
    need (ties: lower device id, so replicas of one expert tend to stay on one node). With
    ``distinct`` a device never takes a second replica of an expert.
    """
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
                best, s = make_room(e, phy2log, slot_piece, slots, slot_offsets, used, holds, need)
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
def make_room(e, phy2log, slot_piece, slots, slot_offsets, used, holds, need):
    """Every device with a free slot already holds ``e``: move another expert ``f`` from a full
    device ``h`` into such a free slot, freeing a slot on ``h`` for ``e``. Returns (h, slot),
    or (-1, -1) when no such move exists (a device that must hold every expert, say)."""
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


# -- step 3: token shares ------------------------------------------------------------------------


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
def device_loads(w, phy2log, share, slot_device, num_devices):
    load = np.zeros(num_devices, dtype=np.float64)
    for s in range(phy2log.shape[0]):
        load[slot_device[s]] += w[phy2log[s]] * share[s]
    return load


@kernel
def balance_shares(w, speed, slot_device, phy2log, share, load, max_sweeps):
    """Re-split the tokens of every replicated expert so its devices finish together.

    Updates ``share`` [S] and ``load`` [G] in place (load must match share on entry). Small
    layers (cheap, and where extreme speed ratios converge slowly) get 16x the sweeps.
    """
    E = w.shape[0]
    G = speed.shape[0]
    starts, members = expert_slots(phy2log, E)
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
    if phy2log.shape[0] * E <= EXHAUSTIVE_SIZE:
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


# -- step 4: improvement and repair --------------------------------------------------------------


@kernel
def replicas_of(phy2log, num_experts):
    """[E] int64: slots holding each expert."""
    reps = np.zeros(num_experts, dtype=np.int64)
    for s in range(phy2log.shape[0]):
        reps[phy2log[s]] += 1
    return reps


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
def replicate_onto_spare(w, speed, slot_device, slot_offsets, phy2log, share, load, max_sweeps):
    """One move: overwrite a spare replica on a cooler device with a replica of a piece of the
    hottest device, if that lowers the hottest time. Returns 1 if a move was made, else 0.

    Candidates (each piece of the hottest device x each device that can take it) are ranked by
    the time the hottest device would reach if the piece were shared with the candidate device
    so both finish together; the best few are tried with a full share re-balance.
    """
    E = w.shape[0]
    G = speed.shape[0]
    hot = hottest(load, speed)
    current = load[hot] / speed[hot]
    reps = replicas_of(phy2log, E)
    lo = slot_offsets[hot]
    hi = slot_offsets[hot + 1]
    n_cand = 0
    cand_est = np.empty((hi - lo) * G, dtype=np.float64)
    cand_src = np.empty((hi - lo) * G, dtype=np.int64)
    cand_victim = np.empty((hi - lo) * G, dtype=np.int64)
    for src in range(lo, hi):
        e = phy2log[src]
        moved = w[e] * share[src]
        if moved <= 0.0:
            continue
        hot_base = load[hot] - moved
        for h in range(G):
            if h == hot:
                continue
            holds_e = False
            victim = -1
            for s in range(slot_offsets[h], slot_offsets[h + 1]):
                f = phy2log[s]
                if f == e:
                    holds_e = True
                    break
                if reps[f] >= 2 and (victim < 0 or w[f] * share[s] < w[phy2log[victim]] * share[victim]):
                    victim = s
            if holds_e or victim < 0:
                continue
            h_base = load[h] - w[phy2log[victim]] * share[victim]
            level = (hot_base + h_base + moved) / (speed[hot] + speed[h])
            estimate = max(level, hot_base / speed[hot], h_base / speed[h])
            if estimate < current:
                cand_est[n_cand] = estimate
                cand_src[n_cand] = src
                cand_victim[n_cand] = victim
                n_cand += 1
    if n_cand == 0:
        return 0
    ranked = np.argsort(cand_est[:n_cand], kind="mergesort")
    saved_p = phy2log.copy()
    saved_s = share.copy()
    saved_l = load.copy()
    for i in range(min(MOVE_TRIALS, n_cand)):
        c = ranked[i]
        replace_in_slot(w, slot_device, phy2log, share, load, cand_victim[c],
                        phy2log[cand_src[c]])
        balance_shares(w, speed, slot_device, phy2log, share, load, max_sweeps)
        if max_time(load, speed) < current * (1.0 - 1e-9):
            return 1
        phy2log[:] = saved_p
        share[:] = saved_s
        load[:] = saved_l
    return 0


@kernel
def give_back_share(f, slot, phy2log, share, load, w, slot_device):
    """Slot ``slot`` stops serving expert ``f``: its share goes to f's other replicas in
    proportion to theirs (equally if theirs are all zero)."""
    gone = share[slot]
    rest = 0.0
    count = 0
    for s in range(phy2log.shape[0]):
        if s != slot and phy2log[s] == f:
            rest += share[s]
            count += 1
    for s in range(phy2log.shape[0]):
        if s != slot and phy2log[s] == f:
            extra = gone * share[s] / rest if rest > 0.0 else gone / count
            share[s] += extra
            load[slot_device[s]] += w[f] * extra
    share[slot] = 0.0


@kernel
def swap_singles(w, speed, slot_device, slot_offsets, phy2log, share, load, max_sweeps):
    """Two moves: swap a single-replica expert on the hottest device with a lighter single one
    elsewhere, choosing the pair that lowers the larger of the two devices' times most.
    Returns 2 if a swap was made, else 0."""
    E = w.shape[0]
    S = phy2log.shape[0]
    hot = hottest(load, speed)
    current = load[hot] / speed[hot]
    reps = replicas_of(phy2log, E)
    best_after = current
    best_a = -1
    best_b = -1
    for a in range(slot_offsets[hot], slot_offsets[hot + 1]):
        ea = phy2log[a]
        if reps[ea] != 1:
            continue
        for b in range(S):
            h = slot_device[b]
            eb = phy2log[b]
            if h == hot or reps[eb] != 1 or w[eb] >= w[ea]:
                continue
            delta = w[ea] - w[eb]
            after = max((load[hot] - delta) / speed[hot], (load[h] + delta) / speed[h])
            if after < best_after * (1.0 - 1e-9):
                # the pair must not put an expert twice on one device
                clash = False
                for s in range(slot_offsets[h], slot_offsets[h + 1]):
                    if phy2log[s] == ea:
                        clash = True
                for s in range(slot_offsets[hot], slot_offsets[hot + 1]):
                    if phy2log[s] == eb:
                        clash = True
                if not clash:
                    best_after = after
                    best_a = a
                    best_b = b
    if best_a < 0:
        return 0
    ea = phy2log[best_a]
    eb = phy2log[best_b]
    delta = w[ea] - w[eb]
    phy2log[best_a] = eb
    phy2log[best_b] = ea
    load[hot] -= delta
    load[slot_device[best_b]] += delta
    balance_shares(w, speed, slot_device, phy2log, share, load, max_sweeps)
    return 2


@kernel
def best_change(w, speed, slot_device, slot_offsets, phy2log, share, load, max_sweeps):
    """Exhaustive search for small layers: the best single slot change (any slot, any expert
    its device lacks, the old expert keeping a replica elsewhere) or swap of two slots' experts
    between devices, each judged after a full share re-balance. Applies it if it lowers the
    hottest time; returns the moves made (0, 1 or 2)."""
    E = w.shape[0]
    S = phy2log.shape[0]
    reps = replicas_of(phy2log, E)
    current = max_time(load, speed)
    best = current * (1.0 - 1e-9)
    best_a = -1
    best_b = -1
    best_e = -1
    saved_p = phy2log.copy()
    saved_s = share.copy()
    saved_l = load.copy()
    for a in range(S):
        old = phy2log[a]
        g = slot_device[a]
        if reps[old] >= 2:
            for e in range(E):
                if e == old or on_device(e, g, phy2log, slot_offsets):
                    continue
                replace_in_slot(w, slot_device, phy2log, share, load, a, e)
                balance_shares(w, speed, slot_device, phy2log, share, load, max_sweeps)
                t = max_time(load, speed)
                if t < best:
                    best, best_a, best_b, best_e = t, a, -1, e
                phy2log[:] = saved_p
                share[:] = saved_s
                load[:] = saved_l
        for b in range(a + 1, S):
            h = slot_device[b]
            eb = phy2log[b]
            if h == g or eb == old or on_device(eb, g, phy2log, slot_offsets) or on_device(
                    old, h, phy2log, slot_offsets):
                continue
            swap_slots(w, slot_device, phy2log, share, load, a, b)
            balance_shares(w, speed, slot_device, phy2log, share, load, max_sweeps)
            t = max_time(load, speed)
            if t < best:
                best, best_a, best_b, best_e = t, a, b, -1
            phy2log[:] = saved_p
            share[:] = saved_s
            load[:] = saved_l
    if best_a < 0:
        return 0
    if best_b < 0:
        replace_in_slot(w, slot_device, phy2log, share, load, best_a, best_e)
        balance_shares(w, speed, slot_device, phy2log, share, load, max_sweeps)
        return 1
    swap_slots(w, slot_device, phy2log, share, load, best_a, best_b)
    balance_shares(w, speed, slot_device, phy2log, share, load, max_sweeps)
    return 2


@kernel
def replace_in_slot(w, slot_device, phy2log, share, load, slot, e):
    """Slot ``slot`` stops serving its expert (whose share goes to that expert's other
    replicas) and holds ``e`` with share 0 until the shares are re-balanced."""
    old = phy2log[slot]
    load[slot_device[slot]] -= w[old] * share[slot]
    give_back_share(old, slot, phy2log, share, load, w, slot_device)
    phy2log[slot] = e


@kernel
def swap_slots(w, slot_device, phy2log, share, load, a, b):
    """Slots ``a`` and ``b`` (on different devices) exchange their experts and shares."""
    g = slot_device[a]
    h = slot_device[b]
    ea = phy2log[a]
    eb = phy2log[b]
    load[g] += w[eb] * share[b] - w[ea] * share[a]
    load[h] += w[ea] * share[a] - w[eb] * share[b]
    phy2log[a] = eb
    phy2log[b] = ea
    share[a], share[b] = share[b], share[a]


@kernel
def on_device(e, g, phy2log, slot_offsets):
    for s in range(slot_offsets[g], slot_offsets[g + 1]):
        if phy2log[s] == e:
            return True
    return False


@kernel
def improve_layer(w, speed, slot_device, slot_offsets, phy2log, share, load, target, budget,
                  max_sweeps):
    """Apply improving moves until the layer's hottest time is <= target, no move helps, or
    ``budget`` moves are spent (budget < 0: unlimited). Returns the moves made."""
    made = 0
    while max_time(load, speed) > target:
        if budget >= 0 and made >= budget:
            break
        if phy2log.shape[0] * w.shape[0] <= EXHAUSTIVE_SIZE and (budget < 0 or budget - made >= 2):
            step = best_change(w, speed, slot_device, slot_offsets, phy2log, share, load,
                               max_sweeps)
            if step == 0:
                break
            made += step
            continue
        step = replicate_onto_spare(w, speed, slot_device, slot_offsets, phy2log, share, load,
                                    max_sweeps)
        if step == 0 and (budget < 0 or budget - made >= 2):
            step = swap_singles(w, speed, slot_device, slot_offsets, phy2log, share, load,
                                max_sweeps)
        if step == 0:
            break
        made += step
    return made


# -- the fresh plan at the limit: whole experts, then a valve chain ------------------------------


@kernel
def chain_layer(w, order, vol, speed, slots, slot_offsets, slot_device, reserve, per_slot,
                snake, ring, phy2log, share):
    """Fresh plan of one layer that reaches every device's ideal load exactly when it can.

    1. Whole experts, heaviest first (``order``), keeping ``reserve[g]`` slots of device ``g``
       free: each to the device with the most room below its ideal load (``per_slot``: room
       per free slot), or, with ``snake`` (alike devices), in boustrophedon device order.
    2. Valves, in the free slots, to reach every ideal load exactly. With ``ring``, and a free
       slot on every device, :func:`ring_valves` (McNaughton's wrap-around, closed into a ring
       with mid-range valves). Otherwise the valve chain: every device below its ideal load
       takes a replica of the largest piece of a device above it, carrying its deficit
       (north-west-corner order: the sender with the most excess first; several pieces while
       it has several free slots). A sender that gives more than its excess turns receiver and
       takes its deficit the same way from the next sender, so every transfer settles one
       device: at most G - 1 valves.
    3. Slots still free hold share-0 valves (:func:`finish_chain`).

    Fills ``phy2log`` [S] and ``share`` [S]; returns the largest device time over ideal time
    (1.0: exact). Needs ``sum(slots - reserve) >= E``.
    """
    E = w.shape[0]
    G = speed.shape[0]
    S = phy2log.shape[0]
    total = 0.0
    for e in range(E):
        total += w[e]
    total_speed = 0.0
    for g in range(G):
        total_speed += speed[g]
    ideal = total / total_speed
    cap = np.empty(G, dtype=np.float64)
    for g in range(G):
        cap[g] = ideal * speed[g]
    load = np.zeros(G, dtype=np.float64)
    used = np.zeros(G, dtype=np.int64)
    amount = np.zeros(S, dtype=np.float64)
    if snake:
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
    if ring and ring_valves(vol, slots, slot_offsets, used, phy2log, amount, load, cap):
        return finish_chain(w, order, slots, slot_offsets, slot_device, used, phy2log, amount,
                            cap, share, total)
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
    return finish_chain(w, order, slots, slot_offsets, slot_device, used, phy2log, amount, cap,
                        share, total)


@kernel
def ring_valves(vol, slots, slot_offsets, used, phy2log, amount, load, cap):
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
def finish_chain(w, order, slots, slot_offsets, slot_device, used, phy2log, amount, cap, share,
                 total):
    """Last step of :func:`chain_layer`: share-0 valves in the slots still free, shares from
    the amounts, and the largest device load over its
    ideal load (1.0 for an exact plan, or for a layer without load)."""
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
def holds_expert(phy2log, lo, hi, e):
    for s in range(lo, hi):
        if phy2log[s] == e:
            return True
    return False


# -- whole plans ---------------------------------------------------------------------------------


@kernel
def plan_fresh(loads, order_LE, vol_LE, speed, slots, node, slot_offsets, slot_device,
               reserves, small_moves, large_moves, max_sweeps):
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
    device and make the rest valves; each then gets optimal shares and up to ``small_moves``
    improving moves per layer when the layer is small enough for exhaustive search, else
    ``large_moves`` targeted ones. The layer keeps whichever finishes earliest.
    """
    L = loads.shape[0]
    G = speed.shape[0]
    S = slot_device.shape[0]
    E = loads.shape[1]
    phy2log = np.empty((L, S), dtype=np.int64)
    share = np.empty((L, S), dtype=np.float64)
    trial_p = np.empty(S, dtype=np.int64)
    trial_s = np.empty(S, dtype=np.float64)
    total_speed = speed.sum()
    improve_moves = small_moves if S * E <= EXHAUSTIVE_SIZE else large_moves
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
                ratio = chain_layer(w, order, vol_LE[layer], speed, slots, slot_offsets,
                                    slot_device, reserves[v], not even, even and attempt == 0,
                                    True, trial_p, trial_s)
                if ratio > exact and total > 0.0:
                    load = device_loads(w, trial_p, trial_s, slot_device, G)
                    balance_shares(w, speed, slot_device, trial_p, trial_s, load, max_sweeps)
                    ratio = max_time(load, speed) * total_speed / total
                if ratio < best_ratio:
                    best_ratio = ratio
                    phy2log[layer] = trial_p
                    share[layer] = trial_s
        if best_ratio <= exact:
            continue
        for attempt in range(1 if alike else 2):
            ratio = pack_layer(w, attempt, speed, slots, node, slot_offsets, slot_device,
                               improve_moves, max_sweeps, trial_p, trial_s)
            if ratio < best_ratio:
                best_ratio = ratio
                phy2log[layer] = trial_p
                share[layer] = trial_s
    return phy2log, share


@kernel
def pack_layer(w, attempt, speed, slots, node, slot_offsets, slot_device, improve_moves,
               max_sweeps, out_p, out_s):
    """The packing of replica counts for one layer into ``out_p``/``out_s`` [S]; returns its
    hottest time over the ideal. ``attempt`` 0 splits heavy experts until no piece exceeds
    what one slot should carry; 1 splits only experts larger than a whole device (the rest
    become valves). Optimal shares, then up to ``improve_moves`` improving moves."""
    G = speed.shape[0]
    S = slot_device.shape[0]
    total = w.sum()
    total_speed = speed.sum()
    cap = 0.0
    for g in range(G):
        if attempt == 0:
            cap = max(cap, total * speed[g] / total_speed / slots[g])
        else:
            cap = max(cap, total * speed[g] / total_speed)
    r = replica_counts(w, S, G, cap)
    out_p[:] = -1
    pack_replicas(w, r, speed, slots, node, slot_offsets, out_p, out_s, True, True)
    add_valves(w, r, speed, slots, slot_offsets, out_p, out_s, slot_device)
    load = device_loads(w, out_p, out_s, slot_device, G)
    balance_shares(w, speed, slot_device, out_p, out_s, load, max_sweeps)
    improve_layer(w, speed, slot_device, slot_offsets, out_p, out_s, load,
                  total / total_speed * (1.0 + 1e-6), improve_moves, max_sweeps)
    return max_time(load, speed) * total_speed / total if total > 0.0 else 1.0


@kernel
def plan_packed(loads, attempt, speed, slots, node, slot_offsets, slot_device, improve_moves,
                max_sweeps):
    """:func:`pack_layer` for every layer: (phy2log [L,S], share [L,S])."""
    L = loads.shape[0]
    S = slot_device.shape[0]
    phy2log = np.empty((L, S), dtype=np.int64)
    share = np.empty((L, S), dtype=np.float64)
    for layer in range(L):
        pack_layer(loads[layer], attempt, speed, slots, node, slot_offsets, slot_device,
                   improve_moves, max_sweeps, phy2log[layer], share[layer])
    return phy2log, share


@kernel
def total_excess(load, speed, target):
    """Tokens above the target time, summed over devices: ``sum_g max(0, load_g - target *
    speed_g)``. Unlike the hottest time, it drops with every move off any device above the
    target, so moves on devices tied at the maximum count as progress."""
    out = 0.0
    for g in range(load.shape[0]):
        x = load[g] - target * speed[g]
        if x > 0.0:
            out += x
    return out


@kernel
def top_room(room, victim, tiny, need_victim):
    """Up to ``RECEIVERS`` devices with room above ``tiny`` (and, with ``need_victim``, a
    victim slot), the most room first."""
    G = room.shape[0]
    out = np.empty(RECEIVERS, dtype=np.int64)
    taken = np.zeros(G, dtype=np.bool_)
    n = 0
    for _ in range(RECEIVERS):
        best = -1
        for g in range(G):
            if not taken[g] and room[g] > tiny and (victim[g] >= 0 or not need_victim) and (
                    best < 0 or room[g] > room[best]):
                best = g
        if best < 0:
            break
        taken[best] = True
        out[n] = best
        n += 1
    return out[:n]


@kernel
def repair_step(w, speed, slot_offsets, slot_device, phy2log, share, load, target, budget,
                max_sweeps):
    """One repair step on one layer, at most ``budget`` moves, that lowers :func:`total_excess`.

    A move: a piece of a device above the target gets a replica on one of the ``RECEIVERS``
    devices with the most room below it (among those with such a slot), in the slot of that
    device's smallest piece of an expert that has other replicas (its tokens go to them): the
    share slack of replicated experts. First a batch, the best move of every device above the
    target with one re-balance for all; failing that, single moves, the best ``MOVE_TRIALS``
    estimates each with a full share re-balance; failing that (budget >= 2), the swap of two
    pieces between a device above and one below that lowers the excess most. Returns the moves
    made (0 when nothing lowers the excess).
    """
    E = w.shape[0]
    G = speed.shape[0]
    reps = replicas_of(phy2log, E)
    before = total_excess(load, speed, target)
    tiny = 1e-12 * (load.sum() + 1.0)
    if before <= tiny:
        return 0
    room = np.empty(G, dtype=np.float64)
    for g in range(G):
        room[g] = target * speed[g] - load[g]
    # each device's cheapest slot to overwrite: its smallest piece of an expert with other
    # replicas, and how much of that piece the expert's other holders can take without going
    # above the target
    victim = np.full(G, -1, dtype=np.int64)
    for g in range(G):
        if room[g] <= tiny:
            continue
        for s in range(slot_offsets[g], slot_offsets[g + 1]):
            f = phy2log[s]
            if reps[f] >= 2 and (victim[g] < 0 or w[f] * share[s] < w[phy2log[victim[g]]]
                                 * share[victim[g]]):
                victim[g] = s
    # receivers of a replica: the devices with a victim and the most room; partners of a swap:
    # the devices with the most room
    recv = top_room(room, victim, tiny, True)
    partners = top_room(room, victim, tiny, False)
    n_recv = recv.shape[0]
    if n_recv == 0 and (budget < 2 or partners.shape[0] == 0):
        return 0
    spill = np.zeros(n_recv, dtype=np.float64)
    for i in range(n_recv):
        v = victim[recv[i]]
        f = phy2log[v]
        absorb = 0.0
        for s in range(phy2log.shape[0]):
            if phy2log[s] == f and s != v and room[slot_device[s]] > 0.0:
                absorb += room[slot_device[s]]
        spill[i] = max(0.0, w[f] * share[v] - absorb)
    S = phy2log.shape[0]
    cand_est = np.empty(S * n_recv, dtype=np.float64)
    cand_src = np.empty(S * n_recv, dtype=np.int64)
    cand_dst = np.empty(S * n_recv, dtype=np.int64)
    n_cand = 0
    cand_from = np.zeros(G + 1, dtype=np.int64)
    for h in range(G):
        cand_from[h] = n_cand
        over = -room[h]
        if over <= tiny:
            continue
        for src in range(slot_offsets[h], slot_offsets[h + 1]):
            x = phy2log[src]
            p = w[x] * share[src]
            if p <= 0.0:
                continue
            for i in range(n_recv):
                d = recv[i]
                v = victim[d]
                if on_device(x, d, phy2log, slot_offsets):
                    continue
                pv = w[phy2log[v]] * share[v]
                est = min(over, p, room[d] + pv) - spill[i]
                if est > tiny:
                    cand_est[n_cand] = est
                    cand_src[n_cand] = src
                    cand_dst[n_cand] = v
                    n_cand += 1
    cand_from[G] = n_cand
    saved_p = phy2log.copy()
    saved_s = share.copy()
    saved_l = load.copy()
    if n_cand > 0:
        # first a batch: each device above the target (most excess first) makes its best
        # move, each device and each expert in at most one move of the batch, one re-balance
        # for all; candidates of one sender are contiguous (cand_from[h] .. cand_from[h + 1])
        busy = np.zeros(G, dtype=np.bool_)
        touched = np.zeros(E, dtype=np.bool_)
        made = 0
        senders = np.argsort(room, kind="mergesort")
        for k in range(G):
            h = senders[k]
            if room[h] >= -tiny or made >= budget:
                break
            best = -1
            for c in range(cand_from[h], cand_from[h + 1]):
                d = slot_device[cand_dst[c]]
                if busy[d] or touched[phy2log[cand_src[c]]] or touched[phy2log[cand_dst[c]]]:
                    continue
                if best < 0 or cand_est[c] > cand_est[best]:
                    best = c
            if best < 0:
                continue
            x = phy2log[cand_src[best]]
            busy[h] = True
            busy[slot_device[cand_dst[best]]] = True
            touched[x] = True
            touched[phy2log[cand_dst[best]]] = True
            replace_in_slot(w, slot_device, phy2log, share, load, cand_dst[best], x)
            made += 1
        if made >= 2:
            balance_shares(w, speed, slot_device, phy2log, share, load, max_sweeps)
            if total_excess(load, speed, target) < before - tiny:
                return made
        if made >= 1:
            phy2log[:] = saved_p
            share[:] = saved_s
            load[:] = saved_l
        # then single moves, best estimate first
        tried = np.zeros(n_cand, dtype=np.bool_)
        for _ in range(min(MOVE_TRIALS, n_cand)):
            c = -1
            for i in range(n_cand):
                if not tried[i] and (c < 0 or cand_est[i] > cand_est[c]):
                    c = i
            tried[c] = True
            replace_in_slot(w, slot_device, phy2log, share, load, cand_dst[c],
                            phy2log[cand_src[c]])
            balance_shares(w, speed, slot_device, phy2log, share, load, max_sweeps)
            if total_excess(load, speed, target) < before - tiny:
                return 1
            phy2log[:] = saved_p
            share[:] = saved_s
            load[:] = saved_l
    if budget < 2:
        return 0
    best_gain = tiny
    best_a = -1
    best_b = -1
    for h in range(G):
        over = -room[h]
        if over <= tiny:
            continue
        for a in range(slot_offsets[h], slot_offsets[h + 1]):
            ea = phy2log[a]
            pa = w[ea] * share[a]
            for i in range(partners.shape[0]):
                d = partners[i]
                if on_device(ea, d, phy2log, slot_offsets):
                    continue
                for b in range(slot_offsets[d], slot_offsets[d + 1]):
                    eb = phy2log[b]
                    pb = w[eb] * share[b]
                    if pb >= pa or on_device(eb, h, phy2log, slot_offsets):
                        continue
                    delta = pa - pb
                    # excess h sheds, less the excess d gains
                    gain = over - max(0.0, over - delta) - max(0.0, delta - room[d])
                    if gain > best_gain:
                        best_gain = gain
                        best_a = a
                        best_b = b
    if best_a < 0:
        return 0
    swap_slots(w, slot_device, phy2log, share, load, best_a, best_b)
    balance_shares(w, speed, slot_device, phy2log, share, load, max_sweeps)
    if total_excess(load, speed, target) < before - tiny:
        return 2
    phy2log[:] = saved_p
    share[:] = saved_s
    load[:] = saved_l
    return 0


@kernel
def plan_repair(loads, speed, slot_offsets, slot_device, prev_phy2log, prev_share, target,
                max_moves, max_sweeps):
    """Keep the previous placement, re-split shares for the new loads, then spend moves where
    they help most: always on the layer with the most tokens above its target time (relative
    to its load), one step at a time, so a move budget goes where it buys most.

    target [L]: hottest time each layer should reach. max_moves < 0: unlimited.
    Returns (phy2log [L,S], share [L,S], kept_share [L,S], moves made per layer [L]);
    ``kept_share`` is the previous placement re-split for the new loads (no move).
    """
    L = loads.shape[0]
    G = speed.shape[0]
    S = slot_device.shape[0]
    phy2log = prev_phy2log.copy()
    share = prev_share.copy()
    loads_now = np.empty((L, G), dtype=np.float64)
    gap = np.empty(L, dtype=np.float64)
    stuck = np.zeros(L, dtype=np.bool_)
    moves = np.zeros(L, dtype=np.int64)
    for layer in range(L):
        w = loads[layer]
        loads_now[layer] = device_loads(w, phy2log[layer], share[layer], slot_device, G)
        balance_shares(w, speed, slot_device, phy2log[layer], share[layer], loads_now[layer],
                       max_sweeps)
        gap[layer] = total_excess(loads_now[layer], speed, target[layer]) / max(w.sum(), 1e-300)
    kept_share = share.copy()
    spent = 0
    while max_moves < 0 or spent < max_moves:
        worst = -1
        for layer in range(L):
            if not stuck[layer] and gap[layer] > 1e-12 and (worst < 0 or gap[layer] > gap[worst]):
                worst = layer
        if worst < 0:
            break
        left = S if max_moves < 0 else max_moves - spent
        made = repair_step(loads[worst], speed, slot_offsets, slot_device, phy2log[worst],
                           share[worst], loads_now[worst], target[worst], left, max_sweeps)
        if made == 0:
            stuck[worst] = True
        moves[worst] += made
        spent += made
        gap[worst] = total_excess(loads_now[worst], speed, target[worst]) / max(
            loads[worst].sum(), 1e-300)
    return phy2log, share, kept_share, moves


@kernel
def step_times(counts_TLE, phy2log, share, speed, slot_device, max_sweeps):
    """[L]: mean over the steps of ``counts_TLE`` [T, L, E] of each layer's hottest time when
    each step's tokens are re-split over the placement's replicas (water filling from the
    placement's shares), the figure a spread-aware plan minimises."""
    T, L = counts_TLE.shape[0], counts_TLE.shape[1]
    G = speed.shape[0]
    out = np.zeros(L, dtype=np.float64)
    trial = np.empty(share.shape[1], dtype=np.float64)
    for layer in range(L):
        for t in range(T):
            w = counts_TLE[t, layer]
            trial[:] = share[layer]
            load = device_loads(w, phy2log[layer], trial, slot_device, G)
            balance_shares(w, speed, slot_device, phy2log[layer], trial, load, max_sweeps)
            out[layer] += max_time(load, speed)
        out[layer] /= T
    return out


@kernel
def resplit_device_loads(counts_TE, phy2log, share, speed, slot_device, max_sweeps):
    """[T, G] device loads of one layer at every step of ``counts_TE`` when each step's tokens
    are re-split over the placement's replicas (water filling from its shares, as the
    dispatcher's per-step re-split does)."""
    T = counts_TE.shape[0]
    G = speed.shape[0]
    out = np.zeros((T, G), dtype=np.float64)
    trial = np.empty(share.shape[0], dtype=np.float64)
    for t in range(T):
        w = counts_TE[t]
        trial[:] = share
        load = device_loads(w, phy2log, trial, slot_device, G)
        balance_shares(w, speed, slot_device, phy2log, trial, load, max_sweeps)
        out[t] = load
    return out
