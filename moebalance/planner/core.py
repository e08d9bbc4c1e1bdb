"""The planning method, one MoE layer at a time, and what its steps share: the devices as one
structure (:class:`Devices`) and the tuning constants of more than one step.

Every step is a file of :func:`~._jit.kernel` functions (plain Python over numpy arrays in the
subset Numba compiles), with the numpy glue :func:`moebalance.plan` calls beside them. Run as
they are, the kernels are the reference; :func:`._jit.kernels` gives the same functions
compiled. Nothing in them validates: :func:`moebalance.plan` has checked the inputs.

The method, per layer (E experts with loads ``w``, G devices with ``speed``/``slots``), in the
order of the files:

1. Counts (:mod:`.counts`): ``replica_counts``, spare slots one at a time to the expert with
   the largest load per replica, at most one per device.
2. Packing (:mod:`.packing`): ``pack_replicas``, replicas heaviest first to the device that
   needs the most load per free slot; ``add_valves``, the spare slots as share-0 replicas.
3. Shares (:mod:`.shares`): ``balance_shares``, water filling of every replicated expert's
   shares. It minimises ``sum_g load_g^2 / speed_g``, whose minimiser also minimises ``max_g
   load_g/speed_g``; the achievable device loads form a polymatroid base polytope (Fujishige
   1980). With token shares an expert is a divisible job, so the ideal ``max_g load_g /
   speed_g = sum(w) / sum(speed)`` is reachable whenever the spare slots leave room for the
   split pieces.
4. Chain (:mod:`.chain`): ``chain_layer``, whole experts on all but ``reserve[g]`` slots of
   every device, then valves in the free slots that bring every device to its ideal load
   exactly: a ring of valves (``ring_valves``, McNaughton's wrap-around closed into a ring,
   with a free circulation that keeps every valve mid-range) or, when that does not fit, a
   north-west-corner chain (at most G - 1 valves). Exact on devices of equal speed and slots
   with S - E >= G in practice.
5. Improve (:mod:`.improve`): ``improve_layer``, single-slot changes that lower the hottest
   device.
6. Repair (:mod:`.repair`), the re-plan: the previous placement with shares re-split for the
   new loads, then ``repair_step`` moves, always on the layer with the most tokens above its
   target time: progress is the total excess ``sum_g max(0, load_g - target * speed_g)``
   (moves on devices tied at the maximum count), a move puts a piece of a device above the
   target on a device with room, in the slot of a replica whose expert's other replicas take
   its share (their share slack), and a swap of two pieces serves where no such slot exists.
   No layer is re-planned from scratch.
7. Fresh (:mod:`.fresh`), the plan from scratch: the chain (4); where no chain is exact (too
   few spare slots), counts (1), packing (2), shares (3) and improving moves (5). The layer
   keeps the best plan.

The plans for the steps of a window (:mod:`.steps`) and the EPLB drop-in (:mod:`.eplb`, counts
and packing with equal shares) are built from the same steps; :mod:`.relabel` renames a new
plan's equal devices after the placement in service, so that its moves are few.

Shapes: E experts, G devices, S slots (grouped by device), L layers.
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np

from ..topology import Topology
from ._jit import kernel

# Share sweeps of the water filling per re-balance (small layers get 16x, see balance_shares).
MAX_SWEEPS = 16
# Candidate moves tried with a full share re-balance per improvement step, best estimate first.
MOVE_TRIALS = 6
# Layers with slots x experts up to this are improved by exhaustive single-change search.
EXHAUSTIVE_SIZE = 256

Devices = namedtuple("Devices", "speed slots node slot_offsets slot_device")
Devices.__doc__ = """The devices as the kernels take them: one structure of numpy arrays (Numba
compiles a namedtuple of arrays), so a kernel's arguments are the layer's own data.

speed [G] float64, slots [G] int64, node [G] int64, slot_offsets [G+1] int64 (device ``g`` owns
slots ``slot_offsets[g] : slot_offsets[g + 1]``), slot_device [S] int64."""


def devices_of(topology: Topology) -> Devices:
    """The :class:`Devices` of ``topology`` (its own read-only arrays, not copies)."""
    return Devices(topology.speed, topology.slots, topology.node, topology.slot_offsets,
                   topology.slot_device)


@kernel
def alike_devices(num_devices: int, slots_each: int) -> Devices:
    """:class:`Devices` of ``num_devices`` devices of speed 1 with ``slots_each`` slots, one
    node (the form EPLB's packing assumes). Also a kernel, so compiled code can build it."""
    offsets = np.arange(num_devices + 1, dtype=np.int64) * slots_each
    slot_device = np.arange(num_devices * slots_each, dtype=np.int64) // slots_each
    return Devices(np.ones(num_devices), np.full(num_devices, slots_each, dtype=np.int64),
                   np.zeros(num_devices, dtype=np.int64), offsets, slot_device)
