"""moebalance's drop-in for DeepSeek EPLB's ``rebalance_experts``: same arguments, same outputs.

It is EPLB's argument checks, then the planner's own steps (:mod:`.core`) with EPLB's equal
split of every expert's tokens over its replicas:

1. Hierarchical policy (``num_groups % num_nodes == 0``): expert groups, heaviest first, to the
   lightest node with room (:func:`~.packing.pack_replicas` on a cluster of nodes), every
   node ``num_groups / num_nodes`` groups. Otherwise one node holds every expert (EPLB's
   "global" policy).
2. On every node, its experts on its GPUs: replica counts (:func:`~.counts.replica_counts`,
   each spare slot to the largest load per replica, at most one replica per GPU), replicas
   heaviest first to the lightest GPU with room that lacks the expert
   (:func:`~.packing.pack_replicas`), then swaps of two replicas between the hottest GPU and
   a lighter one while they lower the hottest (:func:`refine_equal`).
3. EPLB's output conventions: ``phy2log``, ``log2phy`` and ``logcnt``.

Each group's replicas stay on its node in every layer. Where the arguments leave a GPU more
slots than experts to choose from, distinct replicas are impossible: the drop-in then places
duplicates on a GPU as EPLB does, and warns.

Shapes: L layers, E logical experts, R physical replicas (slots), G GPUs, X max replicas.
"""

from __future__ import annotations

import warnings

import numpy as np

from .._check import as_loads, positive_int, to_numpy
from . import _jit
from ._jit import kernel
from .core import alike_devices
from .counts import replica_counts
from .packing import PACK_BY_NEED, PACK_DISTINCT, pack_replicas

# Swaps per node and layer, as a fraction of the node's slots: a bound on the worst case;
# refinement usually stops earlier (no improving swap left).
SWAPS_PER_SLOT = 0.5
# The hottest GPU looks for swap partners among this many of the lightest GPUs of its node.
SWAP_PARTNERS = 8


# -- input checks ---------------------------------------------------------------------------------


def check_arguments(weight, num_replicas, num_groups, num_nodes, num_gpus
                    ) -> tuple[np.ndarray, bool, bool]:
    """EPLB's argument checks. Returns the loads [L, E] float64, whether the policy is
    hierarchical, and whether the arguments force two replicas of one expert on some GPU."""
    raw = to_numpy(weight, "weight")
    if raw.ndim != 2:
        raise ValueError(
            f"weight must have shape [num_layers, num_experts], got shape {tuple(raw.shape)}; "
            f"for a single layer pass weight[None, :]"
        )
    w = as_loads(raw, "weight")
    num_experts = w.shape[1]
    num_replicas = positive_int(num_replicas, "num_replicas")
    num_groups = positive_int(num_groups, "num_groups")
    num_nodes = positive_int(num_nodes, "num_nodes")
    num_gpus = positive_int(num_gpus, "num_gpus")
    if num_replicas < num_experts:
        raise ValueError(
            f"num_replicas ({num_replicas}) must be >= the number of experts ({num_experts}): "
            f"every expert needs at least one replica; add replicas or GPUs"
        )
    if num_replicas % num_gpus:
        raise ValueError(
            f"num_replicas ({num_replicas}) must be a multiple of num_gpus ({num_gpus}): every "
            f"GPU holds num_replicas / num_gpus replicas; use e.g. "
            f"{num_gpus * -(-num_replicas // num_gpus)} replicas"
        )
    if num_gpus % num_nodes:
        raise ValueError(
            f"num_gpus ({num_gpus}) must be a multiple of num_nodes ({num_nodes}): every node "
            f"has the same number of GPUs"
        )
    if num_experts % num_groups:
        raise ValueError(
            f"num_groups ({num_groups}) must divide the number of experts ({num_experts}): "
            f"expert groups have equal sizes; pass num_groups=1 for a model without groups"
        )
    hierarchical = num_groups % num_nodes == 0
    pool = num_experts // num_nodes if hierarchical else num_experts
    forced = num_replicas // num_gpus > pool
    return w, hierarchical, forced


def _duplicate_warning(num_experts, num_replicas, num_groups, num_nodes, num_gpus,
                       hierarchical: bool) -> str:
    per_gpu = num_replicas // num_gpus
    if hierarchical and num_nodes > 1:
        pool = num_experts // num_nodes
        advice = (f"pass num_nodes=1 (the global policy lets a GPU choose from all "
                  f"{num_experts} experts)" if per_gpu <= num_experts else
                  f"use at most {num_experts * num_gpus} replicas")
        where = f"its node has only {pool} experts ({num_groups} groups on {num_nodes} nodes)"
    else:
        where = f"there are only {num_experts} experts"
        advice = f"use at most {num_experts * num_gpus} replicas or more GPUs"
    return (f"each GPU holds {per_gpu} replicas but {where}, so some GPU holds two replicas of "
            f"one expert, as EPLB would place them; to avoid that, {advice}")


# -- kernels --------------------------------------------------------------------------------------


@kernel
def refine_equal(w, count, per_gpu, num_gpus, local, max_swaps):
    """Swap two replicas between the hottest GPU and one of the ``SWAP_PARTNERS`` lightest
    while that lowers the hottest GPU's load (equal split: a replica carries ``w / count``).
    Returns the hottest GPU's load after.

    ``local`` [num_gpus * per_gpu]: expert of every slot, GPU by GPU; swaps never put two
    replicas of one expert on one GPU unless the GPU held two already.
    """
    load = np.zeros(num_gpus, dtype=np.float64)
    for s in range(local.shape[0]):
        load[s // per_gpu] += w[local[s]] / count[local[s]]
    partners = np.empty(min(SWAP_PARTNERS, num_gpus), dtype=np.int64)
    for _ in range(max_swaps + 1):
        hot = 0
        for g in range(1, num_gpus):
            if load[g] > load[hot]:
                hot = g
        if _ == max_swaps:
            return load[hot]
        # the lightest GPUs, lightest first
        n = 0
        for g in range(num_gpus):
            if g == hot:
                continue
            k = n if n < partners.shape[0] else partners.shape[0] - 1
            if n < partners.shape[0] or load[g] < load[partners[k]]:
                while k > 0 and load[partners[k - 1]] > load[g]:
                    partners[k] = partners[k - 1]
                    k -= 1
                partners[k] = g
                n = min(n + 1, partners.shape[0])
        best = load[hot] * (1.0 - 1e-12)
        best_a = -1
        best_b = -1
        for a in range(hot * per_gpu, (hot + 1) * per_gpu):
            pa = w[local[a]] / count[local[a]]
            for i in range(n):
                g = partners[i]
                for b in range(g * per_gpu, (g + 1) * per_gpu):
                    pb = w[local[b]] / count[local[b]]
                    if pb >= pa:
                        continue
                    after = max(load[hot] - pa + pb, load[g] + pa - pb)
                    if after < best and not gpu_holds(local, per_gpu, g, local[a]) and not \
                            gpu_holds(local, per_gpu, hot, local[b]):
                        best = after
                        best_a = a
                        best_b = b
        if best_a < 0:
            return load[hot]
        delta = w[local[best_a]] / count[local[best_a]] - w[local[best_b]] / count[local[best_b]]
        load[hot] -= delta
        load[best_b // per_gpu] += delta
        local[best_a], local[best_b] = local[best_b], local[best_a]
    return load.max()


@kernel
def gpu_holds(local, per_gpu, g, e):
    for s in range(g * per_gpu, (g + 1) * per_gpu):
        if local[s] == e:
            return True
    return False


@kernel
def dropin_layer(w, num_replicas, num_groups, num_nodes, num_gpus, distinct, max_swaps, row):
    """One layer of :func:`rebalance_experts`, written to ``row`` [R]: expert of every slot."""
    E = w.shape[0]
    per_node = E // num_nodes
    slots_per_node = num_replicas // num_nodes
    gpus_per_node = num_gpus // num_nodes
    per_gpu = num_replicas // num_gpus
    group_size = E // num_groups
    # 1. groups to nodes (one group per "slot" of a node), EPLB's balanced packing
    group_w = np.zeros(num_groups, dtype=np.float64)
    for e in range(E):
        group_w[e // group_size] += w[e]
    nodes = alike_devices(num_nodes, num_groups // num_nodes)
    node_offsets = nodes.slot_offsets
    group_at = np.full(num_groups, -1, dtype=np.int64)
    unused = np.empty(num_groups, dtype=np.float64)
    pack_replicas(group_w, np.ones(num_groups, dtype=np.int64), nodes, group_at, unused,
                  PACK_DISTINCT)
    # 2. each node's experts on its GPUs
    experts = np.empty((num_nodes, per_node), dtype=np.int64)
    w_node = np.empty((num_nodes, per_node), dtype=np.float64)
    counts = np.empty((num_nodes, per_node), dtype=np.int64)
    local = np.full((num_nodes, slots_per_node), -1, dtype=np.int64)
    peak = np.zeros(num_nodes, dtype=np.float64)
    gpus = alike_devices(gpus_per_node, per_gpu)
    shares = np.empty(slots_per_node, dtype=np.float64)
    for n in range(num_nodes):
        k = 0
        for j in range(node_offsets[n], node_offsets[n + 1]):
            for i in range(group_size):
                experts[n, k] = group_at[j] * group_size + i
                w_node[n, k] = w[experts[n, k]]
                k += 1
        # -1: every spare slot gets a replica, even of an expert without load (as in EPLB)
        counts[n] = replica_counts(w_node[n], slots_per_node,
                                   gpus_per_node if distinct else slots_per_node, -1.0)
        pack_replicas(w_node[n], counts[n], gpus, local[n], shares,
                      PACK_DISTINCT if distinct else PACK_BY_NEED)
        # a replica no GPU could take (rare): its slot takes the heaviest piece it lacks
        for s in range(slots_per_node):
            if local[n, s] < 0:
                best = -1
                for e in range(per_node):
                    if not gpu_holds(local[n], per_gpu, s // per_gpu, e) and (
                            best < 0 or w_node[n, e] / counts[n, e] > w_node[n, best] / counts[
                                n, best]):
                        best = e
                local[n, s] = best
                counts[n, best] += 1
        for s in range(slots_per_node):
            g = s // per_gpu
            shares[g] = (0.0 if s % per_gpu == 0 else shares[g]) + \
                w_node[n, local[n, s]] / counts[n, local[n, s]]
            peak[n] = max(peak[n], shares[g])
    # swaps only where they can lower the layer's hottest GPU: the hottest node first, then
    # every node still hotter than the layer's hottest GPU after the swaps so far
    layer_peak = 0.0
    for n in np.argsort(-peak, kind="mergesort"):
        if peak[n] > layer_peak:
            layer_peak = max(layer_peak, refine_equal(w_node[n], counts[n], per_gpu,
                                                      gpus_per_node, local[n], max_swaps))
        for s in range(slots_per_node):
            row[n * slots_per_node + s] = experts[n, local[n, s]]


@kernel
def dropin_layers(w_LE, num_replicas, num_groups, num_nodes, num_gpus, distinct, max_swaps):
    """:func:`dropin_layer` for every layer: (phy2log [L,R], log2phy [L,E,R-E+1], logcnt [L,E])."""
    L, E = w_LE.shape
    phy2log = np.empty((L, num_replicas), dtype=np.int64)
    log2phy = np.full((L, E, num_replicas - E + 1), -1, dtype=np.int64)
    logcnt = np.zeros((L, E), dtype=np.int64)
    for layer in range(L):
        dropin_layer(w_LE[layer], num_replicas, num_groups, num_nodes, num_gpus, distinct,
                     max_swaps, phy2log[layer])
        for s in range(num_replicas):
            e = phy2log[layer, s]
            log2phy[layer, e, logcnt[layer, e]] = s
            logcnt[layer, e] += 1
    return phy2log, log2phy, logcnt


def rebalance_experts(weight, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int,
                      *, backend: str | None = None):
    """Drop-in for EPLB's ``rebalance_experts``: same arguments, same output conventions.

    The planner's replica counts and packing with EPLB's equal split (module docstring), in
    compiled kernels: milliseconds per call instead of seconds. No GPU holds two replicas of
    one expert unless the arguments leave it more slots than experts to choose from; then it
    holds duplicates as under EPLB, with a warning. The hierarchical policy (when
    ``num_nodes`` divides ``num_groups``) keeps every group's replicas on one node in every
    layer; otherwise the global policy. Deterministic.

    Args:
        weight: [L, E] load of every logical expert: numpy, torch (CPU or CUDA) or cupy;
            finite, >= 0.
        num_replicas: R, physical expert slots per layer; a multiple of ``num_gpus``, >= E.
        num_groups: expert groups (E is a multiple; 1 for a model without groups).
        num_nodes: server nodes; divides ``num_gpus``.
        num_gpus: G GPUs; GPU g owns slots ``g*R/G .. (g+1)*R/G``.
        backend: "numba" or "numpy" to force an implementation (default: automatic); both give
            identical results.

    Returns:
        phy2log: [L, R] int64, logical expert of every physical slot.
        log2phy: [L, E, X] int64, the slots of every expert in ascending order, -1 padded;
            X = R - E + 1, the most replicas an expert can have.
        logcnt: [L, E] int64, replicas of every expert (>= 1).
        torch tensors on the CPU when ``weight`` is a torch tensor, numpy arrays otherwise.
    """
    w, hierarchical, forced = check_arguments(weight, num_replicas, num_groups, num_nodes,
                                              num_gpus)
    if backend is not None and backend not in ("numba", "numpy"):
        raise ValueError(f"backend must be 'numba', 'numpy' or None, got {backend!r}")
    E = w.shape[1]
    R, G = int(num_replicas), int(num_gpus)
    groups, nodes = (int(num_groups), int(num_nodes)) if hierarchical else (1, 1)
    if forced:
        warnings.warn(_duplicate_warning(E, R, int(num_groups), int(num_nodes), G, hierarchical),
                      stacklevel=2)
    kernels = _jit.kernels(backend)
    max_swaps = max(1, int(SWAPS_PER_SLOT * (R // nodes)))
    phy2log, log2phy, logcnt = kernels.dropin_layers(w, R, groups, nodes, G,
                                                     distinct=not forced, max_swaps=max_swaps)
    if type(weight).__module__.startswith("torch"):
        import torch

        return torch.from_numpy(phy2log), torch.from_numpy(log2phy), torch.from_numpy(logcnt)
    return phy2log, log2phy, logcnt


__all__ = ["rebalance_experts"]
