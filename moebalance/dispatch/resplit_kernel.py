"""The per-step re-split as one kernel: one source, run as plain Python or compiled by Numba.

Given one step's tokens per expert ``w_E``, the replicas a placement already has and the
devices' speeds, :func:`resplit_layer` chooses each replicated expert's shares so that the slowest
device's time ``max_g load_g / speed_g`` is the least any split over those replicas allows (the
LP optimum of :func:`moebalance.dispatch.shares.optimal_max_time`), moving no weight. Two steps:

1. **Sweeps** (:func:`resplit_sweeps`, the planner's share step ``balance_shares`` on the
   dispatcher's [E, X] replica table): each replicated expert in turn is *water-filled*, its
   tokens poured onto its devices so that those that receive any finish together, given
   everything else they hold. Sweeps visit the experts in *colour class* order
   (:func:`resplit_order`: no two experts of a class share a device), forwards on even sweeps and
   backwards on odd ones. Inside a class no two experts touch one device, so water-filling a
   class's experts one after another equals doing them all at once: the torch form
   (:func:`moebalance.dispatch.shares.resplit_shares_torch`) does a class as a few tensor ops and
   the CUDA form (``csrc/resplit.cu``) with one thread per expert. Sweeps never raise the slowest
   time, and their fixed point is optimal, but an excess crosses the device graph one hop per
   sweep: on large layers tens of sweeps stay percent away from the optimum.
2. **Flow** (:func:`resplit_flow`): from the sweeps' split, the exact optimum by Newton's method on
   the time t with augmenting paths (Dinic's phases), starting from a lower bound
   (:func:`resplit_bound`) that is tight at the sweeps' fixed point.

The kernels are registered with :func:`moebalance.planner._jit.kernel`: run as they are they
are the reference; ``_jit.kernels("numba")`` gives their Numba copies (tests compare both).
Entry points:

- :func:`resplit_layer`: one layer, one step, in place on the [E, X] table (the dispatcher's).
- :func:`resplit_loads`: [T, G] device loads of one layer at every step of ``counts_TE`` from a
  placement's per-slot arrays (the simulator's and planner's form).

Legend: E experts, X most replicas of an expert, G devices, S slots, V replicated experts,
C colour classes, T steps.
"""

from __future__ import annotations

import numpy as np

from ..planner._jit import kernel

__all__ = ["RESPLIT_SWEEPS", "resplit_order", "resplit_sweeps", "resplit_bound", "resplit_flow",
           "resplit_layer", "resplit_columns", "resplit_loads"]

# Water-filling sweeps before the flow: they bring the split near the optimum cheaply, so the
# flow's lower bound starts close and few pairs wait (benchmarks/RESULTS.md has the timings).
RESPLIT_SWEEPS = 2


@kernel
def resplit_order(device_EX, num_devices):
    """The sweep order: experts with >= 2 replicas, grouped into colour classes.

    Greedy colouring in expert order: an expert joins the first class none of whose experts uses
    any of its devices.

    Args:
        device_EX: [E, X] int64, device of each replica, -1 padded (replicas first in a row).
        num_devices: G.

    Returns:
        order_V: [V] int64, the replicated experts, class by class, ascending within a class.
        class_starts: [C + 1] int64, where each class starts in ``order_V`` (then V).
    """
    E, X = device_EX.shape
    class_of = np.full(E, -1, dtype=np.int64)
    used_EG = np.zeros((E, num_devices), dtype=np.bool_)  # at most one class per expert
    num_classes = 0
    for e in range(E):
        n = 0
        for j in range(X):
            if device_EX[e, j] >= 0:
                n += 1
        if n < 2:
            continue
        c = 0
        while c < num_classes:
            free = True
            for j in range(X):
                g = device_EX[e, j]
                if g >= 0 and used_EG[c, g]:
                    free = False
                    break
            if free:
                break
            c += 1
        if c == num_classes:
            num_classes += 1
        class_of[e] = c
        for j in range(X):
            g = device_EX[e, j]
            if g >= 0:
                used_EG[c, g] = True
    class_starts = np.zeros(num_classes + 1, dtype=np.int64)
    for e in range(E):
        if class_of[e] >= 0:
            class_starts[class_of[e] + 1] += 1
    for c in range(num_classes):
        class_starts[c + 1] += class_starts[c]
    order_V = np.empty(class_starts[num_classes], dtype=np.int64)
    fill = class_starts[:num_classes].copy()
    for e in range(E):
        c = class_of[e]
        if c >= 0:
            order_V[fill[c]] = e
            fill[c] += 1
    return order_V, class_starts


@kernel
def resplit_water_fill(e, w_E, device_EX, speed_G, share_EX, load_G, scratch_2X, order_X):
    """Water-fill expert ``e`` (w_E[e] > 0, >= 2 replicas); updates share_EX[e] and load_G in
    place and returns the largest change of one replica's piece. scratch_2X [2, X] (base, level)
    and order_X [X]: scratch."""
    base_X, level_X = scratch_2X[0], scratch_2X[1]
    X = device_EX.shape[1]
    w = w_E[e]
    n = 0
    for j in range(X):
        g = device_EX[e, j]
        if g < 0:
            break
        base_X[j] = load_G[g] - w * share_EX[e, j]  # the device's load without this expert
        level_X[j] = base_X[j] / speed_G[g]
        order_X[j] = j
        n += 1
    # insertion sort by finishing time without this expert (stable; n is small)
    for a in range(1, n):
        b = a
        while b > 0 and level_X[order_X[b]] < level_X[order_X[b - 1]]:
            order_X[b], order_X[b - 1] = order_X[b - 1], order_X[b]
            b -= 1
    # the k coolest devices rise to a common time lam; k is the first whose lam does not
    # reach the next device's time
    acc_load = w
    acc_rate = 0.0
    lam = 0.0
    for k in range(n):
        j = order_X[k]
        acc_load += base_X[j]
        acc_rate += speed_G[device_EX[e, j]]
        lam = acc_load / acc_rate
        if k + 1 == n or lam <= level_X[order_X[k + 1]]:
            break
    placed = 0.0
    for j in range(n):
        piece = lam * speed_G[device_EX[e, j]] - base_X[j]
        if piece < 0.0:
            piece = 0.0
        level_X[j] = piece  # reused: the new piece
        placed += piece
    if placed <= 0.0:
        return 0.0
    change = 0.0
    for j in range(n):
        share = level_X[j] / placed
        moved = abs(w * share - w * share_EX[e, j])
        if moved > change:
            change = moved
        share_EX[e, j] = share
        load_G[device_EX[e, j]] = base_X[j] + w * share
    return change


@kernel
def resplit_sweeps(w_E, device_EX, speed_G, order_V, share_EX, load_G, sweeps):
    """``sweeps`` water-filling sweeps, in place on share_EX [E, X] and load_G [G] (which must
    match the shares on entry): classes forwards on even sweeps, backwards on odd ones."""
    X = device_EX.shape[1]
    V = order_V.shape[0]
    scratch_2X = np.empty((2, X), dtype=np.float64)
    order_X = np.empty(X, dtype=np.int64)
    for sweep in range(sweeps):
        for i in range(V):
            e = order_V[i] if sweep % 2 == 0 else order_V[V - 1 - i]
            if w_E[e] > 0.0:
                resplit_water_fill(e, w_E, device_EX, speed_G, share_EX, load_G, scratch_2X,
                                   order_X)


@kernel
def resplit_bound(w_E, device_EX, speed_G, load_G):
    """A lower bound on the best slowest time, tight at the sweeps' fixed point.

    For the devices N_k of the k highest times under ``load_G`` [G] and the experts A_k whose
    replicas all sit in N_k, every split puts ``w(A_k)`` on N_k: the time is at least
    ``w(A_k) / speed(N_k)``. The bound is the largest over k (k = G gives the ideal time). At
    the fixed point of the sweeps the top level set is such an N_k and meets the bound.
    """
    E, X = device_EX.shape
    G = speed_G.shape[0]
    time_G = np.empty(G, dtype=np.float64)
    for g in range(G):
        time_G[g] = -load_G[g] / speed_G[g]
    by_time = np.argsort(time_G, kind="mergesort")  # hottest first, ties in device order
    rank_G = np.empty(G, dtype=np.int64)
    for k in range(G):
        rank_G[by_time[k]] = k
    enters_G = np.zeros(G, dtype=np.float64)  # pairs of the experts whose last device is k-th
    for e in range(E):
        last = 0
        for j in range(X):
            g = device_EX[e, j]
            if g < 0:
                break
            last = max(last, rank_G[g])
        enters_G[last] += w_E[e]
    best, pairs, speed = 0.0, 0.0, 0.0
    for k in range(G):
        pairs += enters_G[k]
        speed += speed_G[by_time[k]]
        best = max(best, pairs / speed)
    return best


@kernel
def resplit_flow(w_E, device_EX, speed_G, share_EX, load_G):
    """The exact step: shares whose slowest device's time is the LP optimum, from near it.

    Newton's method on the time t from below, with augmenting paths: device g may hold
    ``t * speed_G[g]``; the flow ``w[e] * share[e, j]`` is first trimmed to that, then the
    trimmed pairs travel along augmenting paths (expert -> any of its devices -> back to
    another expert holding pairs there -> ...) to devices with room. When no path is left, the
    experts A the search reached can only use the devices N it reached, all full: no split puts
    ``w(A)`` on ``N`` faster than ``w(A) / speed(N)``, a larger lower bound; t rises to it and the
    search goes on (the flow stays within the larger capacities). t starts at a lower bound
    (:func:`resplit_bound`, and each device's pairs of its single-replica experts). In place on
    share_EX [E, X] and load_G [G] (which must match the shares on entry); experts with one
    replica or no pairs keep their shares.
    """
    E, X = device_EX.shape
    G = speed_G.shape[0]
    total = 0.0
    for e in range(E):
        total += w_E[e]
    if total <= 0.0 or X < 2:
        return
    eps = 1e-12 * total
    # Replicas of replicated experts with pairs held by each device, as flat indices
    # e * X + j (CSR); the other experts' pairs cannot move.
    device_starts = np.zeros(G + 1, dtype=np.int64)
    fixed_G = np.zeros(G, dtype=np.float64)
    for e in range(E):
        if device_EX[e, 1] < 0:
            fixed_G[device_EX[e, 0]] += w_E[e]
        elif w_E[e] > 0.0:
            for j in range(X):
                g = device_EX[e, j]
                if g >= 0:
                    device_starts[g + 1] += 1
    for g in range(G):
        device_starts[g + 1] += device_starts[g]
    held_R = np.empty(device_starts[G], dtype=np.int64)
    fill_G = device_starts[:G].copy()
    for e in range(E):
        if device_EX[e, 1] >= 0 and w_E[e] > 0.0:
            for j in range(X):
                g = device_EX[e, j]
                if g >= 0:
                    held_R[fill_G[g]] = e * X + j
                    fill_G[g] += 1
    flow_EX = np.zeros((E, X), dtype=np.float64)
    for e in range(E):
        for j in range(X):
            if device_EX[e, j] >= 0:
                flow_EX[e, j] = w_E[e] * share_EX[e, j]
    t = 0.0
    for g in range(G):
        t = max(t, fixed_G[g] / speed_G[g])
    t = max(t, resplit_bound(w_E, device_EX, speed_G, load_G))
    # Trim every device to t * speed: the trimmed pairs wait in rest_E.
    rest_E = np.zeros(E, dtype=np.float64)
    for g in range(G):
        excess = load_G[g] - t * speed_G[g]
        r = device_starts[g]
        while excess > eps and r < device_starts[g + 1]:
            e, j = held_R[r] // X, held_R[r] % X
            cut = min(excess, flow_EX[e, j])
            if cut > 0.0:
                flow_EX[e, j] -= cut
                rest_E[e] += cut
                load_G[g] -= cut
                excess -= cut
            r += 1
    waiting = 0.0
    for e in range(E):
        waiting += rest_E[e]
    # Dinic's phases: a breadth-first search from every expert with waiting pairs sets the
    # levels up to the nearest devices with room; depth-first walks along rising levels then
    # push as many pairs as those levels carry.
    level_E = np.empty(E, dtype=np.int64)
    level_G = np.empty(G, dtype=np.int64)
    next_E = np.empty(E, dtype=np.int64)   # next replica to try (current arc)
    next_G = np.empty(G, dtype=np.int64)   # next held replica to try
    queue = np.empty(E, dtype=np.int64)
    path_e = np.empty(E + 1, dtype=np.int64)  # experts along a path
    path_j = np.empty(E + 1, dtype=np.int64)  # the replica each takes forwards
    path_r = np.empty(E + 1, dtype=np.int64)  # held replica an expert was reached back through
    for _ in range(4 * (E + G)):  # bounded; each phase raises t or fills a device or a path
        if waiting <= eps * 16:
            break
        level_E[:] = -1
        level_G[:] = -1
        head, tail = 0, 0
        for e in range(E):
            if rest_E[e] > eps:
                level_E[e] = 0
                queue[tail] = e
                tail += 1
        sink_level = -1
        while head < tail:
            e = queue[head]
            head += 1
            if sink_level >= 0 and level_E[e] + 1 > sink_level:
                break
            for j in range(X):
                g = device_EX[e, j]
                if g < 0:
                    break
                if level_G[g] >= 0:
                    continue
                level_G[g] = level_E[e] + 1
                if load_G[g] < t * speed_G[g] - eps:
                    sink_level = level_G[g]
                    continue
                for r in range(device_starts[g], device_starts[g + 1]):
                    f = held_R[r] // X
                    if level_E[f] < 0 and flow_EX[f, held_R[r] % X] > eps:
                        level_E[f] = level_G[g] + 1
                        queue[tail] = f
                        tail += 1
        if sink_level < 0:
            # No device with room is reachable: raise t to the bound of what was reached.
            reached_w, reached_speed = 0.0, 0.0
            for e in range(E):
                if level_E[e] >= 0:
                    reached_w += w_E[e]
            for g in range(G):
                if level_G[g] >= 0:
                    reached_w += fixed_G[g]  # its single-replica experts are reached too
                    reached_speed += speed_G[g]
            t = max(t * (1.0 + 1e-12), reached_w / reached_speed)
            continue
        for e in range(E):
            next_E[e] = 0
        for g in range(G):
            next_G[g] = device_starts[g]
        for s in range(E):
            if level_E[s] != 0:
                continue
            depth = 0
            path_e[0] = s
            while rest_E[s] > eps and level_E[s] == 0:
                e = path_e[depth]
                # advance e's current arc to a live device one level up
                g = -1
                while next_E[e] < X and device_EX[e, next_E[e]] >= 0:
                    h = device_EX[e, next_E[e]]
                    if level_G[h] == level_E[e] + 1:
                        g = h
                        break
                    next_E[e] += 1
                if g < 0:
                    level_E[e] = -1  # dead end: back to the device it came through
                    if depth > 0:
                        depth -= 1
                    continue
                path_j[depth] = next_E[e]
                if level_G[g] == sink_level:
                    if load_G[g] >= t * speed_G[g] - eps:
                        level_G[g] = -1  # full: no pushing through it at this level
                        continue
                    # a device with room: push along the path
                    amount = min(rest_E[s], t * speed_G[g] - load_G[g])
                    for k in range(1, depth + 1):
                        r = path_r[k]
                        amount = min(amount, flow_EX[held_R[r] // X, held_R[r] % X])
                    for k in range(depth + 1):
                        flow_EX[path_e[k], path_j[k]] += amount
                        if k > 0:
                            r = path_r[k]
                            flow_EX[held_R[r] // X, held_R[r] % X] -= amount
                    load_G[g] += amount
                    rest_E[s] -= amount
                    waiting -= amount
                    if load_G[g] >= t * speed_G[g] - eps:
                        level_G[g] = -1
                    depth = 0
                    continue
                # from g, back through an expert holding pairs there, one level up
                f = -1
                while next_G[g] < device_starts[g + 1]:
                    r = next_G[g]
                    c = held_R[r] // X
                    if level_E[c] == level_G[g] + 1 and flow_EX[c, held_R[r] % X] > eps:
                        f = c
                        break
                    next_G[g] += 1
                if f < 0:
                    level_G[g] = -1  # dead end: e tries its next device
                    next_E[e] += 1
                    continue
                depth += 1
                path_e[depth] = f
                path_r[depth] = next_G[g]
    # Pairs still waiting (float dust) go back to their experts' replicas in proportion.
    for e in range(E):
        if w_E[e] <= 0.0 or device_EX[e, 1] < 0:
            continue
        placed = 0.0
        for j in range(X):
            placed += flow_EX[e, j]
        if placed > 0.0:
            for j in range(X):
                share_EX[e, j] = flow_EX[e, j] / placed


@kernel
def resplit_layer(w_E, device_EX, speed_G, order_V, share_EX, load_G, sweeps, exact):
    """Re-split one layer for one step: the module docstring's sweeps, in place.

    Args:
        w_E: [E] float64, this step's tokens (pairs) of each expert, >= 0.
        device_EX: [E, X] int64, device of each replica, -1 padded (replicas first in a row).
        speed_G: [G] float64, device speeds, > 0.
        order_V: [V] int64, the sweep order (:func:`resplit_order`).
        share_EX: [E, X] float64, in: the starting shares (the placement's), out: this step's.
            Experts with one replica or no tokens keep theirs.
        load_G: [G] float64, out: each device's load under the new shares.
        sweeps: water-filling sweeps. exact: then :func:`resplit_flow` (True) or not (False).
    """
    E, X = device_EX.shape
    G = speed_G.shape[0]
    for g in range(G):
        load_G[g] = 0.0
    for e in range(E):
        for j in range(X):
            g = device_EX[e, j]
            if g >= 0:
                load_G[g] += w_E[e] * share_EX[e, j]
    if order_V.shape[0] == 0:
        return
    resplit_sweeps(w_E, device_EX, speed_G, order_V, share_EX, load_G, sweeps)
    if exact:
        resplit_flow(w_E, device_EX, speed_G, share_EX, load_G)


@kernel
def resplit_columns(phy2log_S, slot_device_S, share_S, num_experts):
    """A layer's per-slot arrays as the [E, X] replica table (replicas in slot order).

    Returns:
        device_EX: [E, X] int64 (-1 padded) and share_EX: [E, X] float64 (0 padded), X the most
        replicas of an expert (at least 1).
    """
    S = phy2log_S.shape[0]
    count_E = np.zeros(num_experts, dtype=np.int64)
    for s in range(S):
        count_E[phy2log_S[s]] += 1
    X = max(1, count_E.max())
    device_EX = np.full((num_experts, X), -1, dtype=np.int64)
    share_EX = np.zeros((num_experts, X), dtype=np.float64)
    count_E[:] = 0
    for s in range(S):
        e = phy2log_S[s]
        device_EX[e, count_E[e]] = slot_device_S[s]
        share_EX[e, count_E[e]] = share_S[s]
        count_E[e] += 1
    return device_EX, share_EX


@kernel
def resplit_loads(counts_TE, phy2log_S, share_S, speed_G, slot_device_S, sweeps, exact):
    """[T, G] device loads of one layer at every step of ``counts_TE`` [T, E] when each step's
    tokens are re-split over the placement's replicas (:func:`resplit_layer` from the
    placement's shares ``share_S`` [S]), as the dispatcher does."""
    T, E = counts_TE.shape
    G = speed_G.shape[0]
    device_EX, start_EX = resplit_columns(phy2log_S, slot_device_S, share_S, E)
    order_V, _ = resplit_order(device_EX, G)
    share_EX = np.empty_like(start_EX)
    w_E = np.empty(E, dtype=np.float64)
    out_TG = np.zeros((T, G), dtype=np.float64)
    load_G = np.empty(G, dtype=np.float64)
    for t in range(T):
        for e in range(E):
            w_E[e] = counts_TE[t, e]
        share_EX[:] = start_EX
        resplit_layer(w_E, device_EX, speed_G, order_V, share_EX, load_G, sweeps, exact)
        out_TG[t] = load_G
    return out_TG
