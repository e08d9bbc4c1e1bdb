"""Parameter lists of the ``extern "C" __global__`` kernels of a CUDA source, read from the text.

Neither CuPy nor the driver checks a launch's arguments against the kernel: a missing argument
makes the launch read past its argument vector. :mod:`.cuda` checks each launch against the
table this module builds from the very source it compiles, and the tests check every launch
site of ``cuda.py`` against it without a GPU.

The reader knows as much C++ as ``csrc/`` uses: comments, line continuations, function-like
macros (one level, with ``##`` pasting) and ``extern "C" __global__ void name(params)``
entry points. Each parameter is a pointer (``"ptr"``) or a scalar named by its type.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["Param", "kernel_signatures"]

_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_DEFINE = re.compile(r"^[ \t]*#[ \t]*define[ \t]+(\w+)\(([^)]*)\)(.*)$", re.M)
# Every ``__global__`` of csrc/ is an entry point with C linkage, declared ``extern "C"`` on its
# own line or inside an ``extern "C" { ... }`` block.
_ENTRY = re.compile(r'(?:extern\s+"C"\s+)?__global__\s+void\s+(\w+)\s*\(([^)]*)\)')
_QUALIFIERS = {"const", "volatile", "__restrict__", "__restrict", "restrict"}


@dataclass(frozen=True)
class Param:
    """One kernel parameter: its name and kind, ``"ptr"`` or the scalar's type (``"i64"``)."""

    name: str
    kind: str


def kernel_signatures(source: str) -> dict[str, tuple[Param, ...]]:
    """``{kernel name: its parameters in order}`` for every ``__global__`` kernel (csrc/ gives
    each C linkage, alone or in an ``extern "C"`` block)."""
    text = _COMMENT.sub(" ", source).replace("\\\n", " ")
    macros = {}
    for match in _DEFINE.finditer(text):
        params = [p.strip() for p in match.group(2).split(",") if p.strip()]
        macros[match.group(1)] = (params, match.group(3))
    text = _DEFINE.sub(" ", text)
    for name, (params, body) in macros.items():
        text = _expand(text, name, params, body)
    signatures = {}
    for match in _ENTRY.finditer(text):
        name = match.group(1)
        if name in signatures:
            raise ValueError(f"kernel {name} is defined twice")
        params = [p.strip() for p in match.group(2).split(",") if p.strip()]
        signatures[name] = tuple(_param(p, name) for p in params)
    return signatures


def _expand(text: str, name: str, params: list[str], body: str) -> str:
    """``text`` with every call ``name(args)`` replaced by ``body`` (arguments substituted)."""
    out, pos = [], 0
    call = re.compile(rf"\b{re.escape(name)}\s*\(")
    while (match := call.search(text, pos)) is not None:
        depth, end = 1, match.end()
        while depth:
            if end >= len(text):
                raise ValueError(f"unbalanced parentheses in a use of macro {name}")
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            end += 1
        args = [a.strip() for a in text[match.end():end - 1].split(",")]
        if len(args) != len(params):
            raise ValueError(f"macro {name} takes {len(params)} arguments, a use passes "
                             f"{len(args)}")
        values = dict(zip(params, args))
        # Words outside string literals are the parameters' uses (extern "C" keeps its "C").
        expanded = re.sub(r'"[^"\n]*"|\b\w+\b',
                          lambda m: values.get(m.group(0), m.group(0)),  # noqa: B023 (runs here)
                          body)
        out += [text[pos:match.start()], re.sub(r"\s*##\s*", "", expanded)]
        pos = end
    return "".join(out) + text[pos:]


def _param(declaration: str, kernel: str) -> Param:
    words = declaration.replace("*", " * ").split()
    if len(words) < 2:
        raise ValueError(f"kernel {kernel}: cannot read parameter {declaration!r} (type and name)")
    kind = "ptr" if "*" in words else " ".join(w for w in words[:-1] if w not in _QUALIFIERS)
    return Param(words[-1], kind)
