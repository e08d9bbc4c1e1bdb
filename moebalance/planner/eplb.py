"""EPLB, DeepSeek's expert-parallel load balancer: the baseline, and moebalance's drop-in for it.

* :func:`eplb_baseline` is EPLB's published method, run as the original runs it (Python loops
  over torch tensors). Benchmarks time it and compare against it.
* :func:`eplb_style_plan` stretches the same method to any :class:`~moebalance.Topology` (uneven
  slots per device; speeds ignored, as EPLB ignores them), for workloads EPLB cannot express.
  :func:`placement_from_phy2log` turns EPLB's output into a :class:`~moebalance.Placement`.
* :func:`rebalance_experts` is a drop-in for EPLB's entry point: same arguments, same output
  conventions, but never two replicas of one expert on one GPU, a hottest GPU no hotter than
  EPLB's wherever EPLB's own plan is valid, and compiled kernels (milliseconds, not seconds).

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

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .._arrays import as_loads, planning_loads, to_numpy
from ..backends import backend as _choose_backend
from ..placement import Placement
from ..topology import Topology
from . import _jit
from ._jit import kernel
from .algorithm import heap_pop, heap_push

# A swap must lower the hottest GPU by more than this fraction of its load: rounding noise is
# never taken for progress, so refinement always ends.
MIN_RELATIVE_GAIN = 1e-12
# Refinement swaps per node and layer, as a fraction of the node's slots: a bound on the worst
# case; refinement usually stops earlier (no improving swap left).
SWAPS_PER_SLOT = 0.5
# The hottest GPU looks for swap partners among this many of the lightest GPUs of its node.
SWAP_PARTNERS = 8
# Compiled planning of many layers runs on up to MAX_THREADS threads, at least this many layers
# each (fewer would cost more in hand-offs than they save).
MAX_THREADS = 8
MIN_LAYERS_PER_THREAD = 8
# Below this many bins (packs, GPUs) or spare slots a linear scan finds the lightest bin or the
# largest load per replica faster than a heap; results are the same either way.
SCAN_LIMIT = 16


# -- input checks ---------------------------------------------------------------------------------


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def _check_arguments(weight, num_replicas, num_groups, num_nodes, num_gpus,
                     distinct: bool) -> tuple[np.ndarray, bool]:
    """Validate EPLB's arguments; return the loads [L, E] float64 and whether the policy is
    hierarchical. ``distinct``: also require room for no two replicas of one expert per GPU."""
    raw = to_numpy(weight, "weight")
    if raw.ndim != 2:
        raise ValueError(
            f"weight must have shape [num_layers, num_experts], got shape {tuple(raw.shape)}; "
            f"for a single layer pass weight[None, :]"
        )
    w = as_loads(raw, "weight")
    num_experts = w.shape[1]
    num_replicas = _positive_int(num_replicas, "num_replicas")
    num_groups = _positive_int(num_groups, "num_groups")
    num_nodes = _positive_int(num_nodes, "num_nodes")
    num_gpus = _positive_int(num_gpus, "num_gpus")
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
    if distinct:
        per_gpu = num_replicas // num_gpus
        if hierarchical:
            pool = num_experts // num_nodes
            if per_gpu > pool:
                raise ValueError(
                    f"each GPU holds {per_gpu} replicas but its node has only {pool} experts "
                    f"(hierarchical policy: {num_groups} groups on {num_nodes} nodes), so some GPU "
                    f"would hold two replicas of one expert; use fewer replicas per GPU "
                    f"(at most {pool * num_gpus} in total) or num_nodes=1 for the global policy"
                )
        elif per_gpu > num_experts:
            raise ValueError(
                f"each GPU holds {per_gpu} replicas but there are only {num_experts} experts, so "
                f"some GPU would hold two replicas of one expert; use at most "
                f"{num_experts * num_gpus} replicas or more GPUs"
            )
    return w, hierarchical


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

    w, hierarchical = _check_arguments(weight, num_replicas, num_groups, num_nodes, num_gpus,
                                       distinct=False)
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
    num_experts = _positive_int(num_experts, "num_experts")
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


# -- kernels: EPLB itself, one layer (float32, the same choices as the baseline) -------------------


@kernel
def eplb_pack(weight, num_packs, pack_of, rank_of):
    """EPLB's balanced packing of one row: ``weight`` [N] float32 into ``num_packs`` packs;
    writes ``pack_of`` [N] and ``rank_of`` [N]. The lightest pack with room (ties: lowest pack)
    is found by a scan over few packs, by a heap over many: the same choice as EPLB's scan."""
    n = weight.shape[0]
    per_pack = n // num_packs
    if per_pack == 1:
        for i in range(n):
            pack_of[i] = i
            rank_of[i] = 0
        return
    order = np.argsort(-weight, kind="mergesort")
    items = np.zeros(num_packs, dtype=np.int64)
    packed = np.zeros(num_packs, dtype=np.float32)
    if num_packs <= SCAN_LIMIT:
        for item in order:
            p = -1
            for q in range(num_packs):
                if items[q] < per_pack and (p < 0 or packed[q] < packed[p]):
                    p = q
            pack_of[item] = p
            rank_of[item] = items[p]
            items[p] += 1
            packed[p] += weight[item]  # float32, as EPLB sums
        return
    keys = np.empty(num_packs, dtype=np.float32)  # minus the pack's weight: lightest on top
    ids = np.empty(num_packs, dtype=np.int64)
    size = 0
    for p in range(num_packs):
        size = heap_push(keys, ids, size, np.float32(0.0), p)
    for item in order:
        p = ids[0]
        size = heap_pop(keys, ids, size)
        pack_of[item] = p
        rank_of[item] = items[p]
        items[p] += 1
        packed[p] += weight[item]
        if items[p] < per_pack:
            size = heap_push(keys, ids, size, -packed[p], p)


@kernel
def eplb_replicate(weight, num_phy, phy2log, count):
    """EPLB's replication of one row: ``weight`` [N] float32 to ``num_phy`` replicas; writes the
    expert of every replica ``phy2log`` [num_phy] and ``count`` [N]. Each spare replica goes to
    the largest load per replica (ties: lowest expert), EPLB's argmax: found by a scan when
    there are few spare replicas, by a heap when there are many."""
    n = weight.shape[0]
    ratio = np.empty(n, dtype=np.float32)
    for e in range(n):
        phy2log[e] = e
        count[e] = 1
        ratio[e] = weight[e]
    if num_phy - n <= SCAN_LIMIT:
        for slot in range(n, num_phy):
            e = 0
            for f in range(1, n):
                if ratio[f] > ratio[e]:
                    e = f
            phy2log[slot] = e
            count[e] += 1
            ratio[e] = weight[e] / np.float32(count[e])
        return
    keys = np.empty(n, dtype=np.float32)
    ids = np.empty(n, dtype=np.int64)
    size = 0
    for e in range(n):
        size = heap_push(keys, ids, size, ratio[e], e)
    for slot in range(n, num_phy):
        e = ids[0]
        size = heap_pop(keys, ids, size)
        phy2log[slot] = e
        count[e] += 1
        size = heap_push(keys, ids, size, weight[e] / np.float32(count[e]), e)


@kernel
def eplb_layer(w32, num_replicas, num_groups, num_nodes, num_gpus, row, mlog2log):
    """EPLB's plan of one layer: ``w32`` [E] float32 -> ``row`` [R] expert of every slot, and
    ``mlog2log`` [E] the experts of node n at ``n*E/num_nodes ..`` (group by group)."""
    E = w32.shape[0]
    group_size = E // num_groups
    groups_per_node = num_groups // num_nodes
    per_node = E // num_nodes
    slots_per_node = num_replicas // num_nodes
    per_gpu = num_replicas // num_gpus
    group_w = np.empty(num_groups, dtype=np.float32)
    for g in range(num_groups):
        total = 0.0
        for k in range(group_size):
            total += np.float64(w32[g * group_size + k])
        group_w[g] = np.float32(total)
    group_node = np.empty(num_groups, dtype=np.int64)
    group_rank = np.empty(num_groups, dtype=np.int64)
    eplb_pack(group_w, num_nodes, group_node, group_rank)
    for g in range(num_groups):
        first = (group_node[g] * groups_per_node + group_rank[g]) * group_size
        for k in range(group_size):
            mlog2log[first + k] = g * group_size + k
    w_node = np.empty(per_node, dtype=np.float32)
    phy2mlog = np.empty(slots_per_node, dtype=np.int64)
    count = np.empty(per_node, dtype=np.int64)
    w_phy = np.empty(slots_per_node, dtype=np.float32)
    gpu = np.empty(slots_per_node, dtype=np.int64)
    rank = np.empty(slots_per_node, dtype=np.int64)
    for n in range(num_nodes):
        for i in range(per_node):
            w_node[i] = w32[mlog2log[n * per_node + i]]
        eplb_replicate(w_node, slots_per_node, phy2mlog, count)
        for p in range(slots_per_node):
            w_phy[p] = w_node[phy2mlog[p]] / np.float32(count[phy2mlog[p]])
        eplb_pack(w_phy, num_gpus // num_nodes, gpu, rank)
        for p in range(slots_per_node):
            row[n * slots_per_node + gpu[p] * per_gpu + rank[p]] = mlog2log[n * per_node
                                                                            + phy2mlog[p]]


@kernel
def eplb_layers(w32_LE, num_replicas, num_groups, num_nodes, num_gpus):
    """[L, R] EPLB's phy2log for every layer (the compiled twin of :func:`eplb_baseline`)."""
    L, E = w32_LE.shape
    phy2log = np.empty((L, num_replicas), dtype=np.int64)
    mlog2log = np.empty(E, dtype=np.int64)
    for layer in range(L):
        eplb_layer(w32_LE[layer], num_replicas, num_groups, num_nodes, num_gpus, phy2log[layer],
                   mlog2log)
    return phy2log


# -- kernels: the drop-in (float64, at most one replica of an item per bin) ------------------------
# A "bin" is a GPU (or, when packing groups, a node) with ``per_bin`` slots; bin b owns slots
# b*per_bin .. (b+1)*per_bin. ``slot_item`` [num_bins*per_bin] holds the item of every slot (-1:
# empty), ``has`` [num_bins, N] says which bins hold which items, ``count`` [N] the replicas of
# every item; a replica of item i carries load ``w[i] / count[i]``.


@kernel
def eplb_capped_counts(w, num_slots, cap, count):
    """Replicas per item: one each, then every spare slot to the item with the largest load per
    replica among those with fewer than ``cap`` (ties: lowest item). Needs num_slots <= cap*N.
    A scan finds that item when there are few spare slots, a heap when there are many."""
    n = w.shape[0]
    ratio = np.empty(n, dtype=np.float64)
    for i in range(n):
        count[i] = 1
        ratio[i] = w[i]
    if num_slots - n <= SCAN_LIMIT:
        for _ in range(num_slots - n):
            best = -1
            for i in range(n):
                if count[i] < cap and (best < 0 or ratio[i] > ratio[best]):
                    best = i
            count[best] += 1
            ratio[best] = w[best] / count[best]
        return
    keys = np.empty(n, dtype=np.float64)
    ids = np.empty(n, dtype=np.int64)
    size = 0
    if cap > 1:
        for i in range(n):
            size = heap_push(keys, ids, size, ratio[i], i)
    for _ in range(num_slots - n):
        i = ids[0]
        size = heap_pop(keys, ids, size)
        count[i] += 1
        if count[i] < cap:
            size = heap_push(keys, ids, size, w[i] / count[i], i)


@kernel
def eplb_align_counts(w, count, num_bins, cap, trim_earlier):
    """Make the ``num_bins`` heaviest replicas belong to whole items; False if already so.

    Without duplicates, the replica that overflows the first layer (one replica per bin) must
    share a bin with a heavy replica of ANOTHER item: when the item e* straddling that boundary
    has heavy replicas, trim e* to fit (``trim_earlier`` False) or trim the items before it
    (True), and hand the freed slots to items outside the first layer. ``count`` [N] is changed
    in place (also when False is returned: pass a copy).
    """
    n = w.shape[0]
    ratio = np.empty(n, dtype=np.float64)
    total = 0.0
    for i in range(n):
        ratio[i] = w[i] / count[i]
        total += w[i]
    order = np.argsort(-ratio, kind="mergesort")
    placed = 0
    pos = -1
    for k in range(n):
        if placed + count[order[k]] > num_bins:
            pos = k
            break
        placed += count[order[k]]
    if pos < 0 or placed == num_bins:
        return False
    e = order[pos]
    if 2.0 * ratio[e] * num_bins <= total:
        return False  # two such replicas fit under the mean bin load: nothing to gain
    excess = placed + count[e] - num_bins
    if trim_earlier:
        spare = 0
        for k in range(pos):
            spare += count[order[k]] - 1
        if spare < excess:
            return False
        need = excess
        for k in range(pos - 1, -1, -1):
            f = order[k]
            take = min(need, count[f] - 1)
            count[f] -= take
            need -= take
    else:
        count[e] -= excess
    in_layer = np.zeros(n, dtype=np.bool_)
    for k in range(pos + 1):
        in_layer[order[k]] = True
    for _ in range(excess):
        best = -1
        best_ratio = 0.0
        for i in range(n):
            if not in_layer[i] and count[i] < cap:
                r = w[i] / count[i]
                if best < 0 or r > best_ratio:
                    best = i
                    best_ratio = r
        if best < 0:
            return False
        count[best] += 1
    return True


@kernel
def eplb_pack_distinct(w, count, num_bins, per_bin, slot_item, has):
    """Replicas heaviest first, each to the lightest bin with a free slot that lacks its item
    (ties: lowest bin): a scan over few bins, a heap over many.

    A replica no bin can take (every bin with room holds its item already) is dropped from
    ``count``; :func:`eplb_fill_free` later fills the slot it leaves empty.
    """
    n = w.shape[0]
    total = num_bins * per_bin
    rep_item = np.empty(total, dtype=np.int64)
    rep_load = np.empty(total, dtype=np.float64)
    k = 0
    for i in range(n):
        for _ in range(count[i]):
            rep_item[k] = i
            rep_load[k] = w[i] / count[i]
            k += 1
    order = np.argsort(-rep_load, kind="mergesort")
    fill = np.zeros(num_bins, dtype=np.int64)
    load = np.zeros(num_bins, dtype=np.float64)
    slot_item[:] = -1
    has[:, :] = False
    if num_bins <= SCAN_LIMIT:
        for r in order:
            i = rep_item[r]
            best = -1
            for b in range(num_bins):
                if fill[b] < per_bin and not has[b, i] and (best < 0 or load[b] < load[best]):
                    best = b
            if best < 0:
                count[i] -= 1
                continue
            slot_item[best * per_bin + fill[best]] = i
            fill[best] += 1
            has[best, i] = True
            load[best] += rep_load[r]
        return
    # Bins with room in a heap keyed by minus their load; bins that hold the item are set aside.
    keys = np.empty(num_bins, dtype=np.float64)
    ids = np.empty(num_bins, dtype=np.int64)
    aside_keys = np.empty(num_bins, dtype=np.float64)
    aside_ids = np.empty(num_bins, dtype=np.int64)
    size = 0
    for b in range(num_bins):
        size = heap_push(keys, ids, size, 0.0, b)
    for r in order:
        i = rep_item[r]
        best = -1
        aside = 0
        while size > 0:
            b = ids[0]
            if not has[b, i]:
                best = b
                size = heap_pop(keys, ids, size)
                break
            aside_keys[aside] = keys[0]
            aside_ids[aside] = b
            aside += 1
            size = heap_pop(keys, ids, size)
        for a in range(aside):
            size = heap_push(keys, ids, size, aside_keys[a], aside_ids[a])
        if best < 0:
            count[i] -= 1
            continue
        slot_item[best * per_bin + fill[best]] = i
        fill[best] += 1
        has[best, i] = True
        load[best] += rep_load[r]
        if fill[best] < per_bin:
            size = heap_push(keys, ids, size, -load[best], best)


@kernel
def eplb_dedupe(w, count, num_bins, per_bin, slot_item, has):
    """Give every second replica of an item in one bin a bin of its own, keeping ``count``.

    ``slot_item`` [num_bins*per_bin] may hold an item twice in a bin (EPLB's plans do). Each such
    replica swaps with a replica of another item in another bin where neither then holds two
    copies, choosing the swap that leaves the lower maximum of the two bins' loads. When no swap
    exists the replica is dropped from ``count`` and its slot emptied (for
    :func:`eplb_fill_free`). Sets ``has`` [num_bins, N]; returns whether there were duplicates.
    """
    n = w.shape[0]
    copies = np.zeros((num_bins, n), dtype=np.int64)
    load = np.zeros(num_bins, dtype=np.float64)
    for s in range(num_bins * per_bin):
        b = s // per_bin
        copies[b, slot_item[s]] += 1
        load[b] += w[slot_item[s]] / count[slot_item[s]]
    found = False
    for a in range(num_bins * per_bin):
        g = a // per_bin
        i = slot_item[a]
        if copies[g, i] < 2:
            continue
        found = True
        load_i = w[i] / count[i]
        best = -1
        best_cost = np.inf
        for s in range(num_bins * per_bin):
            h = s // per_bin
            j = slot_item[s]
            if h == g or copies[h, i] > 0 or copies[g, j] > 0:
                continue
            d = load_i - w[j] / count[j]
            cost = max(load[g] - d, load[h] + d)
            if cost < best_cost:
                best_cost = cost
                best = s
        copies[g, i] -= 1
        if best < 0:
            slot_item[a] = -1
            count[i] -= 1
            continue
        h = best // per_bin
        j = slot_item[best]
        d = load_i - w[j] / count[j]
        slot_item[a] = j
        slot_item[best] = i
        copies[g, j] += 1
        copies[h, j] -= 1
        copies[h, i] += 1
        load[g] -= d
        load[h] += d
    for b in range(num_bins):
        for i in range(n):
            has[b, i] = copies[b, i] > 0
    return found


@kernel
def eplb_drop_duplicates(count, per_bin, slot_item, has):
    """Empty every slot holding a second copy of an item in its bin (dropped from ``count``),
    for :func:`eplb_fill_free` to refill. Sets ``has`` [num_bins, N]."""
    has[:, :] = False
    for s in range(slot_item.shape[0]):
        b = s // per_bin
        i = slot_item[s]
        if has[b, i]:
            slot_item[s] = -1
            count[i] -= 1
        else:
            has[b, i] = True


@kernel
def eplb_fill_free(w, count, per_bin, slot_item, has):
    """Every empty slot takes a replica of the item its bin lacks with the largest load per
    replica. (A bin with an empty slot holds fewer than per_bin <= N items, so one is missing.)"""
    n = w.shape[0]
    for s in range(slot_item.shape[0]):
        if slot_item[s] >= 0:
            continue
        b = s // per_bin
        best = -1
        best_ratio = 0.0
        for i in range(n):
            if not has[b, i]:
                ratio = w[i] / count[i]
                if best < 0 or ratio > best_ratio:
                    best = i
                    best_ratio = ratio
        slot_item[s] = best
        has[b, best] = True
        count[best] += 1


@kernel
def eplb_bin_load(w, count, per_bin, slot_item, b):
    """Load of bin ``b``, summed slot by slot (the order the balance metrics sum in)."""
    total = 0.0
    for s in range(b * per_bin, (b + 1) * per_bin):
        total += w[slot_item[s]] / count[slot_item[s]]
    return total


@kernel
def eplb_swap_refine(w, count, num_bins, per_bin, slot_item, has, max_swaps, floor):
    """Lower the heaviest bin while possible, or until it is no heavier than ``floor``: swap
    one of its replicas with a lighter replica of one of the ``SWAP_PARTNERS`` lightest bins
    (neither bin may end with two replicas of one item), taking the swap that leaves the lower
    of the two bins' new loads. Returns the heaviest bin's load at the end.

    A swap with a bin of load ``lo`` leaves at least ``(peak + lo) / 2``: partners are tried
    lightest first, and the search stops at the first that cannot beat the best swap found.
    """
    num_slots = num_bins * per_bin
    piece = np.empty(num_slots, dtype=np.float64)  # load of every slot's replica
    for s in range(num_slots):
        piece[s] = w[slot_item[s]] / count[slot_item[s]]
    load = np.empty(num_bins, dtype=np.float64)
    for b in range(num_bins):
        load[b] = eplb_bin_load(w, count, per_bin, slot_item, b)
    num_partners = min(SWAP_PARTNERS, num_bins - 1)
    partners = np.empty(max(num_partners, 1), dtype=np.int64)
    for _ in range(max_swaps):
        if num_partners == 0:
            break
        top = 0
        for b in range(1, num_bins):
            if load[b] > load[top]:
                top = b
        if load[top] <= floor:
            break
        # The lightest bins other than the top, lightest first, by insertion (few partners).
        found = 0
        for b in range(num_bins):
            if b == top:
                continue
            k = found if found < num_partners else num_partners
            if k == num_partners and load[b] >= load[partners[k - 1]]:
                continue
            if k == num_partners:
                k -= 1
            while k > 0 and load[partners[k - 1]] > load[b]:
                partners[k] = partners[k - 1]
                k -= 1
            partners[k] = b
            if found < num_partners:
                found += 1
        peak = load[top]
        best_cost = peak * (1.0 - MIN_RELATIVE_GAIN)
        best_a = -1
        best_b = -1
        for p in range(num_partners):
            other = partners[p]
            low = load[other]
            if 0.5 * (peak + low) >= best_cost:
                break
            for a in range(top * per_bin, (top + 1) * per_bin):
                if has[other, slot_item[a]]:
                    continue
                for s in range(other * per_bin, (other + 1) * per_bin):
                    d = piece[a] - piece[s]
                    if d <= 0.0:
                        continue
                    cost = max(peak - d, low + d)
                    if cost < best_cost and not has[top, slot_item[s]]:
                        best_cost = cost
                        best_a = a
                        best_b = s
        if best_a < 0:
            break
        i = slot_item[best_a]
        j = slot_item[best_b]
        other = best_b // per_bin
        slot_item[best_a] = j
        slot_item[best_b] = i
        piece[best_a], piece[best_b] = piece[best_b], piece[best_a]
        has[top, i] = False
        has[top, j] = True
        has[other, j] = False
        has[other, i] = True
        load[top] = eplb_bin_load(w, count, per_bin, slot_item, top)
        load[other] = eplb_bin_load(w, count, per_bin, slot_item, other)
    peak = 0.0
    for b in range(num_bins):
        peak = max(peak, load[b])
    return peak


@kernel
def eplb_peak(w, count, num_bins, per_bin, slot_item):
    """The heaviest bin's load."""
    peak = 0.0
    for b in range(num_bins):
        peak = max(peak, eplb_bin_load(w, count, per_bin, slot_item, b))
    return peak


@kernel
def eplb_set_has(num_items, per_bin, slot_item, has):
    """``has`` [num_bins, N] from ``slot_item`` (which holds no item twice in a bin)."""
    has[:, :] = False
    for s in range(slot_item.shape[0]):
        has[s // per_bin, slot_item[s]] = True


@kernel
def eplb_place_groups(w, num_groups, num_nodes, max_swaps, node_experts):
    """Groups to nodes for the drop-in: EPLB's greedy, then swaps while the heaviest node gets
    lighter. Writes ``node_experts`` [E]: the experts of node n at ``n*E/num_nodes ..``."""
    E = w.shape[0]
    group_size = E // num_groups
    groups_per_node = num_groups // num_nodes
    if groups_per_node == 1 or num_nodes == 1:
        # Any assignment is a relabelling of identical nodes: keep the natural order.
        for e in range(E):
            node_experts[e] = e
        return
    group_w = np.zeros(num_groups, dtype=np.float64)
    for g in range(num_groups):
        for k in range(group_size):
            group_w[g] += w[g * group_size + k]
    count = np.ones(num_groups, dtype=np.int64)
    slot_group = np.empty(num_groups, dtype=np.int64)
    has = np.zeros((num_nodes, num_groups), dtype=np.bool_)
    eplb_pack_distinct(group_w, count, num_nodes, groups_per_node, slot_group, has)
    eplb_swap_refine(group_w, count, num_nodes, groups_per_node, slot_group, has, max_swaps, 0.0)
    for s in range(num_groups):
        for k in range(group_size):
            node_experts[s * group_size + k] = slot_group[s] * group_size + k


@kernel
def eplb_own_node(w, num_gpus, per_gpu, count, slot_item, has, best_count, best_slot, bound):
    """The drop-in's own plan of one node, before refinement: experts ``w`` [N] on ``num_gpus``
    GPUs with ``per_gpu`` slots. Replica counts capped at one per GPU, then as they are and with
    the first layer of replicas aligned (:func:`eplb_align_counts`, both ways), each packed
    without duplicates. The best, if its hottest GPU is lighter than ``bound``, is written to
    ``best_count`` [N] / ``best_slot`` [num_gpus*per_gpu]; returns the lower of its hottest GPU
    load and ``bound``."""
    n = w.shape[0]
    base = np.empty(n, dtype=np.int64)
    eplb_capped_counts(w, num_gpus * per_gpu, num_gpus, base)
    best_peak = bound
    for variant in range(3):
        for i in range(n):
            count[i] = base[i]
        if variant > 0 and not eplb_align_counts(w, count, num_gpus, num_gpus, variant == 2):
            continue
        eplb_pack_distinct(w, count, num_gpus, per_gpu, slot_item, has)
        eplb_fill_free(w, count, per_gpu, slot_item, has)
        peak = eplb_peak(w, count, num_gpus, per_gpu, slot_item)
        if peak < best_peak:
            best_peak = peak
            best_count[:] = count
            best_slot[:] = slot_item
    return best_peak


@kernel
def eplb_eplb_node(w, num_gpus, per_gpu, plan, count, slot_item, has, best_count, best_slot):
    """EPLB's plan of one node without duplicates, before refinement: ``plan``
    [num_gpus*per_gpu] (local expert ids, maybe twice on a GPU) with each second copy swapped
    into another GPU (:func:`eplb_dedupe`), or, when that leaves the hottest GPU hotter than in
    ``plan``, whichever of that and dropping and refilling the copies leaves the lighter
    hottest GPU. Writes ``best_count`` [N] / ``best_slot``; returns that load, negated when
    ``plan`` had no duplicates (then the plan is EPLB's unchanged)."""
    best_count[:] = 0
    for s in range(plan.shape[0]):
        best_slot[s] = plan[s]
        best_count[plan[s]] += 1
    peak_plan = eplb_peak(w, best_count, num_gpus, per_gpu, best_slot)
    # Most nodes have no duplicates: a pairwise check inside every GPU (few slots) finds them.
    duplicates = False
    for g in range(num_gpus):
        for a in range(g * per_gpu, (g + 1) * per_gpu):
            for b in range(a + 1, (g + 1) * per_gpu):
                duplicates = duplicates or plan[a] == plan[b]
    if not duplicates:
        return -peak_plan
    best_peak = np.inf
    for way in range(2):
        count[:] = 0
        for s in range(plan.shape[0]):
            slot_item[s] = plan[s]
            count[plan[s]] += 1
        if way == 0:
            eplb_dedupe(w, count, num_gpus, per_gpu, slot_item, has)
        else:
            eplb_drop_duplicates(count, per_gpu, slot_item, has)
        eplb_fill_free(w, count, per_gpu, slot_item, has)
        peak = eplb_peak(w, count, num_gpus, per_gpu, slot_item)
        if peak < best_peak:
            best_peak = peak
            best_count[:] = count
            best_slot[:] = slot_item
        if best_peak <= peak_plan:
            break
    return best_peak


@kernel
def eplb_node_input(w, experts, row, n, w_node, plan, local):
    """Node ``n`` of EPLB's plan in the node's own numbering: loads ``w_node`` [N] of its
    experts (``experts`` [E] lists them node by node) and ``plan`` [slots per node], the local
    expert of each of its slots in ``row`` [R]; ``local`` [E] is scratch. Returns the node's
    total load."""
    per_node = w_node.shape[0]
    slots_per_node = plan.shape[0]
    total = 0.0
    for i in range(per_node):
        e = experts[n * per_node + i]
        local[e] = i
        w_node[i] = w[e]
        total += w[e]
    for s in range(slots_per_node):
        plan[s] = local[row[n * slots_per_node + s]]
    return total


@kernel
def eplb_distinct_layer(w, w32, num_replicas, num_groups, num_nodes, num_gpus, max_swaps, row):
    """The drop-in's plan of one layer, written to ``row`` [R].

    Two candidates, each without duplicates:
    (b) EPLB's own plan, node by node: a node where it has no duplicates keeps it; elsewhere
        EPLB's plan cleared of duplicates (:func:`eplb_eplb_node`), or the drop-in's own plan
        of the same experts (:func:`eplb_own_node`) if lighter; the own plan is tried only
        where clearing duplicates made the node's hottest GPU hotter than under EPLB, and
        hotter than the mean GPU load of some node (a floor on the layer's hottest GPU).
    (a) Only where a node holds several groups: groups packed to nodes and refined; when that
        splits the groups differently from EPLB, :func:`eplb_own_node` on every node.
    The one with the lighter hottest GPU (ties: (b)) is refined by swaps, node by node, the
    hottest node first: a node is refined only while its hottest GPU is hotter than the
    layer's hottest after refinement so far (lower would not change the layer's hottest GPU).
    When EPLB's plan has no duplicates, (b) is EPLB's plan and swaps only lower the hottest GPU,
    so the result is never worse than EPLB's. Each node is planned on its own GPUs, so every
    group's replicas stay on its node.
    """
    E = w.shape[0]
    per_node = E // num_nodes
    slots_per_node = num_replicas // num_nodes
    gpus_per_node = num_gpus // num_nodes
    per_gpu = num_replicas // num_gpus
    group_size = E // num_groups
    groups_per_node = num_groups // num_nodes
    w_node = np.empty(per_node, dtype=np.float64)
    count = np.empty(per_node, dtype=np.int64)
    slot_item = np.empty(slots_per_node, dtype=np.int64)
    has = np.zeros((gpus_per_node, per_node), dtype=np.bool_)
    experts = np.empty((2, E), dtype=np.int64)  # [candidate, node-major expert ids]
    counts = np.empty((2, num_nodes, per_node), dtype=np.int64)
    slots = np.empty((2, num_nodes, slots_per_node), dtype=np.int64)
    node_peak = np.zeros((2, num_nodes), dtype=np.float64)  # hottest GPU before refinement

    eplb_layer(w32, num_replicas, num_groups, num_nodes, num_gpus, row, experts[1])
    local = np.empty(E, dtype=np.int64)
    plan = np.empty(slots_per_node, dtype=np.int64)
    worse = np.zeros(num_nodes, dtype=np.bool_)  # clearing duplicates made the node hotter
    lowest_peak = 0.0  # the layer's hottest GPU carries at least any node's mean GPU load
    for n in range(num_nodes):
        node_load = eplb_node_input(w, experts[1], row, n, w_node, plan, local)
        lowest_peak = max(lowest_peak, node_load / gpus_per_node)
        peak = eplb_eplb_node(w_node, gpus_per_node, per_gpu, plan, count, slot_item, has,
                              counts[1, n], slots[1, n])
        if peak > 0.0:  # EPLB put duplicates here
            count[:] = 0
            for s in range(slots_per_node):
                count[plan[s]] += 1
            worse[n] = peak > eplb_peak(w_node, count, gpus_per_node, per_gpu, plan)
        node_peak[1, n] = abs(peak)
    for n in range(num_nodes):
        # The own plan may do better; below lowest_peak the node cannot be the layer's hottest.
        if worse[n] and node_peak[1, n] > lowest_peak:
            eplb_node_input(w, experts[1], row, n, w_node, plan, local)
            node_peak[1, n] = eplb_own_node(w_node, gpus_per_node, per_gpu, count, slot_item,
                                            has, counts[1, n], slots[1, n], node_peak[1, n])
    peak_b = node_peak[1].max()

    # (a) differs from (b) only in how groups are split over nodes (nodes are identical, so
    # their order does not matter): worth its time only when that split differs.
    c = 1
    if num_nodes > 1 and groups_per_node > 1:
        eplb_place_groups(w, num_groups, num_nodes, max_swaps, experts[0])
        node_of_group = np.empty(num_groups, dtype=np.int64)
        for n in range(num_nodes):
            for k in range(groups_per_node):
                node_of_group[experts[1, n * per_node + k * group_size] // group_size] = n
        same = True
        for n in range(num_nodes):
            first = node_of_group[experts[0, n * per_node] // group_size]
            for k in range(1, groups_per_node):
                g = experts[0, n * per_node + k * group_size] // group_size
                same = same and node_of_group[g] == first
        if not same:
            c = 0
            for n in range(num_nodes):
                for i in range(per_node):
                    w_node[i] = w[experts[0, n * per_node + i]]
                # Bound: a node no lighter than (b)'s hottest GPU rules (a) out.
                node_peak[0, n] = eplb_own_node(w_node, gpus_per_node, per_gpu, count,
                                                slot_item, has, counts[0, n], slots[0, n],
                                                peak_b)
                if node_peak[0, n] >= peak_b:
                    c = 1
                    break

    layer_peak = 0.0
    for n in np.argsort(-node_peak[c], kind="mergesort"):
        if node_peak[c, n] > layer_peak:
            for i in range(per_node):
                w_node[i] = w[experts[c, n * per_node + i]]
            eplb_set_has(per_node, per_gpu, slots[c, n], has)
            layer_peak = max(layer_peak, eplb_swap_refine(
                w_node, counts[c, n], gpus_per_node, per_gpu, slots[c, n], has, max_swaps,
                layer_peak))
        for s in range(slots_per_node):
            row[n * slots_per_node + s] = experts[c, n * per_node + slots[c, n, s]]


@kernel
def eplb_distinct(w_LE, w32_LE, num_replicas, num_groups, num_nodes, num_gpus, max_swaps,
                  max_replicas):
    """The drop-in for every layer: phy2log [L, R], log2phy [L, E, max_replicas] (slots in
    ascending order, -1 padded) and logcnt [L, E]."""
    L, E = w_LE.shape
    phy2log = np.empty((L, num_replicas), dtype=np.int64)
    log2phy = np.full((L, E, max_replicas), -1, dtype=np.int64)
    logcnt = np.zeros((L, E), dtype=np.int64)
    for layer in range(L):
        eplb_distinct_layer(w_LE[layer], w32_LE[layer], num_replicas, num_groups, num_nodes,
                            num_gpus, max_swaps, phy2log[layer])
        for s in range(num_replicas):
            e = phy2log[layer, s]
            log2phy[layer, e, logcnt[layer, e]] = s
            logcnt[layer, e] += 1
    return phy2log, log2phy, logcnt


def _kernels(name: str | None = None):
    name = name or _choose_backend("planner")
    return _jit.compiled() if name == "numba" else _jit.interpreted()


_pool: ThreadPoolExecutor | None = None


def _distinct_all_layers(name: str, w_LE: np.ndarray, *args):
    """Run :func:`eplb_distinct` over all layers. Compiled kernels release the GIL, so layers
    are split into contiguous chunks planned on worker threads (layers are independent: the
    result does not depend on the split), as many as Numba may use
    (``numba.set_num_threads``), at most ``MAX_THREADS``."""
    global _pool
    kernels = _kernels(name)
    L = w_LE.shape[0]
    w32_LE = w_LE.astype(np.float32)
    if name != "numba":
        return kernels.eplb_distinct(w_LE, w32_LE, *args)
    import numba

    threads = min(numba.get_num_threads(), MAX_THREADS, L // MIN_LAYERS_PER_THREAD)
    if threads < 2:
        return kernels.eplb_distinct(w_LE, w32_LE, *args)
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=MAX_THREADS, thread_name_prefix="moebalance-eplb")
    bounds = np.linspace(0, L, threads + 1).astype(np.int64)
    parts = [_pool.submit(kernels.eplb_distinct, w_LE[a:b], w32_LE[a:b], *args)
             for a, b in zip(bounds[:-1], bounds[1:])]
    done = [part.result() for part in parts]
    return tuple(np.concatenate([d[k] for d in done]) for k in range(3))


def rebalance_experts(weight, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int,
                      *, backend: str | None = None):
    """Drop-in for EPLB's ``rebalance_experts``: same arguments, same output conventions.

    Differences from EPLB: no GPU ever holds two replicas of one expert; compiled kernels,
    milliseconds per call instead of seconds; balance at least EPLB's: in every layer where
    EPLB's plan has no duplicate replica the hottest GPU is never hotter than under EPLB's plan
    (balancedness, mean/max GPU load, >= EPLB's), by construction. Where EPLB's plan relies on
    duplicates (a GPU carrying two shares of one expert), this plan is usually better too, but
    not always. Loads split equally between replicas.
    The hierarchical policy (when ``num_nodes`` divides ``num_groups``) keeps all replicas of
    one group's experts on one node, as EPLB does; otherwise the global policy. Deterministic.

    Args:
        weight: [L, E] load of every logical expert: numpy, torch (CPU or CUDA) or cupy;
            finite, >= 0.
        num_replicas: R, physical expert slots per layer; a multiple of ``num_gpus``, >= E.
        num_groups: expert groups (E is a multiple; 1 for a model without groups).
        num_nodes: server nodes; divides ``num_gpus``.
        num_gpus: G GPUs; GPU g owns slots ``g*R/G .. (g+1)*R/G``. R/G may not exceed the
            experts a GPU can choose from (E, or E/num_nodes with the hierarchical policy).
        backend: "numba" or "numpy" to force an implementation (default: automatic); both give
            identical results.

    Returns:
        phy2log: [L, R] int64, logical expert of every physical slot.
        log2phy: [L, E, X] int64, the slots of every expert in ascending order, -1 padded;
            X = R - E + 1, the most replicas an expert can have.
        logcnt: [L, E] int64, replicas of every expert (>= 1).
        torch tensors on the CPU when ``weight`` is a torch tensor, numpy arrays otherwise.
    """
    w, hierarchical = _check_arguments(weight, num_replicas, num_groups, num_nodes, num_gpus,
                                       distinct=True)
    if backend is not None and backend not in ("numba", "numpy"):
        raise ValueError(f"backend must be 'numba', 'numpy' or None, got {backend!r}")
    L, E = w.shape
    R, G = int(num_replicas), int(num_gpus)
    groups, nodes = (int(num_groups), int(num_nodes)) if hierarchical else (1, 1)
    max_swaps = max(1, int(SWAPS_PER_SLOT * (R // nodes)))
    phy2log, log2phy, logcnt = _distinct_all_layers(backend or _choose_backend("planner"), w, R,
                                                    groups, nodes, G, max_swaps, R - E + 1)
    if type(weight).__module__.startswith("torch"):
        import torch

        return torch.from_numpy(phy2log), torch.from_numpy(log2phy), torch.from_numpy(logcnt)
    return phy2log, log2phy, logcnt


__all__ = ["eplb_baseline", "eplb_style_plan", "placement_from_phy2log", "rebalance_experts"]
