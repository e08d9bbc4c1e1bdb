"""Relabel: a new plan's devices matched to the placement in service, so that few experts move.

A plan built afresh names its devices in its own order. Devices of equal speed and slots are
interchangeable (the device loads are permuted with them, so every step's hottest time, the
window's mean and every other balance figure stay as they are), and so is the order of a
device's slots. :func:`relabel_to` gives each device of the new plan, within its class of
equal devices, the device of the placement in service that already holds most of its experts
(an assignment problem per layer and class, solved exactly by
``scipy.optimize.linear_sum_assignment`` on the overlap counts of :func:`device_overlap`),
then keeps every expert a device already holds in the slot it has now
(:func:`relabel_layer`): the moves, counted as :meth:`moebalance.Placement.moves_from` counts
them, are the fewest any such relabelling reaches.

Kernels (:func:`~._jit.kernel`); ``dev`` is the :class:`~.core.Devices` structure. Shapes: E
experts, G devices, S slots (grouped by device), L layers.
"""

from __future__ import annotations

import numpy as np

from ..topology import Topology
from ._jit import kernel
from .core import devices_of


@kernel
def device_overlap(new_p, old_p, dev, num_experts):
    """[G, G] int64: ``out[g, h]`` experts that device ``g`` holds under ``new_p`` [S] and
    device ``h`` holds under ``old_p`` [S] (each expert counted once per device)."""
    slot_offsets, slot_device = dev.slot_offsets, dev.slot_device
    G = slot_offsets.shape[0] - 1
    # CSR of the devices holding each expert in old_p, one entry per (expert, device)
    seen = np.full(num_experts, -1, dtype=np.int64)
    starts = np.zeros(num_experts + 1, dtype=np.int64)
    for s in range(old_p.shape[0]):
        e = old_p[s]
        if seen[e] != slot_device[s]:
            seen[e] = slot_device[s]
            starts[e + 1] += 1
    for e in range(num_experts):
        starts[e + 1] += starts[e]
    holders = np.empty(starts[num_experts], dtype=np.int64)
    fill = starts[:-1].copy()
    seen[:] = -1
    for s in range(old_p.shape[0]):
        e = old_p[s]
        if seen[e] != slot_device[s]:
            seen[e] = slot_device[s]
            holders[fill[e]] = slot_device[s]
            fill[e] += 1
    out = np.zeros((G, G), dtype=np.int64)
    seen[:] = -1
    for s in range(new_p.shape[0]):
        g = slot_device[s]
        e = new_p[s]
        if seen[e] == g:
            continue
        seen[e] = g
        for i in range(starts[e], starts[e + 1]):
            out[g, holders[i]] += 1
    return out


@kernel
def relabel_layer(new_p, new_s, old_p, dev, target, out_p, out_s):
    """One layer of ``new_p`` / ``new_s`` [S] into ``out_p`` / ``out_s`` [S]: device ``g``'s
    slots go to device ``target[g]`` [G] (equal slots), each expert that device holds under
    ``old_p`` [S] into the slot it has there, the others into the free slots in order."""
    slot_offsets = dev.slot_offsets
    G = slot_offsets.shape[0] - 1
    for g in range(G):
        h = target[g]
        src, dst = slot_offsets[g], slot_offsets[h]
        n = slot_offsets[g + 1] - src
        taken = np.zeros(n, dtype=np.bool_)
        placed = np.zeros(n, dtype=np.bool_)
        for j in range(n):
            e = new_p[src + j]
            for i in range(n):
                if not taken[i] and old_p[dst + i] == e:
                    out_p[dst + i] = e
                    out_s[dst + i] = new_s[src + j]
                    taken[i] = True
                    placed[j] = True
                    break
        i = 0
        for j in range(n):
            if placed[j]:
                continue
            while taken[i]:
                i += 1
            out_p[dst + i] = new_p[src + j]
            out_s[dst + i] = new_s[src + j]
            taken[i] = True


@kernel
def layer_overlaps(new_P, old_P, dev, num_experts):
    """[L, G, G] int64: :func:`device_overlap` of every layer of ``new_P`` / ``old_P`` [L, S]."""
    L = new_P.shape[0]
    G = dev.slot_offsets.shape[0] - 1
    out = np.empty((L, G, G), dtype=np.int64)
    for layer in range(L):
        out[layer] = device_overlap(new_P[layer], old_P[layer], dev, num_experts)
    return out


@kernel
def relabel_layers(new_P, new_S, old_P, dev, target_LG):
    """:func:`relabel_layer` of every layer, device ``g`` of layer ``l`` to ``target_LG[l,
    g]``: (phy2log, share) [L, S]."""
    out_p = np.empty_like(new_P)
    out_s = np.empty_like(new_S)
    for layer in range(new_P.shape[0]):
        relabel_layer(new_P[layer], new_S[layer], old_P[layer], dev, target_LG[layer],
                      out_p[layer], out_s[layer])
    return out_p, out_s


def device_classes(topology: Topology) -> list[np.ndarray]:
    """The devices of ``topology`` grouped by equal (speed, slots): index arrays, ascending,
    of the classes with more than one device (the only ones a relabelling can permute)."""
    keys = {}
    for g, key in enumerate(zip(topology.speed.tolist(), topology.slots.tolist())):
        keys.setdefault(key, []).append(g)
    return [np.array(v, dtype=np.int64) for v in keys.values() if len(v) > 1]


def relabel_to(k, phy2log, share, previous, topology: Topology, layers=None):
    """``phy2log`` / ``share`` [L, S] with, per layer, whole devices permuted within their
    class of equal (speed, slots) and slots within each device, so that as many experts as
    such a permutation allows stay where ``previous`` (a Placement) holds them; the balance is
    the same. Returns new (phy2log, share) [L, S] arrays; with ``layers`` (indices), those
    layers alone: [len(layers), S]."""
    dev = devices_of(topology)
    prev_p = previous.phy2log
    if layers is not None:
        phy2log, share, prev_p = phy2log[layers], share[layers], prev_p[layers]
    # Writable arrays whatever the caller passes (a Placement's are read-only): Numba compiles
    # read-only and writable arguments apart, and each form would cost a job its own compile.
    phy2log, prev_p = (np.require(a, np.int64, ("C", "W")) for a in (phy2log, prev_p))
    share = np.require(share, np.float64, ("C", "W"))
    L = phy2log.shape[0]
    target = np.tile(np.arange(topology.num_devices, dtype=np.int64), (L, 1))
    classes = device_classes(topology)
    if classes:
        # scipy.optimize costs 0.3 s to import: not in every process that imports moebalance
        from scipy.optimize import linear_sum_assignment

        overlap = k.layer_overlaps(phy2log, prev_p, dev, previous.num_experts)
        for members in classes:
            block = (overlap if members.shape[0] == topology.num_devices
                     else overlap[:, members[:, None], members[None, :]])
            for layer in range(L):
                rows, cols = linear_sum_assignment(block[layer], maximize=True)
                target[layer, members[rows]] = members[cols]
    return k.relabel_layers(phy2log, share, prev_p, dev, target)
