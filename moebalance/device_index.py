"""Device copies of small host index tensors, made once per device and reused on every step.

A per-step ``index.to(device)`` of a pageable CPU tensor is a host sync on CUDA (the copy
waits for the stream). Placement-derived indices (replicated slots, first holders, the rows a
peer exchanges) change only with the placement, so the objects that hold them keep one
:class:`DeviceIndex` each and read ``.on(device)`` on the per-step path: the first call copies
through pinned memory with ``non_blocking=True`` on the current stream, later calls copy nothing.
"""

from __future__ import annotations

import torch

__all__ = ["DeviceIndex", "to_device_async"]


def to_device_async(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (a CPU tensor) on ``device`` without making the host wait on a CUDA device.

    CUDA: staged through pinned memory and copied with ``non_blocking=True`` on the current
    stream (torch's pinned-memory allocator keeps the staging block until the copy has run).
    """
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class DeviceIndex:
    """A CPU index tensor and its copies on the devices it was asked for (one copy each).

    A copy is made on the stream current at its first use; the per-step paths that read it run
    on that stream (the compute stream), so later uses are ordered after the copy.
    """

    __slots__ = ("host", "_copies")

    def __init__(self, host: torch.Tensor) -> None:
        self.host = host
        self._copies: dict[torch.device, torch.Tensor] = {}

    def on(self, device: torch.device | str) -> torch.Tensor:
        """The index on ``device`` (copied at the first call for that device)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        copy = self._copies.get(device)
        if copy is None:
            copy = self._copies[device] = to_device_async(self.host, device)
        return copy
