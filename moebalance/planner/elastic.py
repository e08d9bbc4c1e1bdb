"""Re-plans onto a topology that lost or gained devices.

When a device fails (or new ones join), the job continues on a new set of devices: a
``device_map`` says which new device each old one became (``-1``: lost). :func:`replan_onto`
carries every surviving device's experts over to the device it became, gives the experts that
lost every copy a slot (they are *restores*: their rows must come from a checkpoint or another
data-parallel replica), fills any other free slot, and then lets :func:`moebalance.plan` repair
the balance from there with ``previous=`` (so survivors stay where that is good, and
``max_moves`` caps the copies beyond the carried placement).

Legend: G old devices, G' new devices, L layers, E experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..placement import Placement
from ..topology import Topology

__all__ = ["TopologyReplan", "replan_onto", "carry_over"]


@dataclass(frozen=True)
class TopologyReplan:
    """The outcome of :func:`replan_onto`.

    Attributes:
        placement: the new placement, on the new topology.
        carried: the old placement carried over to the new devices (before re-balancing).
        restores: [(layer, expert)] that no surviving device held: load them from a checkpoint.
        kept: expert copies of the old placement still on their (mapped) device.
        moves: expert copies a new device holds that its old device did not (across the map;
            restores included).
    """

    placement: Placement
    carried: Placement
    restores: list
    kept: int
    moves: int


def _check_map(device_map, old: Placement, new_topology: Topology) -> np.ndarray:
    m = np.asarray(device_map)
    if m.shape != (old.num_devices,) or not np.issubdtype(m.dtype, np.integer):
        raise ValueError(f"device_map must give, for each of the {old.num_devices} old devices, "
                         f"its new device id or -1 if it was lost; got "
                         f"{np.asarray(device_map).tolist()!r}")
    alive = m[m >= 0]
    if alive.size and (alive.max() >= new_topology.num_devices
                       or np.unique(alive).size != alive.size):
        raise ValueError(f"device_map must map old devices to distinct new devices in "
                         f"[0, {new_topology.num_devices}) (or -1), got {m.tolist()}")
    return m.astype(np.int64)


def carry_over(old: Placement, new_topology: Topology, device_map, loads=None):
    """The old placement moved onto the new devices, with every expert placed at least once.

    Returns (carried placement, restores [(layer, expert)], kept copies). A surviving device keeps
    its experts (its heaviest first, up to its new slot count); experts with no surviving copy
    go to the free slots of the devices with the most free slots; remaining free slots take
    further replicas of the heaviest experts. Shares are split evenly per expert (the planner
    sets them).
    """
    m = _check_map(device_map, old, new_topology)
    L, E = old.num_layers, old.num_experts
    G2 = new_topology.num_devices
    slots = np.asarray(new_topology.slots, dtype=np.int64)
    slot_device = np.repeat(np.arange(G2), slots)
    w = np.ones((L, E)) if loads is None else np.asarray(loads, dtype=np.float64).reshape(L, E)
    phy2log = np.zeros((L, slot_device.size), dtype=np.int64)
    restores, kept = [], 0
    if int(slots.sum()) < E:
        raise ValueError(f"the new topology has {int(slots.sum())} slots per layer, fewer than the "
                         f"{E} experts; it cannot hold the model")
    for layer in range(L):
        held = [[] for _ in range(G2)]
        for g in range(old.num_devices):
            if m[g] < 0:
                continue
            experts = old.phy2log[layer, old.slot_device == g]
            experts = experts[np.argsort(-w[layer, experts], kind="stable")]
            held[m[g]] = experts[:slots[m[g]]].tolist()
        kept += sum(len(h) for h in held)
        present = set(e for h in held for e in h)
        missing = [e for e in np.argsort(-w[layer], kind="stable").tolist() if e not in present]
        for e in missing:
            free = [slots[g] - len(held[g]) for g in range(G2)]
            g = int(np.argmax(free))
            if free[g] <= 0:
                # Every slot is taken by survivors: give up a copy of an expert held twice.
                g, drop = _replaceable(held, w[layer])
                held[g].remove(drop)
                kept -= 1
            held[g].append(e)
            restores.append((layer, e))
        order = np.argsort(-w[layer], kind="stable").tolist()
        for g in range(G2):
            for e in order:
                if len(held[g]) >= slots[g]:
                    break
                if e not in held[g]:
                    held[g].append(e)
        phy2log[layer] = np.concatenate([np.asarray(h, dtype=np.int64) for h in held])
    counts = np.stack([np.bincount(row, minlength=E) for row in phy2log])
    share = 1.0 / counts[np.arange(L)[:, None], phy2log]
    return Placement(phy2log, share, slot_device, E).validate(new_topology), restores, kept


def _replaceable(held: list, w_E: np.ndarray) -> tuple[int, int]:
    """(device, expert) of the lightest expert copy whose expert has another copy."""
    counts = {}
    for h in held:
        for e in h:
            counts[e] = counts.get(e, 0) + 1
    best = None
    for g, h in enumerate(held):
        for e in h:
            if counts[e] > 1 and (best is None or w_E[e] < w_E[best[1]]):
                best = (g, e)
    if best is None:
        raise ValueError("the new topology has no slot left for an expert that lost every copy")
    return best


def replan_onto(loads, new_topology: Topology, previous: Placement, device_map, *,
                max_moves: int | None = None, **plan_options) -> TopologyReplan:
    """Re-plan onto ``new_topology`` after devices were lost or added.

    Args:
        loads: [L, E] loads to balance.
        new_topology: the devices that remain (and any new ones).
        previous: the placement on the old devices.
        device_map: [G] new device id of each old device, -1 for a lost one (new devices that no
            old one maps to start empty).
        max_moves: cap on copies beyond the carried placement (restores are extra and required).
        plan_options: passed to :func:`moebalance.plan`.

    Returns:
        :class:`TopologyReplan`.
    """
    from . import plan

    if not isinstance(previous, Placement):
        raise TypeError(f"previous must be a moebalance.Placement, got {type(previous).__name__}")
    if not isinstance(new_topology, Topology):
        raise TypeError(f"new_topology must be a moebalance.Topology, got "
                        f"{type(new_topology).__name__}")
    carried, restores, kept = carry_over(previous, new_topology, device_map, loads)
    new = plan(loads, new_topology, previous=carried, max_moves=max_moves, **plan_options)
    m = _check_map(device_map, previous, new_topology)
    moves = 0
    for layer in range(new.num_layers):
        for g in range(new_topology.num_devices):
            had = set()
            for old_g in np.flatnonzero(m == g).tolist():
                had |= set(previous.phy2log[layer, previous.slot_device == old_g].tolist())
            moves += len(set(new.phy2log[layer, new.slot_device == g].tolist()) - had)
    return TopologyReplan(placement=new, carried=carried, restores=restores, kept=kept, moves=moves)
