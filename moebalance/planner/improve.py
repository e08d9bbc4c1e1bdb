"""Step 5, improvement: single-slot changes and swaps that lower a layer's hottest device.

Kernels (:func:`~._jit.kernel`); ``dev`` is the :class:`~.core.Devices` structure. Shapes: E
experts, G devices, S slots (grouped by device).
"""

from __future__ import annotations

import numpy as np

from ._jit import kernel
from .core import EXHAUSTIVE_SIZE, MOVE_TRIALS
from .shares import balance_shares, hottest, max_time


@kernel
def replicas_of(phy2log, num_experts):
    """[E] int64: slots holding each expert."""
    reps = np.zeros(num_experts, dtype=np.int64)
    for s in range(phy2log.shape[0]):
        reps[phy2log[s]] += 1
    return reps


@kernel
def replicate_onto_spare(w, dev, phy2log, share, load, max_sweeps):
    """One move: overwrite a spare replica on a cooler device with a replica of a piece of the
    hottest device, if that lowers the hottest time. Returns 1 if a move was made, else 0.

    Candidates (each piece of the hottest device x each device that can take it) are ranked by
    the time the hottest device would reach if the piece were shared with the candidate device
    so both finish together; the best few are tried with a full share re-balance.
    """
    speed, slot_offsets = dev.speed, dev.slot_offsets
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
                if reps[f] >= 2 and (victim < 0 or w[f] * share[s]
                                     < w[phy2log[victim]] * share[victim]):
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
        replace_in_slot(w, dev, phy2log, share, load, cand_victim[c],
                        phy2log[cand_src[c]])
        balance_shares(w, dev, phy2log, share, load, max_sweeps)
        if max_time(load, speed) < current * (1.0 - 1e-9):
            return 1
        restore(phy2log, share, load, saved_p, saved_s, saved_l)
    return 0


@kernel
def give_back_share(w, dev, phy2log, share, load, slot):
    """Slot ``slot`` stops serving its expert ``f``: its share goes to f's other replicas in
    proportion to theirs (equally if theirs are all zero)."""
    f = phy2log[slot]
    give_back_share_listed(w, dev, share, load, slot, f, np.flatnonzero(phy2log == f))


@kernel
def give_back_share_listed(w, dev, share, load, slot, f, slots_of_f):
    """:func:`give_back_share` of ``slot``, which serves expert ``f``, whose slots
    ``slots_of_f`` (in slot order, ``slot`` among them) the caller knows: the same arithmetic
    without a scan of the layer."""
    slot_device = dev.slot_device
    gone = share[slot]
    rest = 0.0
    count = 0
    for s in slots_of_f:
        if s != slot:
            rest += share[s]
            count += 1
    for s in slots_of_f:
        if s != slot:
            extra = gone * share[s] / rest if rest > 0.0 else gone / count
            share[s] += extra
            load[slot_device[s]] += w[f] * extra
    share[slot] = 0.0


@kernel
def swap_singles(w, dev, phy2log, share, load, max_sweeps):
    """Two moves: swap a single-replica expert on the hottest device with a lighter single one
    elsewhere, choosing the pair that lowers the larger of the two devices' times most.
    Returns 2 if a swap was made, else 0."""
    speed, slot_offsets, slot_device = dev.speed, dev.slot_offsets, dev.slot_device
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
    balance_shares(w, dev, phy2log, share, load, max_sweeps)
    return 2


@kernel
def best_change(w, dev, phy2log, share, load, max_sweeps):
    """Exhaustive search for small layers: the best single slot change (any slot, any expert
    its device lacks, the old expert keeping a replica elsewhere) or swap of two slots' experts
    between devices, each judged after a full share re-balance. Applies it if it lowers the
    hottest time; returns the moves made (0, 1 or 2)."""
    speed, slot_offsets, slot_device = dev.speed, dev.slot_offsets, dev.slot_device
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
                replace_in_slot(w, dev, phy2log, share, load, a, e)
                balance_shares(w, dev, phy2log, share, load, max_sweeps)
                t = max_time(load, speed)
                if t < best:
                    best, best_a, best_b, best_e = t, a, -1, e
                restore(phy2log, share, load, saved_p, saved_s, saved_l)
        for b in range(a + 1, S):
            h = slot_device[b]
            eb = phy2log[b]
            if h == g or eb == old or on_device(eb, g, phy2log, slot_offsets) or on_device(
                    old, h, phy2log, slot_offsets):
                continue
            swap_slots(w, dev, phy2log, share, load, a, b)
            balance_shares(w, dev, phy2log, share, load, max_sweeps)
            t = max_time(load, speed)
            if t < best:
                best, best_a, best_b, best_e = t, a, b, -1
            restore(phy2log, share, load, saved_p, saved_s, saved_l)
    if best_a < 0:
        return 0
    if best_b < 0:
        replace_in_slot(w, dev, phy2log, share, load, best_a, best_e)
        balance_shares(w, dev, phy2log, share, load, max_sweeps)
        return 1
    swap_slots(w, dev, phy2log, share, load, best_a, best_b)
    balance_shares(w, dev, phy2log, share, load, max_sweeps)
    return 2


@kernel
def replace_in_slot(w, dev, phy2log, share, load, slot, e):
    """Slot ``slot`` stops serving its expert (whose share goes to that expert's other
    replicas) and holds ``e`` with share 0 until the shares are re-balanced."""
    old = phy2log[slot]
    load[dev.slot_device[slot]] -= w[old] * share[slot]
    give_back_share(w, dev, phy2log, share, load, slot)
    phy2log[slot] = e


@kernel
def swap_slots(w, dev, phy2log, share, load, a, b):
    """Slots ``a`` and ``b`` (on different devices) exchange their experts and shares."""
    slot_device = dev.slot_device
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
def restore(phy2log, share, load, saved_p, saved_s, saved_l):
    """Undo a tried move: the layer's ``phy2log``/``share`` [S] and ``load`` [G] back to the
    copies saved before it."""
    phy2log[:] = saved_p
    share[:] = saved_s
    load[:] = saved_l


@kernel
def on_device(e, g, phy2log, slot_offsets):
    """Whether device ``g`` holds a replica of expert ``e``."""
    for s in range(slot_offsets[g], slot_offsets[g + 1]):
        if phy2log[s] == e:
            return True
    return False


@kernel
def improve_layer(w, dev, phy2log, share, load, target, budget, max_sweeps):
    """Apply improving moves until the layer's hottest time is <= target, no move helps, or
    ``budget`` moves are spent (budget < 0: unlimited). Returns the moves made."""
    speed = dev.speed
    made = 0
    while max_time(load, speed) > target:
        if budget >= 0 and made >= budget:
            break
        if phy2log.shape[0] * w.shape[0] <= EXHAUSTIVE_SIZE and (budget < 0 or budget - made >= 2):
            step = best_change(w, dev, phy2log, share, load, max_sweeps)
            if step == 0:
                break
            made += step
            continue
        step = replicate_onto_spare(w, dev, phy2log, share, load, max_sweeps)
        if step == 0 and (budget < 0 or budget - made >= 2):
            step = swap_singles(w, dev, phy2log, share, load, max_sweeps)
        if step == 0:
            break
        made += step
    return made
