"""The one place that decides which accelerated implementation each part uses.

Parts: ``planner`` (numpy reference, Numba CPU kernels), ``dispatch`` (torch reference,
Numba CPU kernels, CUDA kernels from ``csrc/`` loaded through CuPy) and ``resplit``, the
dispatcher's per-step re-split (the same three). The choice is automatic, reported by
:func:`backends`, and can be forced with :func:`force_backend` or the environment variables
``MOEBALANCE_PLANNER`` / ``MOEBALANCE_DISPATCH`` / ``MOEBALANCE_RESPLIT`` (useful in tests).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from contextlib import contextmanager
from typing import Iterator

PLANNER_BACKENDS = ("numba", "numpy")
DISPATCH_BACKENDS = ("cuda", "numba", "torch")
RESPLIT_BACKENDS = DISPATCH_BACKENDS
_ENV = {"planner": "MOEBALANCE_PLANNER", "dispatch": "MOEBALANCE_DISPATCH",
        "resplit": "MOEBALANCE_RESPLIT"}
_CHOICES = {"planner": PLANNER_BACKENDS, "dispatch": DISPATCH_BACKENDS,
            "resplit": RESPLIT_BACKENDS}
_forced: dict[str, str] = {}


@functools.lru_cache(maxsize=None)
def has_numba() -> bool:
    if os.environ.get("MOEBALANCE_DISABLE_NUMBA") == "1":
        return False
    return importlib.util.find_spec("numba") is not None


@functools.lru_cache(maxsize=None)
def has_cupy_gpu() -> bool:
    """True when CuPy imports and sees a CUDA device (never raises)."""
    if importlib.util.find_spec("cupy") is None:
        return False
    try:
        import cupy

        return bool(cupy.cuda.is_available())
    except Exception:
        return False


def _check(part: str, name: str) -> str:
    if part not in _CHOICES:
        raise ValueError(f"part must be one of {sorted(_CHOICES)}, got {part!r}")
    if name not in _CHOICES[part]:
        raise ValueError(f"{part} backend must be one of {list(_CHOICES[part])}, got {name!r}")
    return name


def backend(part: str, device_type: str = "cpu") -> str:
    """The backend ``part`` uses for data on ``device_type`` ("cpu" or "cuda")."""
    if part in _forced and not (_forced[part] == "cuda" and device_type != "cuda"):
        return _forced[part]
    env = os.environ.get(_ENV.get(part, ""), "")
    if env:
        if env not in _CHOICES[part]:
            raise ValueError(f"{_ENV[part]}={env!r} is not a {part} backend: set it to one of "
                             f"{list(_CHOICES[part])} or unset it")
        return env
    if part == "planner":
        return "numba" if has_numba() else "numpy"
    if part in ("dispatch", "resplit"):
        if device_type == "cuda":
            return "cuda" if has_cupy_gpu() else "torch"
        return "numba" if has_numba() else "torch"
    raise ValueError(f"part must be one of {sorted(_CHOICES)}, got {part!r}")


def force_backend(part: str, name: str | None) -> None:
    """Force ``part`` to ``name`` (None restores the automatic choice)."""
    if part not in _CHOICES:
        raise ValueError(f"part must be one of {sorted(_CHOICES)}, got {part!r}")
    if name is None:
        _forced.pop(part, None)
    else:
        _forced[part] = _check(part, name)


@contextmanager
def using_backend(part: str, name: str) -> Iterator[None]:
    """Context manager form of :func:`force_backend`."""
    before = _forced.get(part)
    force_backend(part, name)
    try:
        yield
    finally:
        force_backend(part, before)


def backends() -> dict[str, str]:
    """What each part runs on right now, e.g. ``{'planner': 'numba', 'dispatch.cpu': 'numba',
    'dispatch.cuda': 'torch', 'resplit.cpu': 'numba', 'resplit.cuda': 'torch', 'numba': True,
    'cupy_gpu': False}``."""
    return {
        "planner": backend("planner"),
        "dispatch.cpu": backend("dispatch", "cpu"),
        "dispatch.cuda": backend("dispatch", "cuda"),
        "resplit.cpu": backend("resplit", "cpu"),
        "resplit.cuda": backend("resplit", "cuda"),
        "numba": has_numba(),
        "cupy_gpu": has_cupy_gpu(),
    }
