"""Which expert rows move where when a placement changes (numpy only: no torch.distributed).

:func:`plan_migration` turns ``(old, new)`` into a :class:`MigrationPlan`: the new placement with
its slots relabelled inside each device so that every expert a device keeps stays in its row
(:func:`align_slots`), then for every slot whose expert changes its destination (rank, local
slot) and a source among the expert's current holders, and the bytes each rank sends and
receives. :mod:`.transfer` moves the rows.

Legend: L layers, S global slots, G ranks, M moved slots.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .._check import positive_int
from ..placement import Placement
from ..topology import Topology

__all__ = ["MigrationPlan", "plan_migration", "align_slots"]


def align_slots(old: Placement, new: Placement) -> Placement:
    """``new`` with the slots of each device relabelled so that kept experts keep their rows.

    A device that holds expert e under both placements keeps e in the slot it had; the experts
    it gains fill its other slots in the order ``new`` lists them. The result is the same
    placement up to the free relabelling inside a device (same experts and shares per device).

    Args:
        old, new: placements of the same layers, slots and devices.

    Returns:
        The relabelled copy of ``new`` ([L, S] phy2log and share permuted within devices).
    """
    _check_pair(old, new)
    phy2log = new.phy2log.copy()
    share = new.share.copy()
    starts = np.searchsorted(new.slot_device, np.arange(new.num_devices + 1))
    for layer in range(new.num_layers):
        for g in range(new.num_devices):
            lo, hi = int(starts[g]), int(starts[g + 1])
            before = old.phy2log[layer, lo:hi]
            after = new.phy2log[layer, lo:hi]
            if np.array_equal(before, after):
                continue
            row_of = {int(e): i for i, e in enumerate(before)}
            order = np.full(hi - lo, -1, dtype=np.int64)     # new local index -> aligned index
            taken = np.zeros(hi - lo, dtype=bool)
            for j, e in enumerate(after.tolist()):
                i = row_of.get(e)
                if i is not None:
                    order[j] = i
                    taken[i] = True
            free = iter(np.flatnonzero(~taken).tolist())
            for j in np.flatnonzero(order < 0).tolist():
                order[j] = next(free)
            phy2log[layer, lo + order] = after
            share[layer, lo + order] = new.share[layer, lo:hi]
    return Placement(phy2log, share, new.slot_device, new.num_experts)


@dataclass(frozen=True, eq=False)
class MigrationPlan:
    """Every row copy that turns ``old`` into ``target``.

    Attributes:
        old: the placement the ranks hold now.
        target: the new placement, slots relabelled inside devices (:func:`align_slots`); the
            placement the ranks hold once the migration commits.
        layer_M, expert_M: [M] int64, layer and logical expert of each moved slot.
        dst_rank_M, dst_slot_M: [M] int64, receiving rank and its local slot (row).
        src_rank_M, src_slot_M: [M] int64, sending rank (a holder of the expert under ``old``)
            and its local slot.
        expert_bytes: bytes of one moved expert row (weights and optimizer state) used for the
            byte figures; 1 counts copies.
        sent_G, received_G: [G] int64, bytes each rank sends and receives over the network
            (copies inside a rank are free and not counted).
        changed_layers: layers whose contents or shares change (moved rows or new shares).
    """

    old: Placement
    target: Placement
    layer_M: np.ndarray
    expert_M: np.ndarray
    dst_rank_M: np.ndarray
    dst_slot_M: np.ndarray
    src_rank_M: np.ndarray
    src_slot_M: np.ndarray
    expert_bytes: int
    sent_G: np.ndarray
    received_G: np.ndarray
    changed_layers: tuple = field(default=())

    @property
    def num_moves(self) -> int:
        """Expert copies that cross a rank boundary."""
        return int(np.count_nonzero(self.src_rank_M != self.dst_rank_M))

    @property
    def total_bytes(self) -> int:
        return int(self.sent_G.sum())

    def moves_per_layer(self) -> np.ndarray:
        """[L] int64 rows each layer receives."""
        return np.bincount(self.layer_M, minlength=self.old.num_layers).astype(np.int64)

    def rows_of_layer(self, layer: int) -> np.ndarray:
        """Indices into the ``*_M`` arrays of ``layer``'s moves."""
        return np.flatnonzero(self.layer_M == layer)

    def __repr__(self) -> str:
        return (f"MigrationPlan(moves={self.num_moves}, layers={len(self.changed_layers)}, "
                f"bytes={self.total_bytes})")


def _check_pair(old: Placement, new: Placement) -> None:
    for name, value in (("old", old), ("new", new)):
        if not isinstance(value, Placement):
            raise TypeError(f"{name} must be a moebalance.Placement, got {type(value).__name__}")
    if (old.phy2log.shape != new.phy2log.shape or old.num_experts != new.num_experts
            or not np.array_equal(old.slot_device, new.slot_device)):
        raise ValueError(
            f"new placement has shape {new.phy2log.shape}, {new.num_experts} experts and "
            f"{np.bincount(new.slot_device).tolist()} slots per device; the running one "
            f"{old.phy2log.shape}, {old.num_experts} and {np.bincount(old.slot_device).tolist()}: "
            f"a live placement keeps each device's slots; plan it for the same topology")


def plan_migration(old: Placement, new: Placement, topology: Topology | None = None, *,
                   expert_bytes: int = 1) -> MigrationPlan:
    """Which rows move where to turn the running placement ``old`` into ``new``.

    Args:
        old: the placement every rank holds now.
        new: the placement to reach (same layers, slots and devices).
        topology: the devices; only their nodes are used (a source on the receiver's node is
            preferred). None: every device on its own node.
        expert_bytes: bytes of one expert row with its optimizer state, for ``sent_G`` /
            ``received_G`` (default 1: copies).

    Returns:
        :class:`MigrationPlan`. A moved slot takes its expert from a holder under ``old``: one on
        the same rank first, then one on the same node, then the holder with the fewest bytes
        to send so far (ties: the lower rank), so senders share the work. Deterministic.
    """
    _check_pair(old, new)
    old.validate()
    new.validate()
    positive_int(expert_bytes, "expert_bytes")
    G = old.num_devices
    if topology is not None:
        if not isinstance(topology, Topology):
            raise TypeError("topology must be a moebalance.Topology or None, got "
                            f"{type(topology).__name__}")
        if topology.num_devices != G:
            raise ValueError(f"topology has {topology.num_devices} devices but the placements span "
                             f"{G}; pass the topology they were planned for")
        node_G = np.asarray(topology.node, dtype=np.int64)
    else:
        node_G = np.arange(G, dtype=np.int64)
    target = align_slots(old, new)
    starts = np.searchsorted(old.slot_device, np.arange(G + 1))
    local_S = np.arange(old.num_slots) - starts[old.slot_device]
    sent = np.zeros(G, dtype=np.int64)
    rows: list[tuple] = []
    changed = []
    for layer in range(old.num_layers):
        moved = np.flatnonzero(target.phy2log[layer] != old.phy2log[layer])
        if moved.size or not np.array_equal(target.share[layer], old.share[layer]):
            changed.append(layer)
        for s in moved.tolist():
            expert = int(target.phy2log[layer, s])
            dst = int(old.slot_device[s])
            holders = np.flatnonzero(old.phy2log[layer] == expert)
            ranks = old.slot_device[holders]
            key = np.lexsort((ranks, sent[ranks], node_G[ranks] != node_G[dst], ranks != dst))
            src_slot = int(holders[key[0]])
            src = int(old.slot_device[src_slot])
            if src != dst:
                sent[src] += expert_bytes
            rows.append((layer, expert, dst, int(local_S[s]), src, int(local_S[src_slot])))
    arr = np.array(rows, dtype=np.int64).reshape(-1, 6)
    remote = arr[:, 2] != arr[:, 4]
    received = np.bincount(arr[remote, 2], minlength=G).astype(np.int64) * expert_bytes
    return MigrationPlan(old=old, target=target, layer_M=arr[:, 0], expert_M=arr[:, 1],
                         dst_rank_M=arr[:, 2], dst_slot_M=arr[:, 3], src_rank_M=arr[:, 4],
                         src_slot_M=arr[:, 5], expert_bytes=int(expert_bytes), sent_G=sent,
                         received_G=received, changed_layers=tuple(changed))


# -- moving rows -----------------------------------------------------------------------------------
