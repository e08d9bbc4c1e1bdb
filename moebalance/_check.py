"""Boundary checks shared by every module: integers (counts, seeds, indices) and arrays of loads.

One behaviour everywhere: a value of the wrong type raises TypeError, a value of the right type
out of range raises ValueError, and both messages name the argument and what it must be.
Integers are Python or numpy integers; bools are not integers here, nor are floats such as 4.0.
For integers typed on a command line, see :mod:`moebalance.cli.args`."""

from __future__ import annotations

import numpy as np


def integer(value, name: str, minimum: int = 1) -> int:
    """``value`` as an int after checking that it is an integer >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer >= {minimum}, got {type(value).__name__} "
                        f"{value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def positive_int(value, name: str) -> int:
    """``value`` as an int after checking that it is an integer >= 1."""
    return integer(value, name, 1)


def optional_positive_int(value, name: str) -> int | None:
    """None, or ``value`` checked as by :func:`positive_int`."""
    return None if value is None else integer(value, name, 1)


def index(value, name: str, stop: int) -> int:
    """``value`` as an int after checking that it is an integer in ``[0, stop)``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer in [0, {stop}), got {type(value).__name__} "
                        f"{value!r}")
    if not 0 <= value < stop:
        raise ValueError(f"{name} must be in [0, {stop}), got {value!r}")
    return int(value)


def to_numpy(x, name: str) -> np.ndarray:
    """A numpy view/copy of a numpy, torch (CPU or CUDA) or cupy array, or of a nested list."""
    if isinstance(x, np.ndarray):
        return x
    module = type(x).__module__
    if module.startswith("torch"):
        import torch

        t = x.detach().to("cpu")
        if t.dtype.is_floating_point and t.dtype not in (torch.float16, torch.float32,
                                                         torch.float64):
            # bfloat16 / float8 have no numpy dtype; float32 holds them exactly
            t = t.to(torch.float32)
        return t.numpy()
    if module.startswith("cupy"):
        return x.get()
    try:
        return np.asarray(x)
    except Exception as exc:  # pragma: no cover - message matters, not the type
        raise TypeError(f"{name} must be a numpy, torch or cupy array, got "
                        f"{type(x).__name__}") from exc


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
            f"{name} must have shape [num_layers, num_experts] (or [num_experts]), got shape "
            f"{arr.shape}"
        )
    if arr.shape[0] < 1 or arr.shape[1] < 1:
        raise ValueError(f"{name} must have at least one layer and one expert, got shape "
                         f"{arr.shape}")
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
