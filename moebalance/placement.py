"""Placement: which logical expert each physical slot holds, and its share of that expert's tokens.

Shapes: L layers, S physical slots (grouped by device, in device order), E logical experts,
X the most replicas any expert has.

Glossary (every module uses these words in these senses):

* **slot**: one row of a device's expert storage for one layer (``slots`` per device in the
  topology). Slots are storage; a placement says what each holds. Physical ids run 0..S-1.
* **replica**: one slot holding a given logical expert; an expert has ``replicas[l, e] >= 1``.
* **share**: the fraction of an expert's tokens its replica takes (``share[l, s]``; the shares
  of one expert sum to 1). A replica with share 0 holds the expert but receives no tokens.
* **holder**: a rank holding at least one replica of an expert; gradients of a replicated
  expert are summed among its holders only.
* **piece**: the part of an expert's load one replica carries (``share * load``), the unit the
  planner moves between devices.
* **valve**: a replica whose share the planner sets to bring its device to its target load
  exactly (the pieces that close the gaps left by whole experts).
* **share slack**: how much the other replicas of an expert can take over of a replica's share
  without passing their devices' targets; a slot with slack can be given up.
"""

from __future__ import annotations

import json
import operator
import os
from dataclasses import dataclass

import numpy as np

from .topology import Topology

# Shares of one expert must sum to 1 within this tolerance.
SHARE_TOL = 1e-9


def _int_array(x, name: str) -> np.ndarray:
    """A C-contiguous int64 copy of ``x``; whole-valued floats are accepted, fractions are not."""
    arr = np.array(x)
    if arr.dtype == np.bool_ or not (np.issubdtype(arr.dtype, np.integer)
                                     or np.issubdtype(arr.dtype, np.floating)):
        raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    if np.issubdtype(arr.dtype, np.floating) \
            and not np.all(np.isfinite(arr) & (arr == np.round(arr))):
        raise ValueError(f"{name} must hold whole numbers (expert and device ids), got {arr.dtype} "
                         f"values with a fractional part")
    return np.ascontiguousarray(arr, dtype=np.int64)


def _check_contents(phy2log: np.ndarray, share: np.ndarray, slot_device: np.ndarray,
                    num_experts: int) -> None:
    """The rules a placement keeps whatever devices it runs on (arrays already shaped [L, S],
    [L, S] and [S]); raise ValueError naming the argument, the value and the fix."""
    L, S = phy2log.shape
    E = num_experts
    if E < 1:
        raise ValueError(f"num_experts must be >= 1, got {E}")
    if S < E:
        raise ValueError(f"phy2log has {S} slots for {E} experts (num_experts); every expert needs "
                         f"a slot: pass num_experts <= {S} or more slots")
    steps = np.diff(slot_device)
    if S and (slot_device[0] != 0 or np.any(steps < 0) or np.any(steps > 1)):
        raise ValueError(f"slot_device must number devices 0, 1, ... in non-decreasing slot order "
                         f"(slots grouped by device), got {slot_device.tolist()[:16]}"
                         f"{' ...' if S > 16 else ''}")
    bad = (phy2log < 0) | (phy2log >= E)
    if np.any(bad):
        layer, slot = np.argwhere(bad)[0]
        raise ValueError(f"phy2log[{layer}, {slot}] = {phy2log[layer, slot]} is not an expert in "
                         f"[0, {E}); expert ids run from 0 to num_experts - 1")
    bad = ~np.isfinite(share) | (share < 0)
    if np.any(bad):
        layer, slot = np.argwhere(bad)[0]
        raise ValueError(f"share[{layer}, {slot}] = {share[layer, slot]} must be >= 0 (and finite)")
    # All layers at once: offset each layer's expert ids by layer * E.
    flat = np.repeat(np.arange(L, dtype=np.int64), S) * E + phy2log.reshape(-1)
    replicas = np.bincount(flat, minlength=L * E)
    missing = np.flatnonzero(replicas == 0)
    if missing.size:
        layer, e = divmod(int(missing[0]), E)
        raise ValueError(f"expert {e} of layer {layer} has no replica in phy2log; every expert "
                         f"needs at least one slot in every layer")
    sums = np.bincount(flat, weights=share.reshape(-1), minlength=L * E)
    bad = np.flatnonzero(np.abs(sums - 1.0) > SHARE_TOL)
    if bad.size:
        layer, e = divmod(int(bad[0]), E)
        raise ValueError(
            f"share: the shares of expert {e} in layer {layer} sum to {float(sums[bad[0]])!r}, not "
            f"1; each expert's shares over its replicas must sum to 1 (divide them by their sum)"
        )


@dataclass(frozen=True, eq=False)
class Placement:
    """Contents of every expert slot of every layer.

    Attributes:
        phy2log: [L, S] int64, logical expert held by each physical slot.
        share: [L, S] float64, fraction of its expert's tokens each slot receives; the replicas of
            one expert have shares >= 0 that sum to 1.
        slot_device: [S] int64, device of each slot, non-decreasing (slots grouped by device).
        num_experts: E, the number of logical experts per layer.

    Construction checks everything that needs no topology and raises ValueError naming the
    argument: shapes, expert ids in ``[0, E)``, at least one replica of every expert in every
    layer, shares finite, >= 0 and summing to 1 (within 1e-9) over each expert's replicas, and
    ``slot_device`` numbering devices 0, 1, ... in slot order. :meth:`validate` adds the rules
    that concern devices. The arrays are read-only copies.
    """

    phy2log: np.ndarray
    share: np.ndarray
    slot_device: np.ndarray
    num_experts: int

    def __post_init__(self) -> None:
        phy2log = _int_array(self.phy2log, "phy2log")
        # np.array copies: the placement must not share memory with the caller's arrays.
        share = np.array(self.share, dtype=np.float64)
        slot_device = _int_array(self.slot_device, "slot_device")
        if phy2log.ndim != 2:
            raise ValueError("phy2log must have shape [num_layers, num_slots], got "
                             f"{phy2log.shape}")
        if share.shape != phy2log.shape:
            raise ValueError(f"share must have the shape of phy2log {phy2log.shape}, got "
                             f"{share.shape}")
        if slot_device.shape != (phy2log.shape[1],):
            raise ValueError(
                f"slot_device must have shape [num_slots]=({phy2log.shape[1]},), got "
                f"{slot_device.shape}"
            )
        for name, arr in (("phy2log", phy2log), ("share", share), ("slot_device", slot_device)):
            arr.setflags(write=False)
            object.__setattr__(self, name, arr)
        try:
            num_experts = operator.index(self.num_experts)
        except TypeError:
            raise TypeError(f"num_experts must be an integer, got {self.num_experts!r}") from None
        object.__setattr__(self, "num_experts", num_experts)
        _check_contents(phy2log, share, slot_device, num_experts)

    # -- sizes and derived arrays -------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return self.phy2log.shape[0]

    @property
    def num_slots(self) -> int:
        return self.phy2log.shape[1]

    @property
    def num_devices(self) -> int:
        return int(self.slot_device[-1]) + 1 if self.num_slots else 0

    @property
    def replicas(self) -> np.ndarray:
        """[L, E] int64: replicas of each logical expert."""
        out = np.zeros((self.num_layers, self.num_experts), dtype=np.int64)
        for layer in range(self.num_layers):
            out[layer] = np.bincount(self.phy2log[layer], minlength=self.num_experts)
        return out

    def log2phy(self) -> np.ndarray:
        """[L, E, X] int64: the physical slots of each logical expert in slot order, -1 padded."""
        rep = self.replicas
        x = max(int(rep.max(initial=0)), 1)
        out = np.full((self.num_layers, self.num_experts, x), -1, dtype=np.int64)
        for layer in range(self.num_layers):
            order = np.argsort(self.phy2log[layer], kind="stable")
            experts = self.phy2log[layer, order]
            starts = np.searchsorted(experts, np.arange(self.num_experts))
            rank = np.arange(self.num_slots) - starts[experts]
            out[layer, experts, rank] = order
        return out

    def device_loads(self, loads) -> np.ndarray:
        """[L, G] float64: tokens each device receives under this placement for ``loads [L, E]``."""
        from ._check import as_loads

        w = as_loads(loads, "loads", self.num_experts)
        if w.shape[0] != self.num_layers:
            raise ValueError(
                f"loads has {w.shape[0]} layers but the placement has {self.num_layers}; "
                f"pass loads of shape [{self.num_layers}, {self.num_experts}]"
            )
        slot_load = np.take_along_axis(w, self.phy2log, axis=1) * self.share
        out = np.zeros((self.num_layers, self.num_devices), dtype=np.float64)
        for layer in range(self.num_layers):
            out[layer] = np.bincount(self.slot_device, weights=slot_load[layer],
                                     minlength=self.num_devices)
        return out

    # -- checks ---------------------------------------------------------------------------------

    def validate(self, topology: Topology | None = None) -> "Placement":
        """Check what construction could not; return self.

        Construction already checked the contents: every expert has a replica in every layer, the
        ids are in range, shares are finite, >= 0 and sum to 1 over each expert's replicas, and
        slots are grouped by device. This adds that no device holds two replicas of one expert in
        one layer (EPLB's output may, so it is a valid Placement but not a valid plan) and, given
        ``topology``, that the slots are the topology's (same count, same device of every slot).
        Raises ValueError naming the first broken rule.
        """
        if topology is not None:
            self._check_slots_of(topology)
        L, S, E, G = self.num_layers, self.num_slots, self.num_experts, self.num_devices
        layer_of = np.repeat(np.arange(L, dtype=np.int64), S)
        key = np.sort((layer_of * E + self.phy2log.reshape(-1)) * G + np.tile(self.slot_device, L))
        twice = key[1:][key[1:] == key[:-1]]  # (layer, expert, device) seen twice
        if twice.size:
            rest, g = divmod(int(twice[0]), G)
            layer, e = divmod(rest, E)
            raise ValueError(
                f"device {g} holds expert {e} twice in layer {layer}; a device may hold "
                f"at most one replica of an expert"
            )
        return self

    def _check_slots_of(self, topology: Topology) -> None:
        if not isinstance(topology, Topology):
            raise TypeError("topology must be a moebalance.Topology, got "
                            f"{type(topology).__name__}")
        if (topology.num_slots != self.num_slots
                or not np.array_equal(topology.slot_device, self.slot_device)):
            raise ValueError(
                f"placement slots ({self.num_slots}, devices {self.num_devices}) do not match the "
                f"topology ({topology.num_slots} slots on {topology.num_devices} devices); plan "
                f"for this topology"
            )

    # -- migration ------------------------------------------------------------------------------

    def moves_per_layer(self, previous: "Placement") -> np.ndarray:
        """[L] int64: expert copies each layer receives to turn ``previous`` into this placement.

        Slots inside one device relabel for free, so a device only receives the experts it now
        holds and did not hold before.
        """
        if not isinstance(previous, Placement):
            raise TypeError(f"previous must be a Placement, got {type(previous).__name__}")
        if (previous.phy2log.shape != self.phy2log.shape or previous.num_experts != self.num_experts
                or not np.array_equal(previous.slot_device, self.slot_device)):
            raise ValueError(
                f"previous placement has shape {previous.phy2log.shape} with "
                f"{previous.num_experts} experts; this one {self.phy2log.shape} with "
                f"{self.num_experts}: moves are only defined between placements of the same "
                "layers, slots and devices"
            )
        E, G = self.num_experts, self.num_devices
        out = np.zeros(self.num_layers, dtype=np.int64)
        for layer in range(self.num_layers):
            new = np.zeros(G * E, dtype=bool)
            old = np.zeros(G * E, dtype=bool)
            new[self.slot_device * E + self.phy2log[layer]] = True
            old[previous.slot_device * E + previous.phy2log[layer]] = True
            out[layer] = int(np.count_nonzero(new & ~old))
        return out

    def moves_from(self, previous: "Placement | None") -> int:
        """Expert copies to reach this placement from ``previous`` (all S*L of them if None)."""
        if previous is None:
            return self.num_layers * self.num_slots
        return int(self.moves_per_layer(previous).sum())

    # -- persistence ----------------------------------------------------------------------------

    def save(self, path: str | os.PathLike, topology: Topology | None = None) -> None:
        """Write to ``path`` as a numpy ``.npz`` archive (the suffix is added if missing).

        Given the ``topology`` it was planned for (checked with :meth:`validate`), the file keeps
        that too (its slots must be the placement's): :meth:`load_with_topology` returns it, and
        ``moebalance inspect`` uses it.
        """
        extra = {}
        if topology is not None:
            self._check_slots_of(topology)
            extra = {"topology_speed": topology.speed, "topology_slots": topology.slots,
                     "topology_node": topology.node}
        np.savez(path, phy2log=self.phy2log, share=self.share, slot_device=self.slot_device,
                 num_experts=np.int64(self.num_experts),
                 format=np.array(json.dumps({"kind": "moebalance.Placement", "version": 1})),
                 **extra)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Placement":
        """The placement :meth:`save` wrote to ``path`` (the ``.npz`` suffix may be left off)."""
        return cls.load_with_topology(path)[0]

    @classmethod
    def load_with_topology(cls, path: str | os.PathLike) -> "tuple[Placement, Topology | None]":
        """The placement saved at ``path`` and the topology saved with it (None if none was)."""
        path = os.fspath(path)
        # save() appends .npz to a bare path; find the file under the name save() was given.
        if not os.path.exists(path) and os.path.exists(path + ".npz"):
            path += ".npz"
        data = np.load(path, allow_pickle=False)
        if not isinstance(data, np.lib.npyio.NpzFile):
            raise ValueError(f"{path} holds one numpy array, not a saved moebalance Placement (the "
                             f".npz archive Placement.save writes)")
        with data:
            if "phy2log" not in data or "share" not in data:
                raise ValueError(f"{path} is not a saved moebalance Placement")
            placement = cls(phy2log=data["phy2log"], share=data["share"],
                            slot_device=data["slot_device"], num_experts=int(data["num_experts"]))
            topology = None
            if "topology_speed" in data:
                topology = Topology.from_arrays(data["topology_speed"], data["topology_slots"],
                                                data["topology_node"])
        if topology is not None:
            placement._check_slots_of(topology)
        return placement, topology

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Placement) and self.num_experts == other.num_experts
                and np.array_equal(self.phy2log, other.phy2log)
                and np.array_equal(self.share, other.share)
                and np.array_equal(self.slot_device, other.slot_device))

    __hash__ = None  # mutable-free but array-valued: compare, don't hash

    def __repr__(self) -> str:
        rep = self.replicas
        if self.num_layers == 0:
            return (f"Placement(num_layers=0, num_slots={self.num_slots}, "
                    f"num_devices={self.num_devices}, num_experts={self.num_experts})")
        equal = np.allclose(self.share, 1.0 / np.take_along_axis(rep, self.phy2log, axis=1))
        return (f"Placement(num_layers={self.num_layers}, num_slots={self.num_slots}, "
                f"num_devices={self.num_devices}, num_experts={self.num_experts}, "
                f"replicas per expert {int(rep.min())}..{int(rep.max())}, "
                f"shares {'equal' if equal else 'weighted'})")
