"""Conversion and checking of user-supplied values at the public boundary: arrays of loads and
the counts (layers, experts, tokens, ...) that size them."""

from __future__ import annotations

import numpy as np


def positive_int(value, name: str) -> int:
    """``value`` as an int after checking that it is an integer >= 1 (bools are not).

    Raises TypeError for anything but a Python or numpy integer, ValueError below 1; both name
    ``name``. For integers typed on a command line, see :mod:`moebalance.cli.args`.
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer >= 1, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def to_numpy(x, name: str) -> np.ndarray:
    """A numpy view/copy of a numpy, torch (CPU or CUDA) or cupy array, or of a nested list."""
    if isinstance(x, np.ndarray):
        return x
    module = type(x).__module__
    if module.startswith("torch"):
        import torch

        t = x.detach().to("cpu")
        if t.dtype.is_floating_point and t.dtype not in (torch.float16, torch.float32, torch.float64):
            t = t.to(torch.float32)  # bfloat16 / float8 have no numpy dtype; float32 holds them exactly
        return t.numpy()
    if module.startswith("cupy"):
        return x.get()
    try:
        return np.asarray(x)
    except Exception as exc:  # pragma: no cover - message matters, not the type
        raise TypeError(f"{name} must be a numpy, torch or cupy array, got {type(x).__name__}") from exc


def as_loads(loads, name: str = "loads", num_experts: int | None = None) -> np.ndarray:
    """Check and return per-layer expert loads as a C-contiguous float64 array [L, E].

    A 1-D array is taken as one layer. Raises ValueError for NaN/inf/negative entries or a
    wrong number of experts, naming ``name``.
    """
    arr = to_numpy(loads, name)
    if arr.dtype == np.bool_ or not (np.issubdtype(arr.dtype, np.number)):
        raise TypeError(f"{name} must hold real numbers (token counts), got dtype {arr.dtype}")
    if np.iscomplexobj(arr):
        raise TypeError(f"{name} must hold real numbers, got complex dtype {arr.dtype}")
    if arr.ndim == 1:
        arr = arr[None, :]
    if arr.ndim != 2:
        raise ValueError(
            f"{name} must have shape [num_layers, num_experts] (or [num_experts]), got shape {arr.shape}"
        )
    if arr.shape[0] < 1 or arr.shape[1] < 1:
        raise ValueError(f"{name} must have at least one layer and one expert, got shape {arr.shape}")
    if num_experts is not None and arr.shape[1] != num_experts:
        raise ValueError(
            f"{name} has {arr.shape[1]} experts per layer but {num_experts} were expected; "
            f"pass loads of shape [num_layers, {num_experts}]"
        )
    out = np.ascontiguousarray(arr, dtype=np.float64)
    if not np.all(np.isfinite(out)):
        bad = np.argwhere(~np.isfinite(out))[0]
        raise ValueError(
            f"{name} must be finite; found {out[tuple(bad)]} at [layer {bad[0]}, expert {bad[1]}]. "
            f"Replace NaN/inf counts (e.g. with np.nan_to_num) before planning"
        )
    if np.any(out < 0):
        bad = np.argwhere(out < 0)[0]
        raise ValueError(
            f"{name} must be >= 0 (token counts); found {out[tuple(bad)]} at "
            f"[layer {bad[0]}, expert {bad[1]}]"
        )
    return out


def planning_loads(loads, topology) -> np.ndarray:
    """Check ``topology`` and ``loads`` [L, E] together for planning; return loads as float64.

    Raises TypeError for a topology that is not a moebalance.Topology, ValueError when the
    topology has fewer slots than experts or a device with more slots than there are experts.
    """
    from .topology import Topology

    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be a moebalance.Topology, got {type(topology).__name__}")
    w = as_loads(loads, "loads")
    E, S = w.shape[1], topology.num_slots
    if S < E:
        raise ValueError(
            f"topology has {S} slots for {E} experts: every expert needs at least one slot; add "
            f"devices or slots per device (slots >= num_experts)"
        )
    if int(topology.slots.max()) > E:
        g = int(np.argmax(topology.slots))
        raise ValueError(
            f"device {g} has {int(topology.slots[g])} slots but there are only {E} experts and a "
            f"device holds at most one replica of each; give it at most {E} slots"
        )
    return w
