"""One algorithm, two executions: plain Python (the reference) and Numba (the fast path).

The planner's kernels are written once, in the subset of Python that Numba compiles, and marked
with :func:`kernel`. :func:`kernels` is the one lookup: ``"numpy"`` gives them as they are,
``"numba"`` gives ``numba.njit`` copies whose calls to each other resolve to the compiled
copies, and no name follows :func:`moebalance.backends` (part ``planner``, forcing included).
Tests run both on random inputs and require identical placements, so a Numba-only bug cannot
hide.
"""

from __future__ import annotations

import types
from typing import Callable

from ..backends import backend as chosen_backend

_KERNELS: dict[str, Callable] = {}


def kernel(fn: Callable) -> Callable:
    """Register ``fn`` as a planner kernel (returned unchanged: the interpreted reference)."""
    _KERNELS[fn.__name__] = fn
    return fn


def kernels(backend: str | None = None) -> types.SimpleNamespace:
    """Every registered kernel, by name: run as plain Python (``backend="numpy"``), compiled by
    Numba (``"numba"``), or as the planner's backend is chosen now (None:
    :func:`moebalance.backends`, which honours ``force_backend`` and ``MOEBALANCE_PLANNER``)."""
    if backend is None:
        backend = chosen_backend("planner")
    if backend == "numba":
        return _compiled_kernels()
    if backend == "numpy":
        return types.SimpleNamespace(**_KERNELS)
    raise ValueError(f"backend must be 'numba', 'numpy' or None, got {backend!r}")


_compiled: types.SimpleNamespace | None = None


def _compiled_kernels() -> types.SimpleNamespace:
    """Numba-compiled copies of every kernel (compiled lazily on first call, cached on disk)."""
    global _compiled
    # Rebuild when kernels were registered after the last build (a module imported later).
    if _compiled is None or len(vars(_compiled)) != len(_KERNELS):
        import numba

        namespace: dict = {}
        scopes: list[dict] = []
        for name, fn in _KERNELS.items():
            scope = dict(fn.__globals__)
            scopes.append(scope)
            clone = types.FunctionType(fn.__code__, scope, name, fn.__defaults__, fn.__closure__)
            clone.__qualname__ = fn.__qualname__
            clone.__module__ = fn.__module__
            namespace[name] = numba.njit(cache=True, nogil=True)(clone)
        # Calls between kernels go through globals, which Numba reads when it compiles (first
        # call): point them at the compiled copies.
        for scope in scopes:
            scope.update(namespace)
        _compiled = types.SimpleNamespace(**namespace)
    return _compiled
