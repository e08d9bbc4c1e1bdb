"""Step 6, repair: the placement in service, shares re-split for new loads, then the moves that
lower the layer's tokens above its target time, on the layer with most above it first.

Kernels (:func:`~._jit.kernel`); ``dev`` is the :class:`~.core.Devices` structure. Shapes: E
experts, G devices, S slots (grouped by device), L layers.
"""

from __future__ import annotations

import numpy as np

from ..topology import Topology
from ._jit import kernel
from .core import MAX_SWEEPS, MOVE_TRIALS, devices_of
from .improve import give_back_share_listed, replace_in_slot, replicas_of, restore, swap_slots
from .relabel import relabel_to
from .shares import balance_shares, device_loads, expert_slots, max_times

# A repair step considers this many receiving devices (those with the most room).
RECEIVERS = 8
# Share sweeps of the re-balance that judges a repair step; the repaired layer gets the full
# MAX_SWEEPS at the end. A step's re-balance rarely converges even in 16 sweeps (its changes
# travel along chains of replicas); 4 judge the steps about as well and take a quarter of the
# time (RESULTS.md, "Re-plans about twice as fast").
STEP_SWEEPS = 4


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
def top_room(room, victim, tiny):
    """The receivers of a replica and the partners of a swap, each up to ``RECEIVERS`` devices
    with room above ``tiny``, the most room first (ties: the lower index first): receivers
    only among devices with a victim slot. One pass over the devices: (receivers, partners)."""
    recv = np.empty(RECEIVERS, dtype=np.int64)
    partners = np.empty(RECEIVERS, dtype=np.int64)
    n_recv = 0
    n_part = 0
    for g in range(room.shape[0]):
        if room[g] <= tiny:
            continue
        n_part = insert_by_room(partners, n_part, g, room)
        if victim[g] >= 0:
            n_recv = insert_by_room(recv, n_recv, g, room)
    return recv[:n_recv], partners[:n_part]


@kernel
def insert_by_room(top, n, g, room):
    """Insert device ``g`` into ``top[:n]`` (most room first, at most ``top.shape[0]``, later
    devices after earlier ones of equal room); returns the new length."""
    j = n
    while j > 0 and room[g] > room[top[j - 1]]:
        j -= 1
    if j >= top.shape[0]:
        return n
    last = min(n, top.shape[0] - 1)
    for i in range(last, j, -1):
        top[i] = top[i - 1]
    top[j] = g
    return min(n + 1, top.shape[0])


@kernel
def repair_step(w, dev, phy2log, share, load, target, budget, max_sweeps, holds):
    """One repair step on one layer, at most ``budget`` moves, that lowers :func:`total_excess`.

    A move: a piece of a device above the target gets a replica on one of the ``RECEIVERS``
    devices with the most room below it (among those with such a slot), in the slot of that
    device's smallest piece of an expert that has other replicas (its tokens go to them): the
    share slack of replicated experts. First a batch, the best move of every device above the
    target with one re-balance for all; failing that, single moves, the best ``MOVE_TRIALS``
    estimates each with a share re-balance; failing that (budget >= 2), the swap of two pieces
    between a device above and one below that lowers the excess most (:func:`best_swap`). Each
    re-balance runs ``max_sweeps`` sweeps. Returns the moves made (0 when nothing lowers the
    excess).

    ``holds`` [G * E] bool, all False: scratch for which experts each device holds (a table,
    not a scan of the device's slots per question); all False again on return.
    """
    slot_device = dev.slot_device
    E = w.shape[0]
    held = phy2log.copy()
    for s in range(held.shape[0]):
        holds[slot_device[s] * E + held[s]] = True
    made = repair_moves(w, dev, phy2log, share, load, target, budget, max_sweeps, holds, held)
    for s in range(held.shape[0]):
        holds[slot_device[s] * E + held[s]] = False
    return made


@kernel
def repair_moves(w, dev, phy2log, share, load, target, budget, max_sweeps, holds, saved_p):
    """:func:`repair_step` with ``holds`` filled in; ``saved_p`` is a copy of ``phy2log`` on
    entry (a tried change is undone from it)."""
    speed, slot_offsets, slot_device = dev.speed, dev.slot_offsets, dev.slot_device
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
    recv, partners = top_room(room, victim, tiny)
    n_recv = recv.shape[0]
    if n_recv == 0 and (budget < 2 or partners.shape[0] == 0):
        return 0
    spill = np.zeros(n_recv, dtype=np.float64)
    # each expert's slots before any move (a batch moves each expert at most once, so the
    # lists stay right for the experts it has not touched)
    starts, members = expert_slots(phy2log, E)
    if n_recv > 0:
        for i in range(n_recv):
            v = victim[recv[i]]
            f = phy2log[v]
            absorb = 0.0
            for j in range(starts[f], starts[f + 1]):
                s = members[j]
                if s != v and room[slot_device[s]] > 0.0:
                    absorb += room[slot_device[s]]
            spill[i] = max(0.0, w[f] * share[v] - absorb)
    # a move's estimate is at most room[d] + victim's piece - spill: receivers where that is
    # not positive take no move (often all of them, and the step goes on to a swap)
    live = np.empty(n_recv, dtype=np.int64)
    n_live = 0
    for i in range(n_recv):
        v = victim[recv[i]]
        if room[recv[i]] + w[phy2log[v]] * share[v] - spill[i] > tiny:
            live[n_live] = i
            n_live += 1
    # per live receiver: what it can take (room + victim's piece), its spill, its victim and
    # its row of ``holds``; a piece no receiver could take more than ``tiny`` of is skipped
    take = np.empty(n_live, dtype=np.float64)
    live_spill = np.empty(n_live, dtype=np.float64)
    live_dst = np.empty(n_live, dtype=np.int64)
    live_row = np.empty(n_live, dtype=np.int64)
    least_spill = np.inf
    for j in range(n_live):
        d = recv[live[j]]
        v = victim[d]
        take[j] = room[d] + w[phy2log[v]] * share[v]
        live_spill[j] = spill[live[j]]
        live_dst[j] = v
        live_row[j] = d * E
        least_spill = min(least_spill, live_spill[j])
    S = phy2log.shape[0]
    cand_est = np.empty(S * n_live, dtype=np.float64)
    cand_src = np.empty(S * n_live, dtype=np.int64)
    cand_dst = np.empty(S * n_live, dtype=np.int64)
    n_cand = 0
    cand_from = np.zeros(G + 1, dtype=np.int64)
    for h in range(G):
        cand_from[h] = n_cand
        over = -room[h]
        if over <= tiny or n_live == 0:
            continue
        for src in range(slot_offsets[h], slot_offsets[h + 1]):
            x = phy2log[src]
            p = w[x] * share[src]
            if p <= 0.0:
                continue
            top = min(over, p)
            if top - least_spill <= tiny:
                continue
            for j in range(n_live):
                if holds[live_row[j] + x]:
                    continue
                est = min(top, take[j]) - live_spill[j]
                if est > tiny:
                    cand_est[n_cand] = est
                    cand_src[n_cand] = src
                    cand_dst[n_cand] = live_dst[j]
                    n_cand += 1
    cand_from[G] = n_cand
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
            v = cand_dst[best]
            f = phy2log[v]
            touched[x] = True
            touched[f] = True
            # replace_in_slot, with f's slots from the lists
            load[slot_device[v]] -= w[f] * share[v]
            give_back_share_listed(w, dev, share, load, v, f, members[starts[f]:starts[f + 1]])
            phy2log[v] = x
            made += 1
        if made >= 2:
            balance_shares(w, dev, phy2log, share, load, max_sweeps)
            if total_excess(load, speed, target) < before - tiny:
                return made
        if made >= 1:
            restore(phy2log, share, load, saved_p, saved_s, saved_l)
        # then single moves, best estimate first
        tried = np.zeros(n_cand, dtype=np.bool_)
        for _ in range(min(MOVE_TRIALS, n_cand)):
            c = -1
            for i in range(n_cand):
                if not tried[i] and (c < 0 or cand_est[i] > cand_est[c]):
                    c = i
            tried[c] = True
            replace_in_slot(w, dev, phy2log, share, load, cand_dst[c],
                            phy2log[cand_src[c]])
            balance_shares(w, dev, phy2log, share, load, max_sweeps)
            if total_excess(load, speed, target) < before - tiny:
                return 1
            restore(phy2log, share, load, saved_p, saved_s, saved_l)
    if budget < 2:
        return 0
    # then the swap that lowers the excess most (batches of swaps, one re-balance for all,
    # cost about half as many moves again: the re-balance makes many of them needless)
    a, b = best_swap(w, dev, phy2log, share, room, partners, holds, tiny)
    if a < 0:
        return 0
    swap_slots(w, dev, phy2log, share, load, a, b)
    balance_shares(w, dev, phy2log, share, load, max_sweeps)
    if total_excess(load, speed, target) < before - tiny:
        return 2
    restore(phy2log, share, load, saved_p, saved_s, saved_l)
    return 0


@kernel
def best_swap(w, dev, phy2log, share, room, partners, holds, tiny):
    """The swap of two pieces, one of a device above the target and a smaller one of a partner
    (``partners``: devices with room, the most first), that lowers the total excess most
    (estimated from ``room``): (slot a, slot b), or (-1, -1). Searched from the device most
    above the target: a swap's gain is at most min(over, pa, room[d]), so the search stops
    where that bound falls below the best found; ties go to the first in slot order, as in a
    plain scan."""
    slot_offsets = dev.slot_offsets
    E = w.shape[0]
    G = room.shape[0]
    best_gain = tiny
    best_a = -1
    best_i = -1
    best_b = -1
    n_over = 0
    over_dev = np.empty(G, dtype=np.int64)
    for g in range(G):
        if room[g] < -tiny:
            over_dev[n_over] = g
            n_over += 1
    order = np.argsort(room[over_dev[:n_over]], kind="mergesort")
    for k in range(n_over):
        h = over_dev[order[k]]
        over = -room[h]
        if over < best_gain:
            break
        for a in range(slot_offsets[h], slot_offsets[h + 1]):
            ea = phy2log[a]
            pa = w[ea] * share[a]
            if min(over, pa) < best_gain:
                continue
            for i in range(partners.shape[0]):
                d = partners[i]
                if room[d] < best_gain:
                    break
                if holds[d * E + ea]:
                    continue
                for b in range(slot_offsets[d], slot_offsets[d + 1]):
                    eb = phy2log[b]
                    pb = w[eb] * share[b]
                    if pb >= pa or holds[h * E + eb]:
                        continue
                    delta = pa - pb
                    # excess h sheds, less the excess d gains
                    gain = over - max(0.0, over - delta) - max(0.0, delta - room[d])
                    if gain > best_gain or (gain == best_gain and best_a >= 0 and (
                            a < best_a or (a == best_a and (i < best_i or (
                                i == best_i and b < best_b))))):
                        best_gain = gain
                        best_a = a
                        best_i = i
                        best_b = b
    if best_a < 0:
        return -1, -1
    return best_a, best_b


@kernel
def plan_repair(loads, dev, prev_phy2log, prev_share, target, max_moves, max_sweeps):
    """Keep the previous placement, re-split shares for the new loads, then spend moves where
    they help most: always on the layer with the most tokens above its target time (relative
    to its load), one step at a time, so a move budget goes where it buys most.

    target [L]: hottest time each layer should reach. max_moves < 0: unlimited.
    Returns (phy2log [L,S], share [L,S], kept_share [L,S], moves made per layer [L]);
    ``kept_share`` is the previous placement re-split for the new loads (no move). The steps
    are judged on ``STEP_SWEEPS`` sweeps of re-balance, the repaired layers get ``max_sweeps``.
    """
    L = loads.shape[0]
    speed = dev.speed
    G = speed.shape[0]
    S = dev.slot_device.shape[0]
    phy2log = prev_phy2log.copy()
    share = prev_share.copy()
    loads_now = np.empty((L, G), dtype=np.float64)
    gap = np.empty(L, dtype=np.float64)
    stuck = np.zeros(L, dtype=np.bool_)
    moves = np.zeros(L, dtype=np.int64)
    holds = np.zeros(G * loads.shape[1], dtype=np.bool_)
    for layer in range(L):
        w = loads[layer]
        loads_now[layer] = device_loads(w, dev, phy2log[layer], share[layer])
        balance_shares(w, dev, phy2log[layer], share[layer], loads_now[layer], max_sweeps)
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
        made = repair_step(loads[worst], dev, phy2log[worst], share[worst], loads_now[worst],
                           target[worst], left, STEP_SWEEPS, holds)
        if made == 0:
            stuck[worst] = True
        moves[worst] += made
        spent += made
        gap[worst] = total_excess(loads_now[worst], speed, target[worst]) / max(
            loads[worst].sum(), 1e-300)
    # the steps were judged on STEP_SWEEPS sweeps: the repaired layers' shares in full
    for layer in range(L):
        if moves[layer] > 0:
            balance_shares(loads[layer], dev, phy2log[layer], share[layer], loads_now[layer],
                           max_sweeps)
    return phy2log, share, kept_share, moves


def repair_towards(k, w, topology: Topology, previous, fresh, max_moves, tolerance: float):
    """:func:`plan_repair` of ``previous`` (a Placement) for loads ``w`` [L, E] with the kernels
    ``k``, each layer's target its ``fresh`` (phy2log, share) plan's hottest time (at least
    the ideal) within ``tolerance``: (phy2log, share, kept_share [L, S], moves [L])."""
    ideal = w.sum(axis=1) / topology.speed.sum()
    target = np.maximum(max_times(w, fresh[0], fresh[1], topology), ideal) * (1.0 + tolerance)
    budget = -1 if max_moves is None else int(max_moves)
    return k.plan_repair(w, devices_of(topology), previous.phy2log, previous.share, target,
                         budget, MAX_SWEEPS)


# A repaired layer more than this above the fresh plan's hottest time (relative) takes the fresh
# plan instead: the repair's moves, one replica at a time, could not reach its layout. Below it
# the repair's few moves win (re-plans after a drift move a few percent of the slots and stay
# within 1-2% of a fresh plan, RESULTS.md's planner figures).
REPAIR_SHORTFALL = 0.02


def repair(k, w, topology: Topology, previous, fresh, max_moves, move_cost, tolerance: float):
    """The re-plan of ``plan(previous=...)``: :func:`repair_towards`; where the repair stays
    more than ``REPAIR_SHORTFALL`` (or ``tolerance``, if larger) above the ``fresh`` plan's
    hottest time, the fresh plan renamed after ``previous``
    (:func:`.relabel.relabel_to`: same balance, the fewest moves a renaming allows), within
    ``max_moves`` (layers that gain most per extra move first); then, with ``move_cost`` (a
    MoveCost), every layer whose moves do not pay back keeps ``previous`` (shares re-split).
    Returns (phy2log, share) [L, S]."""
    phy2log, share, kept_share, moves = repair_towards(k, w, topology, previous, fresh,
                                                       max_moves, tolerance)
    repaired_t = max_times(w, phy2log, share, topology)
    fresh_t = max_times(w, fresh[0], fresh[1], topology)
    short = np.flatnonzero(repaired_t > fresh_t * (1.0 + max(tolerance, REPAIR_SHORTFALL)))
    if short.size:
        # the fresh plan renamed, and its extra moves, for the short layers alone
        fresh_p, fresh_s = relabel_to(k, fresh[0], fresh[1], previous, topology, short)
        extra = layer_moves(fresh_p, previous.phy2log[short], topology, w.shape[1]) \
            - moves[short]
        taken = np.arange(short.size)
        if max_moves is not None:
            # the layers that gain most per extra move first, while the budget lasts
            gain = (repaired_t[short] - fresh_t[short]) / np.maximum(extra, 1)
            left = int(max_moves) - int(moves.sum())
            chosen = []
            for i in np.argsort(-gain, kind="stable"):
                if extra[i] <= left:
                    chosen.append(i)
                    left -= max(int(extra[i]), 0)
            taken = np.array(sorted(chosen), dtype=np.int64)
        layers = short[taken]
        phy2log[layers], share[layers] = fresh_p[taken], fresh_s[taken]
        moves[layers] += extra[taken]
    if move_cost is not None:
        ideal = w.sum(axis=1) / topology.speed.sum()
        kept_time = max_times(w, previous.phy2log, kept_share, topology)
        saved = (kept_time - max_times(w, phy2log, share, topology)) / max(ideal.sum(), 1e-300)
        dear = (moves > 0) & (saved <= moves * move_cost.per_move)
        phy2log[dear] = previous.phy2log[dear]
        share[dear] = kept_share[dear]
    return phy2log, share


def layer_moves(new_phy2log, old_phy2log, topology: Topology, num_experts: int) -> np.ndarray:
    """[L] expert copies each layer needs to go from ``old`` to ``new`` (a device's slots
    relabel freely)."""
    L = new_phy2log.shape[0]
    held = np.zeros((L, topology.num_devices * num_experts), dtype=bool)
    rows = np.arange(L)[:, None]
    held[rows, topology.slot_device * num_experts + old_phy2log] = True
    return (~held[rows, topology.slot_device * num_experts + new_phy2log]).sum(axis=1)
