"""One algorithm, two executions: plain Python (the reference) and Numba (the fast path).

The planner's kernels are written once, in the subset of Python that Numba compiles, and marked
with :func:`kernel`. :func:`interpreted` returns them as they are; :func:`compiled` returns
``numba.njit`` copies whose calls to each other resolve to the compiled copies. Tests run both on
random inputs and require identical placements, so a Numba-only bug cannot hide.
"""

from __future__ import annotations

import types
from typing import Callable

_KERNELS: dict[str, Callable] = {}


def kernel(fn: Callable) -> Callable:
    """Register ``fn`` as a planner kernel (returned unchanged: the interpreted reference)."""
    _KERNELS[fn.__name__] = fn
    return fn


def interpreted() -> types.SimpleNamespace:
    return types.SimpleNamespace(**_KERNELS)


_compiled: types.SimpleNamespace | None = None


def compiled() -> types.SimpleNamespace:
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
