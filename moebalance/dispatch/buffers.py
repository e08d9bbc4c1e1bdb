"""Reusable CPU buffers for the dispatch: the outputs and intermediates of the row exchanges.

A fresh mmap'ed CPU buffer pays a page fault per 4 KiB on first touch, as costly as filling it;
the pool below lends large buffers again once nothing else references them.
:func:`release_buffers` frees the pool.
"""

from __future__ import annotations

import math
import threading

import torch

__all__ = ["POOL", "release_buffers"]


class _BufferPool:
    """Large CPU buffers kept across calls, reused only when nothing else references them.

    A fresh CPU allocation of tens of MiB comes from ``mmap`` and pays a page fault per 4 KiB
    on first touch -- as much time as the copy that fills it. The pool keeps the storages of
    the buffers it handed out and lends one again once its use count shows that the pool holds
    the only reference: the caller dropped every tensor on it and autograd saved none. A tensor
    still alive anywhere (returned to the user, saved for backward, viewed by numpy) keeps its
    storage out of the pool, so reuse can never overwrite live data.
    """

    MIN_BYTES = 1 << 20   # below this the allocator's free lists are already cheap
    CAPACITY = 8          # storages remembered; the least recently lent is forgotten first

    def __init__(self) -> None:
        self._storages: list[torch.UntypedStorage] = []
        self._lock = threading.Lock()

    def empty(self, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised contiguous tensor of ``shape`` and ``dtype`` on ``device``."""
        numel = math.prod(shape)
        nbytes = numel * dtype.itemsize
        if device.type != "cpu" or nbytes < self.MIN_BYTES or _use_count is None:
            return torch.empty(shape, dtype=dtype, device=device)
        with self._lock:
            best = None
            for i, storage in enumerate(self._storages):
                size = storage.nbytes()
                # Sole owner, large enough, and not so large that a small request pins it.
                if (nbytes <= size <= 2 * nbytes and _use_count(storage._cdata) == 1
                        and (best is None or size < self._storages[best].nbytes())):
                    best = i
            if best is None:
                # Slack for the step-to-step variation of M; untouched pages cost nothing.
                storage = torch.UntypedStorage(nbytes + nbytes // 8, device=device)
            else:
                storage = self._storages.pop(best)
            self._storages.append(storage)
            del self._storages[:-self.CAPACITY]
        return torch.empty(0, dtype=dtype, device=device).set_(storage, 0, shape)

    def clear(self) -> None:
        """Forget every kept storage (tensors still using one keep it alive)."""
        with self._lock:
            self._storages.clear()


# The storage use count is not public API; without it the pool simply allocates fresh buffers.
_use_count = getattr(torch._C, "_storage_Use_Count", None)
POOL = _BufferPool()


def release_buffers() -> None:
    """Drop the CPU buffers the dispatchers of this process keep for reuse (frees their memory)."""
    POOL.clear()
