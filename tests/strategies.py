"""Hypothesis strategies for moebalance tests: random topologies, loads and valid placements.

Shapes: L layers, E logical experts, S physical slots, G devices.

Import from a test module as ``from strategies import topologies, loads, placements``
(pytest puts ``tests/`` on ``sys.path``).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from moebalance import Device, Placement, Topology

# Speeds are drawn from a short list of ratios so that ties (common on real clusters: several
# cards of one model) happen often, and from a continuous range so that odd ratios happen too.
_SPEED_RATIOS = (0.25, 0.5, 1.0, 1.5, 2.0, 3.0)


@st.composite
def topologies(draw, max_devices: int = 8, max_slots: int = 4, heterogeneous: bool = True,
               min_devices: int = 1, min_slots: int = 1) -> Topology:
    """A Topology of ``min_devices..max_devices`` devices with ``min_slots..max_slots`` slots each.

    ``heterogeneous=False`` gives identical devices (speed 1, one slot count); otherwise every
    device draws its own speed and slot count. Devices are grouped into nodes of a drawn size.
    """
    if not 1 <= min_devices <= max_devices:
        raise ValueError(f"need 1 <= min_devices <= max_devices, got {min_devices}, {max_devices}")
    if not 1 <= min_slots <= max_slots:
        raise ValueError(f"need 1 <= min_slots <= max_slots, got {min_slots}, {max_slots}")
    num_devices = draw(st.integers(min_devices, max_devices))
    per_node = draw(st.integers(1, num_devices))
    if not heterogeneous:
        slots = draw(st.integers(min_slots, max_slots))
        return Topology.uniform(num_devices, slots, devices_per_node=per_node)
    speed = st.one_of(st.sampled_from(_SPEED_RATIOS),
                      st.floats(0.1, 10.0, allow_nan=False, allow_infinity=False))
    return Topology([Device(speed=draw(speed), slots=draw(st.integers(min_slots, max_slots)),
                            node=g // per_node)
                     for g in range(num_devices)])


def loads(num_layers: int, num_experts: int, max_load: float = 1e4) -> st.SearchStrategy:
    """Token loads ``[num_layers, num_experts]`` float64, finite and >= 0.

    Mixes whole token counts (what a tracker records) with fractional values (EMA-smoothed
    counts); zeros, including all-zero layers, are allowed.
    """
    # Fractions stay above 1e-6: subnormal loads would only test floating-point underflow.
    element = st.one_of(st.integers(0, int(max_load)).map(float),
                        st.floats(1e-6, max_load, allow_nan=False, allow_infinity=False))
    return hnp.arrays(np.float64, (num_layers, num_experts), elements=element)


def placements(topology: Topology, num_layers: int, num_experts: int,
               equal_shares: bool = False) -> st.SearchStrategy:
    """VALID placements (DESIGN invariant 1) of ``num_experts`` experts on ``topology``.

    Every expert has >= 1 replica per layer, no device holds two replicas of one expert, every
    slot holds an expert, and the shares of each expert are >= 0 (some may be exactly 0) and sum
    to 1. ``equal_shares=True`` splits each expert's tokens evenly over its replicas.

    Needs ``max(topology.slots) <= num_experts <= topology.num_slots``: otherwise no valid
    placement exists, and this raises ValueError when the strategy is built.
    """
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be a moebalance.Topology, got {type(topology).__name__}")
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    if not int(topology.slots.max()) <= num_experts <= topology.num_slots:
        raise ValueError(
            f"no valid placement of {num_experts} experts on {topology!r}: need "
            f"max(slots)={int(topology.slots.max())} <= num_experts <= "
            f"num_slots={topology.num_slots}"
        )
    return _placements(topology, num_layers, num_experts, equal_shares)


@st.composite
def _placements(draw, topology: Topology, num_layers: int, num_experts: int,
                equal_shares: bool) -> Placement:
    S, E = topology.num_slots, num_experts
    phy2log = np.empty((num_layers, S), dtype=np.int64)
    share = np.empty((num_layers, S), dtype=np.float64)
    for layer in range(num_layers):
        # One replica of every expert goes to E distinct slots: distinct experts never collide on
        # a device. Then each device fills its other slots with experts it does not hold yet
        # (there are enough, since no device has more slots than there are experts).
        row = np.full(S, -1, dtype=np.int64)
        first = draw(st.permutations(range(S)))[:E]
        row[np.asarray(first, dtype=np.int64)] = np.arange(E)
        for g in range(topology.num_devices):
            own = topology.device_slots(g)
            free = [s for s in own if row[s] < 0]
            if not free:
                continue
            held = set(row[list(own)].tolist())
            candidates = [e for e in range(E) if e not in held]
            row[free] = draw(st.permutations(candidates))[:len(free)]
        phy2log[layer] = row
        if equal_shares:
            weight = np.ones(S)
        else:
            weight = np.asarray(draw(st.lists(st.integers(0, 8), min_size=S, max_size=S)),
                                dtype=np.float64)
        total = np.bincount(row, weights=weight, minlength=E)
        # An expert whose replicas all drew weight 0 splits evenly instead.
        weight = np.where(total[row] > 0, weight, 1.0)
        total = np.bincount(row, weights=weight, minlength=E)
        share[layer] = weight / total[row]
    return Placement(phy2log=phy2log, share=share, slot_device=topology.slot_device,
                     num_experts=E)


class PlacementCase(NamedTuple):
    """One random problem: a topology, a valid placement on it and loads ``[L, E]``."""

    topology: Topology
    placement: Placement
    loads: np.ndarray


@st.composite
def placement_cases(draw, max_devices: int = 6, max_slots: int = 4, max_layers: int = 3,
                    heterogeneous: bool = True, equal_shares: bool = False) -> PlacementCase:
    """A topology, a number of experts that fits it, a valid placement and matching loads."""
    topology = draw(topologies(max_devices=max_devices, max_slots=max_slots,
                               heterogeneous=heterogeneous))
    num_layers = draw(st.integers(1, max_layers))
    num_experts = draw(st.integers(int(topology.slots.max()), topology.num_slots))
    placement = draw(placements(topology, num_layers, num_experts, equal_shares=equal_shares))
    return PlacementCase(topology, placement, draw(loads(num_layers, num_experts)))
