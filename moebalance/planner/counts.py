"""Step 1, replica counts: how many replicas of each expert carry load.

Kernels (:func:`~._jit.kernel`). Shapes: E experts.
"""

from __future__ import annotations

import numpy as np

from ._heap import heap_pop, heap_push, heap_sift_down
from ._jit import kernel


@kernel
def replica_counts(w, num_slots, num_devices, max_piece):
    """[E] int64: replicas per expert that carry load: >= 1, <= num_devices, sum <= num_slots.

    Greedy apportionment: spare slots go, one at a time, to the expert with the largest load per
    replica (ties: lower expert id) until no piece is larger than ``max_piece`` (the most one
    slot of any device should carry) or the slots run out. Slots left over become valves.
    """
    E = w.shape[0]
    r = np.ones(E, dtype=np.int64)
    extra = num_slots - E
    if extra <= 0 or num_devices <= 1:
        return r
    keys = w.copy()
    ids = np.arange(E)
    size = E
    for i in range(E // 2 - 1, -1, -1):  # bottom-up heapify, O(E)
        heap_sift_down(keys, ids, size, i)
    while extra > 0 and size > 0 and keys[0] > max_piece:
        e = ids[0]
        size = heap_pop(keys, ids, size)
        r[e] += 1
        extra -= 1
        if r[e] < num_devices:
            size = heap_push(keys, ids, size, w[e] / r[e], e)
    return r
