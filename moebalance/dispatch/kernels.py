"""Which implementation of the dispatch kernels runs for tensors on a given device type.

Every implementation is a module with the same functions (``route``, ``sort_by_slot``,
``gather_rows``, ``combine``, ``combine_weight_grad``) and the same results:

* ``reference`` — plain torch, any device; the definition the others are tested against.
* ``numba_kernels`` — parallel Numba kernels, CPU tensors.
* ``cuda`` — CUDA C++ kernels from ``csrc/`` through CuPy, CUDA tensors.

The choice comes from :func:`moebalance.backends.backend` ("dispatch", device type). Where that
names kernels that cannot run on the device type (Numba for CUDA tensors), the torch reference
runs instead, so one forced setting never breaks the other device type.
"""

from __future__ import annotations

from types import ModuleType

from ..backends import backend
from . import reference

__all__ = ["kernels_for", "kernel_backend", "reference"]

_DEVICE_TYPES = ("cpu", "cuda")


def kernel_backend(device_type: str) -> str:
    """Name of the kernels used for tensors on ``device_type``: "cuda", "numba" or "torch"."""
    if device_type not in _DEVICE_TYPES:
        raise ValueError(f"device_type must be one of {list(_DEVICE_TYPES)}, got {device_type!r}; "
                         f"pass tensor.device.type")
    name = backend("dispatch", device_type)
    runs_here = {"cpu": ("numba", "torch"), "cuda": ("cuda", "torch")}[device_type]
    return name if name in runs_here else "torch"


def kernels_for(device_type: str) -> ModuleType:
    """The kernel module for tensors on ``device_type`` ("cpu" or "cuda")."""
    name = kernel_backend(device_type)
    if name == "numba":
        from . import numba_kernels

        return numba_kernels
    if name == "cuda":
        from . import cuda

        return cuda
    return reference
