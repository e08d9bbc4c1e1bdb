"""DeepSeek's EPLB as published, the baseline the planner benchmark compares against.

* :func:`eplb_baseline` is EPLB's method run as the original runs it (Python loops over torch
  tensors): the benchmark times it.
* :func:`eplb_style_plan` stretches the same method to any :class:`~moebalance.Topology` (uneven
  slots per device; speeds ignored, as EPLB ignores them), for clusters EPLB cannot express.
* :func:`placement_from_phy2log` turns EPLB's output into a :class:`~moebalance.Placement`.

These live with the benchmark, not the library: moebalance's own drop-in is
:func:`moebalance.rebalance_experts`.

EPLB's method for one layer, hierarchical when ``num_groups % num_nodes == 0`` (otherwise the
same with one group and one node, the "global" policy):

1. ``balanced_packing`` of expert groups onto nodes: groups heaviest first, each to the lightest
   node that still has room; every node takes ``num_groups / num_nodes`` groups.
2. ``replicate_experts`` inside every node: one replica per expert, then each spare slot to the
   expert with the largest load per replica.
3. ``balanced_packing`` of the node's replicas (load = expert load / replicas) onto its GPUs,
   ``num_replicas / num_gpus`` each. GPU ``g`` owns physical slots ``g*R/G .. (g+1)*R/G``.

Shapes: L layers, E logical experts, R physical replicas (slots), G GPUs, X max replicas of one
expert, N items of a packing problem.
"""

from __future__ import annotations

import numpy as np

from .._check import positive_int, to_numpy
from ..placement import Placement
from ..planner.eplb import check_arguments
from ..topology import Topology, planning_loads

# -- the baseline: EPLB as published, plain Python loops over torch tensors ------------------------
# Like the original, the loops index torch tensors element by element: that is where EPLB spends
# its time, so timing this baseline times EPLB.


def _balanced_packing(weight_XN, num_packs: int):
    """EPLB's ``balanced_packing``: N items into ``num_packs`` packs of exactly N/num_packs items.

    Items go heaviest first (ties: lower index first) to the lightest pack with room (ties: lower
    pack). With one item per pack EPLB does not sort: item i stays in pack i.

    Args:
        weight_XN: [X, N] float32 torch tensor, the weight of every item, X independent rows.
        num_packs: number of packs; divides N.

    Returns:
        pack_XN: [X, N] int64 tensor, the pack of every item.
        rank_XN: [X, N] int64 tensor, the item's position in its pack (order of arrival).
    """
    import torch

    rows, n = weight_XN.shape
    per_pack = n // num_packs
    if per_pack == 1:
        return (torch.arange(n, dtype=torch.int64).expand(rows, n),
                torch.zeros((rows, n), dtype=torch.int64))
    order_XN = torch.sort(weight_XN, dim=-1, descending=True, stable=True).indices
    pack_XN = torch.full((rows, n), -1, dtype=torch.int64)
    rank_XN = torch.full((rows, n), -1, dtype=torch.int64)
    for x in range(rows):
        pack_weight = [torch.zeros((), dtype=torch.float32)] * num_packs
        pack_items = [0] * num_packs
        for item in order_XN[x]:
            best = -1
            for p in range(num_packs):
                if pack_items[p] < per_pack and (best < 0 or pack_weight[p] < pack_weight[best]):
                    best = p
            pack_XN[x, item] = best
            rank_XN[x, item] = pack_items[best]
            pack_weight[best] = pack_weight[best] + weight_XN[x, item]  # float32, as EPLB sums
            pack_items[best] += 1
    return pack_XN, rank_XN


def _replicate_experts(weight_XN, num_phy: int):
    """EPLB's ``replicate_experts``: N experts to ``num_phy`` replicas, minimising the largest
    load per replica (each spare replica to the expert with the largest load per replica).

    Args:
        weight_XN: [X, N] float32 torch tensor of loads.
        num_phy: replicas in total per row, >= N.

    Returns:
        phy2log_XP: [X, num_phy] int64, expert of each replica (the first N are experts 0..N-1).
        rank_XP: [X, num_phy] int64, the replica's number among its expert's replicas.
        logcnt_XN: [X, N] int64, replicas of each expert.
    """
    import torch

    rows, num_log = weight_XN.shape
    phy2log_XP = torch.arange(num_phy, dtype=torch.int64).repeat(rows, 1)
    rank_XP = torch.zeros((rows, num_phy), dtype=torch.int64)
    logcnt_XN = torch.ones((rows, num_log), dtype=torch.int64)
    row = torch.arange(rows)
    for slot in range(num_log, num_phy):
        # argmax returns the first maximum: ties go to the lowest expert, as in EPLB.
        pick = torch.argmax(weight_XN / logcnt_XN, dim=-1)
        phy2log_XP[:, slot] = pick
        rank_XP[:, slot] = logcnt_XN[row, pick]
        logcnt_XN[row, pick] += 1
    return phy2log_XP, rank_XP, logcnt_XN


def _inverse_permutation(perm_XN):
    import torch

    inv = torch.empty_like(perm_XN)
    inv.scatter_(1, perm_XN, torch.arange(perm_XN.shape[1]).expand(perm_XN.shape))
    return inv


def _eplb_hierarchical(w32_LE, num_replicas: int, num_groups: int, num_nodes: int,
                       num_gpus: int):
    """EPLB's three steps for all layers of ``w32_LE`` [L, E] (float32 tensor). Returns
    phy2log [L, R], phyrank [L, R] and logcnt [L, E], int64 tensors."""
    import torch

    L, E = w32_LE.shape
    group_size = E // num_groups
    groups_per_node = num_groups // num_nodes
    per_gpu = num_replicas // num_gpus
    experts_per_node = E // num_nodes
    replicas_per_node = num_replicas // num_nodes

    # Step 1: groups to nodes. "mlog" numbers experts node by node, group by group. Group totals
    # are summed left to right in float64, then rounded: the compiled twin sums the same way.
    grouped = w32_LE.reshape(L, num_groups, group_size).double()
    group_w = torch.cumsum(grouped, dim=-1)[..., -1].float()
    group_pack, group_rank = _balanced_packing(group_w, num_nodes)
    first_mlog = (group_pack * groups_per_node + group_rank) * group_size
    log2mlog = (first_mlog.unsqueeze(-1) + torch.arange(group_size)).reshape(L, E)
    mlog2log = _inverse_permutation(log2mlog)

    # Step 2: replicas inside every node; rows are (layer, node) pairs.
    w_mlog = w32_LE.gather(-1, mlog2log).reshape(-1, experts_per_node)
    phy2mlog, phyrank, mlogcnt = _replicate_experts(w_mlog, replicas_per_node)

    # Step 3: replicas to the node's GPUs, equal split of every expert's load.
    w_phy = (w_mlog / mlogcnt).gather(-1, phy2mlog)
    gpu, rank = _balanced_packing(w_phy, num_gpus // num_nodes)
    pphy2phy = _inverse_permutation(gpu * per_gpu + rank)
    pphy2mlog = phy2mlog.gather(-1, pphy2phy).reshape(L, num_nodes, -1)
    pphy2mlog = (pphy2mlog + (torch.arange(num_nodes) * experts_per_node).view(1, -1, 1))
    phy2log = mlog2log.gather(-1, pphy2mlog.reshape(L, -1))
    pphyrank = phyrank.gather(-1, pphy2phy).reshape(L, -1)
    logcnt = mlogcnt.reshape(L, E).gather(-1, log2mlog)
    return phy2log, pphyrank, logcnt


def eplb_baseline(weight, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """DeepSeek EPLB's ``rebalance_experts``, as published: the baseline benchmarks run and time.

    Deliberately the original's loops over torch tensors (it is the figure moebalance is timed
    against, seconds per call at DeepSeek-V3 size), and deliberately its flaws: it may put two
    replicas of one expert on one GPU, and it ignores the placement in service. Arithmetic is
    float32, as in EPLB. EPLB's unstable ``torch.sort`` leaves the order of equal weights to the
    implementation; here equal weights keep index order. So ``phy2log`` and ``logcnt`` equal
    EPLB's whenever no two different items it sorts weigh the same, and ``log2phy`` lists the
    same slots for every expert, possibly in another order among its equal replicas.

    Args:
        weight: [L, E] load of every logical expert (numpy, torch or cupy; finite, >= 0).
        num_replicas: R, physical expert slots per layer; a multiple of ``num_gpus``, >= E.
        num_groups: expert groups (E is a multiple); hierarchical policy when ``num_nodes``
            divides it, else the global policy (one group, one node).
        num_nodes: server nodes; divides ``num_gpus``.
        num_gpus: G GPUs; GPU g owns slots ``g*R/G .. (g+1)*R/G``.

    Returns:
        phy2log: [L, R] int64, logical expert of every physical slot.
        log2phy: [L, E, X] int64, the slots of every expert by replica rank, -1 padded;
            X = the most replicas any expert has (EPLB's convention).
        logcnt: [L, E] int64, replicas of every expert.
    """
    import torch

    w, hierarchical, _ = check_arguments(weight, num_replicas, num_groups, num_nodes, num_gpus)
    L, E = w.shape
    w32 = torch.from_numpy(w.astype(np.float32))
    groups, nodes = (int(num_groups), int(num_nodes)) if hierarchical else (1, 1)
    phy2log, phyrank, logcnt = _eplb_hierarchical(w32, int(num_replicas), groups, nodes,
                                                  int(num_gpus))
    phy2log, phyrank, logcnt = phy2log.numpy(), phyrank.numpy(), logcnt.numpy()
    log2phy = np.full((L, E, int(logcnt.max())), -1, dtype=np.int64)
    log2phy[np.arange(L)[:, None], phy2log, phyrank] = np.arange(int(num_replicas))[None, :]
    return phy2log, log2phy, logcnt


# -- EPLB-style planning on any topology ---------------------------------------------------------


def _capped_counts(w_LE: np.ndarray, num_slots: int, cap: int) -> np.ndarray:
    """[L, E] int64 replicas: one each, then every spare slot to the expert with the largest load
    per replica among those with fewer than ``cap`` replicas (ties: lowest expert)."""
    L, E = w_LE.shape
    counts = np.ones((L, E), dtype=np.int64)
    row = np.arange(L)
    for _ in range(num_slots - E):
        ratio = np.where(counts < cap, w_LE / counts, -np.inf)
        counts[row, np.argmax(ratio, axis=1)] += 1
    return counts


def _pack_on_devices(w_E: np.ndarray, counts_E: np.ndarray, slots_G: np.ndarray) -> np.ndarray:
    """One layer of EPLB-style packing on devices with ``slots_G`` slots each; returns the
    experts of all slots [S], device by device. ``counts_E`` is updated in place.

    Replicas go heaviest first to the least loaded device with a free slot that does not hold
    their expert yet. A replica no device can take (rare: every device with room already holds
    it) is dropped, and each slot left empty takes a replica of the expert its device lacks with
    the largest load per replica.
    """
    E, G = len(w_E), len(slots_G)
    experts = np.repeat(np.arange(E), counts_E)
    order = np.argsort(-(w_E / counts_E)[experts], kind="stable")
    load = [0.0] * G
    free = [int(k) for k in slots_G]
    content: list[list[int]] = [[] for _ in range(G)]
    held: list[set[int]] = [set() for _ in range(G)]
    for r in order:
        e = int(experts[r])
        best = -1
        for g in range(G):
            if free[g] and e not in held[g] and (best < 0 or load[g] < load[best]):
                best = g
        if best < 0:
            counts_E[e] -= 1
            continue
        content[best].append(e)
        held[best].add(e)
        free[best] -= 1
        load[best] += w_E[e] / counts_E[e]
    for g in range(G):
        for _ in range(free[g]):
            f = max((e for e in range(E) if e not in held[g]), key=lambda e: w_E[e] / counts_E[e])
            content[g].append(f)
            held[g].add(f)
            counts_E[f] += 1
    return np.array([e for g in range(G) for e in content[g]], dtype=np.int64)


def eplb_style_plan(loads, topology: Topology) -> Placement:
    """EPLB's method generalised to any topology: the baseline for workloads EPLB cannot express.

    Replica counts as EPLB's ``replicate_experts`` (at most one replica per device), equal token
    split, then replicas heaviest first to the least loaded device (by tokens: speeds are
    ignored, as EPLB ignores them) that has a free slot and no replica of that expert yet. No
    previous placement is used. Plain Python, like EPLB.

    Args:
        loads: [L, E] load of every logical expert (numpy, torch or cupy; finite, >= 0).
        topology: the devices; needs E <= topology.num_slots and no device with more than E slots.

    Returns:
        A validated :class:`~moebalance.Placement` with equal shares.
    """
    w = planning_loads(loads, topology)
    L, E = w.shape
    S = topology.num_slots
    counts = _capped_counts(w, S, topology.num_devices)
    phy2log = np.empty((L, S), dtype=np.int64)
    share = np.empty((L, S), dtype=np.float64)
    for layer in range(L):
        phy2log[layer] = _pack_on_devices(w[layer], counts[layer], topology.slots)
        share[layer] = 1.0 / counts[layer][phy2log[layer]]
    return Placement(phy2log=phy2log, share=share, slot_device=topology.slot_device,
                     num_experts=E).validate(topology)


def placement_from_phy2log(phy2log, num_experts: int, topology: Topology) -> Placement:
    """A :class:`~moebalance.Placement` of EPLB's ``phy2log`` [L, S] with equal shares.

    Not validated: EPLB may put two replicas of one expert on one device, and the benchmarks
    measure its placements as they are (the balance metrics work on any placement).

    Args:
        phy2log: [L, S] integer logical expert of every slot, S = topology.num_slots.
        num_experts: E; every entry of ``phy2log`` is in [0, E).
        topology: the devices the slots belong to (slots grouped by device).
    """
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be a moebalance.Topology, got {type(topology).__name__}")
    p = to_numpy(phy2log, "phy2log")
    if p.ndim != 2 or p.shape[1] != topology.num_slots:
        raise ValueError(f"phy2log must have shape [num_layers, {topology.num_slots}] (the "
                         f"topology's slots), got {tuple(p.shape)}")
    if not np.issubdtype(p.dtype, np.integer):
        raise TypeError(f"phy2log must hold integer expert ids, got dtype {p.dtype}")
    num_experts = positive_int(num_experts, "num_experts")
    if p.size and (p.min() < 0 or p.max() >= num_experts):
        raise ValueError(f"phy2log entries must be expert ids in [0, {num_experts}), found "
                         f"{int(p.min())}..{int(p.max())}")
    p = p.astype(np.int64)
    share = np.empty(p.shape, dtype=np.float64)
    for layer in range(p.shape[0]):
        counts = np.bincount(p[layer], minlength=num_experts)
        share[layer] = 1.0 / counts[p[layer]]
    return Placement(phy2log=p, share=share, slot_device=topology.slot_device,
                     num_experts=num_experts)


__all__ = ["eplb_baseline", "eplb_style_plan", "placement_from_phy2log"]
