"""Routing tables: which replica (physical slot) each rank sends an expert's tokens to.

Computed on the host, once per placement change, from the placement's token shares. A table
turns the per-pair hash ``u in [0, 2**24)`` of :func:`moebalance.dispatch.reference.route` into a
slot: a pair of expert ``e`` goes to the first replica ``j`` with ``u < thresholds_EX[e, j]``.

Legend: E logical experts, X the most replicas any expert has in the placement, R ranks.

How probabilities are chosen (each rank is assumed to hold an equal part of every expert's
tokens): replica ``j`` with share ``s_j`` on rank ``d_j`` keeps ``p[d_j, j] = min(1, R * s_j)`` of
its own rank's tokens, so traffic stays local wherever the share allows; the capacity left,
``c_j = s_j - p[d_j, j] / R``, is filled by every rank's remaining mass in proportion to ``c_j``.
Summed over ranks, replica ``j`` then receives exactly ``s_j`` of the expert's tokens.

When the node of every rank is known (``nodes``), a node tier sits between the two: the ranks of
a node first send their remaining mass to the remaining capacity of replicas on the same node
(as much as both allow, each rank in proportion to its mass, each replica to its capacity), and
only what is left crosses nodes. The shares are met exactly either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..placement import Placement
from .reference import HASH_ONE

__all__ = ["RoutingTable", "routing_table", "route_probabilities"]


@dataclass(frozen=True)
class RoutingTable:
    """Routing table of one layer, as seen from one source rank.

    Attributes:
        slots_EX: [E, X] int64, physical slots of each expert's replicas in slot order, -1 padded.
        thresholds_EX: [E, X] int64, cumulative thresholds in units of 2**-24: non-decreasing over
            the valid replicas of an expert, the last valid entry and every padded entry 2**24.
    """

    slots_EX: torch.Tensor
    thresholds_EX: torch.Tensor

    def to(self, device) -> "RoutingTable":
        """The same table with both tensors on ``device``."""
        return RoutingTable(self.slots_EX.to(device), self.thresholds_EX.to(device))


def _check(placement, layer, rank, num_ranks) -> None:
    if not isinstance(placement, Placement):
        raise TypeError(f"placement must be a moebalance.Placement, got {type(placement).__name__}")
    for name, value in (("layer", layer), ("rank", rank), ("num_ranks", num_ranks)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not 0 <= layer < placement.num_layers:
        raise ValueError(f"layer must be in [0, {placement.num_layers}), got {layer}")
    if num_ranks != placement.num_devices:
        raise ValueError(f"num_ranks={num_ranks} but the placement spans {placement.num_devices} "
                         f"devices; one rank serves one device, so plan for {num_ranks} devices")
    if not 0 <= rank < num_ranks:
        raise ValueError(f"rank must be in [0, {num_ranks}), got {rank}")


def _replica_slots(placement: Placement, layer: int) -> np.ndarray:
    """[E, X] int64: the slots of each expert in slot order, -1 padded (X over all layers)."""
    phy2log = placement.phy2log[layer]
    E, S = placement.num_experts, placement.num_slots
    X = max(int(placement.replicas.max()), 1)
    order = np.argsort(phy2log, kind="stable")
    experts = phy2log[order]
    first = np.searchsorted(experts, np.arange(E))
    out = np.full((E, X), -1, dtype=np.int64)
    out[experts, np.arange(S) - first[experts]] = order
    return out


def _check_nodes(nodes, num_ranks: int) -> np.ndarray | None:
    if nodes is None:
        return None
    arr = np.asarray(nodes)
    if arr.shape != (num_ranks,) or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"nodes must list the integer node of each of the {num_ranks} ranks, got "
                         f"{nodes!r}; pass e.g. topology.node, or None for no node preference")
    return arr.astype(np.int64)


def route_probabilities(placement: Placement, layer: int, rank: int, num_ranks: int,
                        nodes=None) -> tuple[np.ndarray, np.ndarray]:
    """Exact (float64) routing probabilities of ``rank`` for every expert of ``layer``.

    ``nodes`` ([R] ints, optional): the node of each rank; replicas on the rank's own node are
    then preferred after its own device's.

    Returns:
        slots_EX: [E, X] int64, replica slots, -1 padded.
        prob_EX: [E, X] float64, probability that ``rank`` sends a pair of expert e to replica j;
            rows sum to 1, padded entries and replicas with share 0 are exactly 0.
    """
    _check(placement, layer, rank, num_ranks)
    node_of = _check_nodes(nodes, num_ranks)
    slots = _replica_slots(placement, int(layer))
    valid = slots >= 0
    safe = np.where(valid, slots, 0)
    share = np.where(valid, placement.share[layer][safe], 0.0)
    device = np.where(valid, placement.slot_device[safe], -1)
    R = float(num_ranks)
    local = np.minimum(1.0, R * share)
    # Rounding can leave a hair of negative capacity where R * share == 1.
    capacity = np.maximum(share - local / R, 0.0)
    prob = np.where(device == rank, local, 0.0)
    remaining = np.maximum(1.0 - prob.sum(axis=1), 0.0)
    if node_of is not None:
        prob, remaining, capacity = _node_tier(prob, remaining, capacity, local, device, valid,
                                               node_of, rank)
    cap_sum = capacity.sum(axis=1)
    # cap_sum == 0 only when every rank keeps all its tokens local (remaining ~ 0 everywhere);
    # spreading any rounding residue by share keeps rows summing to 1.
    has_cap = cap_sum > 0
    spread = np.where(has_cap[:, None], capacity / np.where(has_cap, cap_sum, 1.0)[:, None], share)
    prob = prob + remaining[:, None] * spread
    prob = prob / prob.sum(axis=1, keepdims=True)
    return slots, prob


def _node_tier(prob, remaining, capacity, local, device, valid, node_of, rank):
    """Send each rank's remaining mass to same-node replicas first (see the module docstring).

    Args (E experts, X replica columns): prob [E, X] (this rank's local tier), remaining [E]
    (this rank's mass left), capacity [E, X] (replica capacity left after every rank's local
    tier), local [E, X] (min(1, R*share)), device [E, X] (-1 padding), valid [E, X]; node_of [R].

    Returns prob, remaining and capacity after every node's tier (the global tier spreads what
    is left over the capacity every node left).
    """
    R = node_of.shape[0]
    replica_node = np.where(valid, node_of[np.where(valid, device, 0)], -1)  # [E, X]
    left = capacity.copy()
    for n in np.unique(node_of):
        on_node = replica_node == n
        # Mass the ranks of node n have left after their local tier: 1 - their replica's take.
        mass = np.zeros(prob.shape[0])
        for r in np.flatnonzero(node_of == n):
            mass += np.maximum(1.0 - np.where(device == r, local, 0.0).sum(axis=1), 0.0)
        mass /= R
        cap = np.where(on_node, capacity, 0.0).sum(axis=1)                   # [E]
        flow = np.minimum(mass, cap)
        take = np.where(cap > 0, flow / np.where(cap > 0, cap, 1.0), 0.0)
        left = np.where(on_node, capacity * (1.0 - take)[:, None], left)
        if n == node_of[rank]:
            sent = remaining * np.where(mass > 0, flow / np.where(mass > 0, mass, 1.0), 0.0)
            spread = np.where(on_node, capacity, 0.0) / np.where(cap > 0, cap, 1.0)[:, None]
            prob = prob + sent[:, None] * spread
            remaining = remaining - sent
    return prob, np.maximum(remaining, 0.0), np.maximum(left, 0.0)


def _quantise(prob_EX: np.ndarray) -> np.ndarray:
    """[E, X] int64 widths in units of 2**-24 summing to 2**24 per row (largest remainder).

    Widths start at floor(p * 2**24), so every probability >= 2**-24 is reachable; the units
    missing from a row go to its largest remainders among positive probabilities (ties by
    column: deterministic), so zero probabilities keep width 0.
    """
    scaled = prob_EX * HASH_ONE
    width = np.floor(scaled).astype(np.int64)
    frac = np.where(prob_EX > 0, scaled - width, -1.0)
    deficit = HASH_ONE - width.sum(axis=1)                              # [E], 0 <= deficit <= X
    rank_by_frac = np.argsort(np.argsort(-frac, axis=1, kind="stable"), axis=1, kind="stable")
    width += (rank_by_frac < deficit[:, None]) & (prob_EX > 0)
    # Float rounding of the row sums can leave a unit over or under: the widest replica (at
    # least 2**24 / X wide) absorbs it.
    rest = HASH_ONE - width.sum(axis=1)
    width[np.arange(prob_EX.shape[0]), np.argmax(width, axis=1)] += rest
    return width


def routing_table(placement: Placement, layer: int, rank: int, num_ranks: int,
                  device: torch.device | str | None = None, nodes=None) -> RoutingTable:
    """Routing table of ``layer`` for pairs that start on ``rank`` (see the module docstring).

    Args:
        placement: the current placement; its devices are the ranks 0..num_ranks-1.
        layer: MoE layer index into the placement.
        rank: this rank.
        num_ranks: R, the expert-parallel world size (must equal placement.num_devices).
        device: where to put the table's tensors (default CPU).
        nodes: [R] node of each rank (e.g. ``topology.node``) to prefer same-node replicas
            after the rank's own; None: no node preference.

    Returns:
        RoutingTable with slots_EX [E, X] and thresholds_EX [E, X] int64.
    """
    slots, prob = route_probabilities(placement, layer, rank, num_ranks, nodes)
    thresholds = np.cumsum(_quantise(prob), axis=1)
    table = RoutingTable(torch.from_numpy(slots), torch.from_numpy(thresholds))
    return table if device is None else table.to(device)
