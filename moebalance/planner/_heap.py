"""The small binary max-heap over (key, id) pairs that packing and counting use: larger key
first, then smaller id (so ties resolve by index and plans never depend on the heap's history).

Kernels (:func:`~._jit.kernel`): ``keys`` [N] float64 and ``ids`` [N] int64 hold the heap in
their first ``size`` entries; the functions that grow or shrink it return the new size.
"""

from __future__ import annotations

from ._jit import kernel


@kernel
def heap_before(key_a, id_a, key_b, id_b):
    return key_a > key_b or (key_a == key_b and id_a < id_b)


@kernel
def heap_push(keys, ids, size, key, idx):
    i = size
    keys[i] = key
    ids[i] = idx
    while i > 0:
        parent = (i - 1) // 2
        if heap_before(keys[i], ids[i], keys[parent], ids[parent]):
            keys[i], keys[parent] = keys[parent], keys[i]
            ids[i], ids[parent] = ids[parent], ids[i]
            i = parent
        else:
            break
    return size + 1


@kernel
def heap_pop(keys, ids, size):
    """Remove the top; return the new size (the top was keys[0], ids[0] before the call)."""
    size -= 1
    heap_replace_top(keys, ids, size, keys[size], ids[size])
    return size


@kernel
def heap_replace_top(keys, ids, size, key, idx):
    """Replace the top with (key, idx) and restore the heap order (one sift down)."""
    keys[0] = key
    ids[0] = idx
    heap_sift_down(keys, ids, size, 0)


@kernel
def heap_sift_down(keys, ids, size, i):
    while True:
        left = 2 * i + 1
        best = i
        if left < size and heap_before(keys[left], ids[left], keys[best], ids[best]):
            best = left
        if left + 1 < size and heap_before(keys[left + 1], ids[left + 1], keys[best], ids[best]):
            best = left + 1
        if best == i:
            break
        keys[i], keys[best] = keys[best], keys[i]
        ids[i], ids[best] = ids[best], ids[i]
        i = best
