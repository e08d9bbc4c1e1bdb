"""The per-step re-split on the GPU: ``csrc/resplit.cu`` through CuPy, one launch per layer.

The source ships inside the package (``moebalance._csrc``) and is compiled by ``cupy.RawModule``
(NVRTC) once per device; the kernel handle is cached. The launch runs on torch's current stream,
tensors travel as raw device pointers checked against the kernel's parameters
(:meth:`~.cuda_source.CudaSource.launch`), and the output and scratch come from torch's caching
allocator: no host sync. Same sweeps and flow as :func:`.resplit_kernel.resplit_layer`.

Importing this module never needs a GPU; calling it without CuPy and a CUDA device raises
RuntimeError.

Legend: E experts, X most replicas of an expert, G devices, C colour classes.
"""

from __future__ import annotations

import torch

from ..backends import has_cupy_gpu
from .cuda_source import COMPILE_OPTIONS, CudaSource

__all__ = ["SOURCE_FILE", "KERNEL_NAME", "COMPILE_OPTIONS", "MAX_REPLICAS", "source",
           "resplit_shares_cuda"]

SOURCE_FILE = "resplit.cu"
KERNEL_NAME = "resplit_layer"
# Replicas of one expert the kernel's per-thread scratch holds (MAX_REPLICAS in the source).
MAX_REPLICAS = 64
_BLOCK = 256

_SOURCE = CudaSource(SOURCE_FILE, probe=KERNEL_NAME)


def source() -> str:
    """The CUDA C++ source of the re-split kernel, as shipped with the package."""
    return _SOURCE.text()


def resplit_shares_cuda(w_E: torch.Tensor, share_EX: torch.Tensor, plan, *, sweeps: int,
                        exact: bool) -> torch.Tensor:
    """This step's shares on the GPU (see :func:`moebalance.dispatch.shares.resplit_shares`).

    Args:
        w_E: [E] pairs of each expert (any real or integer dtype), on a CUDA device.
        share_EX: [E, X] float64 starting shares, on the same device.
        plan: the layer's :class:`~moebalance.dispatch.shares.ResplitPlan`, on that device.
        sweeps: water-filling sweeps. exact: then the exact flow.

    Returns:
        [E, X] float64 new shares, on the device.
    """
    if not has_cupy_gpu():
        raise RuntimeError("the CUDA re-split needs CuPy and a visible CUDA GPU (pip install "
                           "'moebalance[cupy]'); on this machine use the 'numba' or 'torch' "
                           "re-split backend (moebalance.force_backend('resplit', 'torch'))")
    device = w_E.device
    if device.type != "cuda" or plan.device_EX.device != device:
        raise ValueError(f"w_E ({w_E.device}) and the ResplitPlan ({plan.device_EX.device}) must "
                         f"be on one CUDA device; build the plan with device=w_E.device")
    E, X = plan.device_EX.shape
    if X > MAX_REPLICAS:
        raise ValueError(f"the CUDA re-split handles up to {MAX_REPLICAS} replicas of an expert, "
                         f"the placement has {X}; use the torch re-split backend")
    # The kernel reads raw pointers: a short or misplaced tensor would be read out of bounds.
    if tuple(w_E.shape) != (E,) or tuple(share_EX.shape) != (E, X):
        raise ValueError(f"w_E must be [E] = [{E}] and share_EX [E, X] = [{E}, {X}] for this "
                         f"ResplitPlan, got {tuple(w_E.shape)} and {tuple(share_EX.shape)}")
    if share_EX.device != device:
        raise ValueError(f"share_EX is on {share_EX.device}, w_E on {device}: put both on one "
                         f"device")
    for name, t, dtype in (("device_EX", plan.device_EX, torch.int64),
                           ("speed_G", plan.speed_G, torch.float64),
                           ("order_V", plan.order_V, torch.int64),
                           ("class_starts_C1", plan.class_starts_C1, torch.int64)):
        if t.dtype != dtype or t.device != device or not t.is_contiguous():
            raise ValueError(f"ResplitPlan.{name} must be a contiguous {dtype} tensor on "
                             f"{device}, got {t.dtype} on {t.device}; build the plan with "
                             f"resplit_plan(table, speeds, device=w_E.device)")
    G = plan.speed_G.shape[0]
    C = plan.class_starts_C1.shape[0] - 1
    w = w_E.to(torch.float64).contiguous()
    share = share_EX.to(torch.float64, copy=True).contiguous()
    load = torch.empty(G, dtype=torch.float64, device=device)
    fwork = torch.empty(E * X + E + 3 * G, dtype=torch.float64, device=device)
    iwork = torch.empty(E * X + 6 * E + 6 * G + 4, dtype=torch.int64, device=device)
    _SOURCE.launch(device, KERNEL_NAME, 1, _BLOCK,
                   (w, plan.device_EX, plan.speed_G, plan.order_V, plan.class_starts_C1, share,
                    load, E, X, G, C, sweeps, 1 if exact else 0, fwork, iwork))
    return share
