"""Routing from global counts: how many of each rank's pairs of an expert go to each replica.

After the count exchange every rank of the group holds ``counts_GE``, the routed pairs of every
(source rank, expert) of the layer. From it and the token shares of the replicas (the
placement's, or this step's re-split from :mod:`.shares`) every rank computes the same integer
flow table ``flow_GEX[g, e, j]``: pairs of expert ``e`` that rank ``g`` sends to replica ``j``.
Each rank then sends its pairs of expert ``e``, in pair order, the first ``flow[g, e, 0]`` to
replica 0, the next ``flow[g, e, 1]`` to replica 1, and so on (:func:`.reference.route`).

The table, per expert, with ``total`` its pairs over the group:

1. **targets**: replica j receives exactly ``target[j] = B[j] - B[j-1]`` pairs with
   ``B[j] = round(total * (share[0] + ... + share[j]))`` and ``B[last] = total``, so
   ``|target[j] - share[j] * total| <= 1`` whatever each rank sends, the targets sum to
   ``total``, and a replica of share 0 receives nothing.
2. **own device first**: the rank holding replica j keeps ``min(its pairs, target[j])`` there.
3. **then the node** (when the node of every rank is known): what the ranks of a node still
   have fills what the replicas on that node can still take.
4. **then the rest** of the group.

Tiers 3 and 4 pair supplies with capacities by the north-west corner rule: ranks in rank order
and replicas in column order are laid out on one line each, and a rank sends to a replica the
length of the overlap of their intervals. That is deterministic, integer and a handful of
vectorised torch ops on the counts' device: no host sync and no Python loop over experts.

Legend: G ranks of the group, E logical experts, X most replicas of an expert, N nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .._check import index
from ..placement import Placement

__all__ = ["ReplicaTable", "replica_table", "replica_targets", "replica_flows"]


@dataclass(frozen=True)
class ReplicaTable:
    """The replicas of every expert of one layer, on one device.

    Attributes:
        slots_EX: [E, X] int64, physical slots of each expert's replicas in slot order, -1 padded.
        device_EX: [E, X] int64, the rank holding each replica, -1 padded.
        share_EX: [E, X] float64, the placement's token share of each replica, 0 padded.
    """

    slots_EX: torch.Tensor
    device_EX: torch.Tensor
    share_EX: torch.Tensor

    @property
    def valid_EX(self) -> torch.Tensor:
        """[E, X] bool, the columns that hold a replica."""
        return self.slots_EX >= 0

    def to(self, device) -> "ReplicaTable":
        """The same table with every tensor on ``device``."""
        return ReplicaTable(self.slots_EX.to(device), self.device_EX.to(device),
                            self.share_EX.to(device))


def replica_table(placement: Placement, layer: int, device=None) -> ReplicaTable:
    """The :class:`ReplicaTable` of ``layer`` (X is the most replicas over all layers).

    Args:
        placement: a valid placement. layer: index of the layer in it.
        device: where to put the tensors (default CPU).
    """
    if not isinstance(placement, Placement):
        raise TypeError(f"placement must be a moebalance.Placement, got {type(placement).__name__}")
    layer = index(layer, "layer", placement.num_layers)
    phy2log = placement.phy2log[layer]
    E, S = placement.num_experts, placement.num_slots
    X = max(int(placement.replicas.max()), 1)
    order = np.argsort(phy2log, kind="stable")
    experts = phy2log[order]
    first = np.searchsorted(experts, np.arange(E))
    slots = np.full((E, X), -1, dtype=np.int64)
    slots[experts, np.arange(S) - first[experts]] = order
    valid = slots >= 0
    safe = np.where(valid, slots, 0)
    devices = np.where(valid, placement.slot_device[safe], -1).astype(np.int64)
    shares = np.where(valid, placement.share[layer][safe], 0.0)
    table = ReplicaTable(torch.from_numpy(slots), torch.from_numpy(devices),
                         torch.from_numpy(shares))
    return table if device is None else table.to(device)


def replica_targets(total_E: torch.Tensor, share_EX: torch.Tensor) -> torch.Tensor:
    """[E, X] int64 pairs each replica receives: rule 1 of the module docstring.

    Args:
        total_E: [E] int64, pairs of each expert over the group.
        share_EX: [E, X] float64, shares of each expert's replicas (rows sum to 1, 0 padded).
    """
    total = total_E.unsqueeze(1)
    bounds = torch.round(torch.cumsum(share_EX, dim=1) * total.to(torch.float64)).to(torch.int64)
    # From the last replica with a share on, the bound is the total exactly, whatever rounding
    # did to the shares' sum (padding and zero-share replicas after it get nothing), and no
    # bound passes the total (shares that sum to a hair over 1).
    X = share_EX.shape[1]
    columns = torch.arange(X, device=share_EX.device)
    last = (X - 1) - torch.flip(share_EX > 0, dims=(1,)).to(torch.int8).argmax(dim=1, keepdim=True)
    bounds = torch.where(columns >= last, total, torch.minimum(bounds, total))
    return torch.diff(bounds, dim=1, prepend=torch.zeros_like(bounds[:, :1]))


def _north_west(supply_GE: torch.Tensor, capacity_EX: torch.Tensor) -> torch.Tensor:
    """[G, E, X] int64 flow pairing supplies (ranks in order) with capacities (columns in
    order) by the overlap of their intervals on one line per expert."""
    s_end = torch.cumsum(supply_GE, dim=0).unsqueeze(2)           # [G, E, 1]
    s_start = s_end - supply_GE.unsqueeze(2)
    c_end = torch.cumsum(capacity_EX, dim=1).unsqueeze(0)         # [1, E, X]
    c_start = c_end - capacity_EX.unsqueeze(0)
    return (torch.minimum(s_end, c_end) - torch.maximum(s_start, c_start)).clamp_(min=0)


def replica_flows(counts_GE: torch.Tensor, share_EX: torch.Tensor, device_EX: torch.Tensor,
                  on_node_NG: torch.Tensor | None = None) -> torch.Tensor:
    """The flow table of the module docstring.

    Args:
        counts_GE: [G, E] int64, pairs of each expert on each rank.
        share_EX: [E, X] float64, token shares of each expert's replicas (0 padded).
        device_EX: [E, X] int64, rank holding each replica (-1 padded).
        on_node_NG: optional [N, G] bool, ``on_node[n, g]``: rank g is on node n (N nodes):
            replicas on the sender's node come before the rest of the group.

    Returns:
        flow_GEX: [G, E, X] int64, pairs of expert e rank g sends to replica j; summed over j
        it is counts_GE, summed over g it is :func:`replica_targets`.
    """
    G = counts_GE.shape[0]
    target_EX = replica_targets(counts_GE.sum(dim=0), share_EX)
    ranks = torch.arange(G, device=counts_GE.device)
    holds_GEX = device_EX.unsqueeze(0) == ranks.view(G, 1, 1)     # rank g holds replica (e, j)
    # Tier 2: the holder keeps min(its pairs, target) (a rank holds at most one replica of e).
    own_EX = (holds_GEX * counts_GE.unsqueeze(2)).sum(dim=0)
    local_EX = torch.minimum(own_EX, target_EX)
    flow = holds_GEX * local_EX.unsqueeze(0)
    supply_GE = counts_GE - flow.sum(dim=2)
    capacity_EX = target_EX - local_EX
    if on_node_NG is not None:
        valid_EX = device_EX >= 0
        # One pass per node (a handful), each over all experts at once.
        for on_node_G in on_node_NG:
            replica_on_node_EX = on_node_G[device_EX.clamp(min=0)] & valid_EX
            step = _north_west(supply_GE * on_node_G.unsqueeze(1),
                               capacity_EX * replica_on_node_EX)
            flow = flow + step
            supply_GE = supply_GE - step.sum(dim=2)
            capacity_EX = capacity_EX - step.sum(dim=0)
    return flow + _north_west(supply_GE, capacity_EX)
