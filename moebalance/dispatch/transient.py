"""Transient replicas: for one step, a hot expert's weights copied to a cold device's spare slot.

FineMoE-style. After the count exchange every rank knows the step's pairs of every expert; an
expert whose pairs make one device the slowest of the layer gets a copy of its WEIGHTS (not its
optimizer state) in a *transient slot* of a cold device. The copy serves part of the expert's
pairs in this step (the re-split counts it as one more replica), its gradient goes back to every
holder of the expert when backward ends, and the holders' optimizer update is unchanged: the
math of the step is the same with or without copies. The copy is gone after the step.

**The greedy rule** (:func:`transient_choose`, per layer and step, on counts ``w_E``): re-split
``w_E`` over the placement's replicas (:func:`~moebalance.dispatch.resplit_kernel.resplit_layer`,
sweeps then the exact flow); then repeatedly

1. take the slowest device ``h`` (largest load / speed) and its heaviest piece, expert ``e``;
2. two targets for a copy of ``e``: the coolest device with a free transient slot on a node
   that holds ``e`` (the copy crosses the node's own links only) and the coolest such device
   anywhere; neither may hold ``e`` already. A copy costs the links the weights' bytes in
   forward and the gradient's (the same bytes) back in backward: ``2 * bytes / bandwidth``,
   the slower end's bandwidth of the link class;
3. try them in the order of an estimate: ``h`` and the target alone evening out their times
   (at most the piece moving), the drop of ``h``'s expert seconds less what the copy adds to
   the busiest device's link seconds (copies on other links run at the same time);
4. a try re-splits ``w_E`` with the copy as one more replica; take the first copy that saves
   more than it adds to the busiest link, or else the first that shortens the slowest device at
   all (copies that pay only together: after a re-split the slowest level is shared by several
   devices, and one copy lowers it by little); stop when neither target shortens it (no
   re-split where the lower bound, :func:`~moebalance.dispatch.resplit_kernel.resplit_bound`,
   already says it cannot), when the slots run out, when no longer prefix could beat the
   best so far, or :data:`PATIENCE` copies after the best prefix so far;
5. keep the *prefix* of the copies whose net saving, the slowest device's drop less the
   busiest device's link seconds, is largest (none when no prefix saves anything).

The copy comes from a holder of ``e`` on the target's node when there is one, else from ``h``
(always from one of the placement's replicas, never from another copy of the step). An expert
takes at most :data:`MAX_COPIES` transient copies a step (the scratch table's width).
Adding replicas never raises the re-split's optimum, so a step's slowest device never gets
slower than the re-split alone leaves it.

:class:`TransientRouting` applies the rule in the dispatcher: the copies become extra columns of
the layer's replica table and extra *global slots*, numbered after each rank's own (rank ``g``'s
slots, then its ``K`` transient slots), so routing, the row exchange and combine run unchanged on
the extended numbering. :mod:`moebalance.nn.transient` moves the weights and the gradients.

Legend: E experts, X replica columns, G devices, K transient slots per device, C copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..planner._jit import kernel
from .resplit_kernel import (
    RESPLIT_SWEEPS,
    resplit_bound,
    resplit_layer,
    resplit_order,
)

__all__ = ["MAX_COPIES", "transient_choose", "TransientStep", "TransientRouting",
           "default_transient_cost"]

# Transient copies one expert may take in one step (columns added to the replica table).
MAX_COPIES = 16

# The least relative gain a copy or a longer prefix must bring: below it, rounding (which
# differs between the plain and the compiled kernels) would decide.
_GAIN = 1e-9

# Copies the greedy goes on trying past the best prefix so far before it stops: copies that pay
# only together come in short runs, and every try costs a re-split.
PATIENCE = 4


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
    among its first ``n`` replicas (the placement's), else ``h`` (the slowest device; when ``h``
    holds only a copy, the first of those replicas)."""
    for j in range(n):
        if node_G[device_EX[e, j]] == node_G[c]:
            return device_EX[e, j]
    for j in range(n):
        if device_EX[e, j] == h:
            return h
    return device_EX[e, 0]


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
def _link_seconds_of(g, in_2G, out_2G, devices_G5, copy_bytes):
    """Seconds device ``g``'s links carry the copies counted in ``in_2G`` / ``out_2G`` (per link
    class, the busier direction; the weights one way and the gradient back: twice the bytes)."""
    total = 0.0
    for k in range(2):
        busy = max(in_2G[k, g], out_2G[k, g])
        if busy > 0:
            total += busy * 2.0 * copy_bytes / devices_G5[g, 3 + k]
    return total


@kernel
def transient_choose(w_E, device_EX, start_EX, devices_G5, unit, copy_bytes, share_EX, load_G):
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
        share_EX: [E, X] float64, out: the shares of ``w_E`` re-split with the copies (what
            the step's pairs are routed by).
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
    trial_EX = np.empty_like(start_EX)
    trial_G = np.empty(G, dtype=np.float64)
    count_E = np.zeros(E, dtype=np.int64)
    for e in range(E):
        for j in range(X):
            if device_EX[e, j] >= 0:
                count_E[e] += 1
    limit_E = count_E + MAX_COPIES
    copies = np.empty((int(free_G.sum()), 3), dtype=np.int64)
    column_C = np.empty(copies.shape[0], dtype=np.int64)
    made = 0
    _resplit_into(w_E, device_EX, start_EX, speed_G, share_EX, load_G)
    first_time = _slowest_time(load_G, speed_G)
    # the best prefix of the copies so far: its net saving, length, shares and loads
    best_net = 0.0
    best_made = 0
    best_EX = share_EX.copy()
    best_G = load_G.copy()
    # no prefix saves more than the slowest device's excess over a perfect spread
    floor = w_E.sum() / speed_G.sum()
    in_2G = np.zeros((2, G), dtype=np.float64)
    out_2G = np.zeros((2, G), dtype=np.float64)
    links = 0.0            # the busiest device's link seconds for the copies so far
    holds_G = np.zeros(G, dtype=np.bool_)
    near_G = np.zeros(G, dtype=np.bool_)
    while (made < copies.shape[0] and made - best_made < PATIENCE
           and (first_time - floor) * unit - links > best_net):
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
        # out (at most the piece moving), less what the copy adds to the busiest link
        target_2 = np.full(2, -1, dtype=np.int64)
        source_2 = np.full(2, -1, dtype=np.int64)
        cost_2 = np.zeros(2)
        guess_2 = np.zeros(2)
        for which in range(2):
            d = near if which == 0 else far
            if d < 0 or (which == 1 and d == near):
                continue
            # from the placement's replicas only: another copy holds the weights this step
            # alone, too late to pass them on
            s = _source(e, d, h, device_EX, limit_E[e] - MAX_COPIES, node_G)
            k = 0 if node_G[s] == node_G[d] else 1
            target_2[which] = d
            source_2[which] = s
            out_2G[k, s] += 1.0
            in_2G[k, d] += 1.0
            busiest = max(links, _link_seconds_of(s, in_2G, out_2G, devices_G5, copy_bytes),
                          _link_seconds_of(d, in_2G, out_2G, devices_G5, copy_bytes))
            out_2G[k, s] -= 1.0
            in_2G[k, d] -= 1.0
            cost_2[which] = busiest - links
            moved = (load_G[h] * speed_G[d] - load_G[d] * speed_G[h]) / (speed_G[h] + speed_G[d])
            guess_2[which] = min(piece, max(moved, 0.0)) / speed_G[h] * unit - cost_2[which]
        first = 1 if target_2[0] < 0 or (target_2[1] >= 0 and guess_2[1] > guess_2[0]) else 0
        # take the first target that pays for what it adds to the busiest link; failing that,
        # the first that shortens the slowest device at all (copies that pay only together)
        c = -1
        fallback = -1
        fallback_time = now
        n = count_E[e]
        for which in (first, 1 - first):
            d = target_2[which]
            if d < 0:
                continue
            device_EX[e, n] = d
            if resplit_bound(w_E, device_EX, speed_G, load_G) < now * (1.0 - _GAIN):
                _resplit_into(w_E, device_EX, share_EX, speed_G, trial_EX, trial_G)
                t = _slowest_time(trial_G, speed_G)
                if (now - t) * unit > cost_2[which]:
                    c = which
                    break
                if t < fallback_time * (1.0 - _GAIN):
                    fallback = which
                    fallback_time = t
            device_EX[e, n] = -1
        if c < 0:
            if fallback < 0:
                break
            c = fallback
            device_EX[e, n] = target_2[c]
            _resplit_into(w_E, device_EX, share_EX, speed_G, trial_EX, trial_G)
        d = target_2[c]
        s = source_2[c]
        k = 0 if node_G[s] == node_G[d] else 1
        out_2G[k, s] += 1.0
        in_2G[k, d] += 1.0
        links += cost_2[c]
        count_E[e] += 1
        free_G[d] -= 1
        copies[made, 0] = e
        copies[made, 1] = s
        copies[made, 2] = d
        column_C[made] = n
        made += 1
        share_EX[:] = trial_EX
        load_G[:] = trial_G
        net = (first_time - _slowest_time(load_G, speed_G)) * unit - links
        if net > best_net + _GAIN * first_time * unit:
            best_net = net
            best_made = made
            best_EX[:] = share_EX
            best_G[:] = load_G
    # keep the best prefix: the copies after it leave the table
    for i in range(made - 1, best_made - 1, -1):
        device_EX[copies[i, 0], column_C[i]] = -1
    share_EX[:] = best_EX
    load_G[:] = best_G
    return copies[:best_made]


# -- the dispatcher's side ------------------------------------------------------------------------

def _kernels():
    """The transient kernels: compiled where Numba is, else run as plain Python."""
    from ..backends import has_numba
    from ..planner import _jit

    return _jit.kernels("numba" if has_numba() else "numpy")


def default_transient_cost(dtype: torch.dtype, device_type: str) -> float:
    """A rough price of one transient copy, in pairs of expert work at speed 1.

    A copy moves the expert's weights one way in forward and its gradient back in backward,
    ``2 * 3 D F b`` bytes for a SwiGLU expert of ``b``-byte elements, while one pair costs
    ``3 * 6 D F`` flops (forward and backward): the price is ``b * flops / (3 * bandwidth)``
    pairs whatever D and F are. Assumed: on a GPU 400 TFLOP/s against 300 GB/s between GPUs
    (about 900 bf16 pairs), on a CPU 50 GFLOP/s against 2 GB/s through gloo (about 33 fp32
    pairs). Pass the layer's ``transient_cost`` where the job's own figures are known.
    """
    size = torch.empty((), dtype=dtype).element_size()
    flops, bandwidth = (4e14, 3e11) if device_type == "cuda" else (5e10, 2e9)
    return size * flops / (3.0 * bandwidth)


@dataclass(frozen=True)
class TransientStep:
    """The copies of one layer's step, the same on every rank of the group.

    Attributes:
        copies_C3: [C, 3] int64 (expert, source rank, target rank) of every copy, in the
            order chosen.
        slot_C: [C] int64, the copy's transient slot on its target (``0 .. K - 1``).
        column_C: [C] int64, the copy's column in the step's replica table.
        holders_C: per copy, the ranks holding its expert (its gradient goes to each).
        num_slots: K, transient slots per rank.
    """

    copies_C3: np.ndarray
    slot_C: np.ndarray
    column_C: np.ndarray
    holders_C: tuple
    num_slots: int

    @property
    def num_copies(self) -> int:
        return int(self.copies_C3.shape[0])

    def experts_on(self, rank: int) -> list:
        """[K] the expert in each of ``rank``'s transient slots this step (-1: unused)."""
        experts = [-1] * self.num_slots
        for (expert, _, target), k in zip(self.copies_C3.tolist(), self.slot_C.tolist()):
            if target == rank:
                experts[k] = expert
        return experts


class TransientRouting:
    """One layer's replica table with room for transient copies, on the host.

    Args:
        slots_EX, device_EX, share_EX: the layer's replica table (host arrays, -1 / 0 padded).
        slot_offsets: [G + 1] the placement's first slot of every rank (then S).
        num_slots: K transient slots per rank (>= 1).
        speed_G: [G] relative speeds; node_G: [G] node of every rank.
        cost: the price of one copy in pairs of work at speed 1 (see
            :func:`default_transient_cost`).

    Extended slot numbering: placement slot ``s`` of rank ``g`` becomes ``s + g * K`` and rank
    ``g``'s transient slot ``k`` is ``slot_offsets[g + 1] + g * K + k``: every rank's slots stay
    contiguous, its transient ones after its own.
    """

    def __init__(self, slots_EX, device_EX, share_EX, slot_offsets, num_slots: int, speed_G,
                 node_G, cost: float) -> None:
        E, X = device_EX.shape
        G = len(speed_G)
        K = int(num_slots)
        self.num_slots = K
        self.device_EX = np.full((E, X + MAX_COPIES), -1, dtype=np.int64)
        self.device_EX[:, :X] = device_EX
        self.start_EX = np.zeros((E, X + MAX_COPIES), dtype=np.float64)
        self.start_EX[:, :X] = share_EX
        valid = slots_EX >= 0
        self.slots_EX = np.array(slots_EX, dtype=np.int64)
        self.placed_EX = np.where(valid, slots_EX + K * np.maximum(device_EX, 0), -1)
        self.count_E = valid.sum(axis=1)
        self.devices_G5 = np.stack([np.asarray(speed_G, dtype=np.float64),
                                    np.asarray(node_G, dtype=np.float64),
                                    np.full(G, float(K)), np.ones(G), np.ones(G)], axis=1)
        # The kernel prices a copy 2 * bytes / bandwidth seconds and a load unit `unit` seconds;
        # with unit 1 and bandwidth 1 a copy costs 2 * bytes load units: half the price.
        self.copy_bytes = float(cost) / 2.0
        offsets = np.asarray(slot_offsets, dtype=np.int64)
        self.slot_offsets = offsets + np.arange(G + 1, dtype=np.int64) * K
        self.num_global_slots = int(offsets[-1]) + G * K
        self.first_transient = offsets[1:] + np.arange(G, dtype=np.int64) * K

    def choose(self, counts_GE: np.ndarray):
        """The step's copies and the table to route by, from every rank's counts.

        Returns:
            step: the :class:`TransientStep` (None when no copy pays).
            slots_EX, device_EX, share_EX: the extended table (host arrays, the used columns);
            with no copy, slots_EX and device_EX are None (the placement's table stands) and
            share_EX has the table's width.
        """
        w_E = counts_GE.sum(axis=0).astype(np.float64)
        device_EX = self.device_EX.copy()
        share_EX = np.empty_like(self.start_EX)
        load_G = np.empty(self.devices_G5.shape[0], dtype=np.float64)
        copies = _kernels().transient_choose(w_E, device_EX, self.start_EX, self.devices_G5, 1.0,
                                             self.copy_bytes, share_EX, load_G)
        if copies.shape[0] == 0:          # the placement's own table: only the shares change
            return None, None, None, np.ascontiguousarray(share_EX[:, :self.slots_EX.shape[1]])
        width = int((device_EX >= 0).sum(axis=1).max())
        slots_EX = np.full((device_EX.shape[0], width), -1, dtype=np.int64)
        placed = self.placed_EX.shape[1]
        slots_EX[:, :min(placed, width)] = self.placed_EX[:, :width]
        column_E = self.count_E.copy()
        used_G = np.zeros(self.devices_G5.shape[0], dtype=np.int64)
        slot_C = np.empty(copies.shape[0], dtype=np.int64)
        column_C = np.empty(copies.shape[0], dtype=np.int64)
        holders = []
        for c, (expert, _, target) in enumerate(copies.tolist()):
            slot_C[c] = used_G[target]
            used_G[target] += 1
            column_C[c] = column_E[expert]
            slots_EX[expert, column_E[expert]] = self.first_transient[target] + slot_C[c]
            column_E[expert] += 1
            row = self.device_EX[expert]
            holders.append(tuple(int(g) for g in row[row >= 0]))
        step = TransientStep(copies, slot_C, column_C, tuple(holders), self.num_slots)
        return (step, slots_EX, np.ascontiguousarray(device_EX[:, :width]),
                np.ascontiguousarray(share_EX[:, :width]))
