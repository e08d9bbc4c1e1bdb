"""What every ``moebalance`` command line shares: its parser, its error path, argument types and
the readers of the files users point it at (loads, topologies, placements).

Used by :mod:`moebalance.cli.main` and by the benchmark scripts of :mod:`moebalance.lab.bench`,
which run both as ``moebalance bench`` and on their own; it imports nothing above the data types it
reads. Mistakes in what the user typed or pointed at raise :class:`UsageError`, which
:func:`run_guarded` prints as one line (exit status 2).

Argument types (``*_arg``) parse the text of a command-line flag and raise
``argparse.ArgumentTypeError`` (argparse names the flag); :func:`moebalance._check.positive_int`
checks a Python value handed to a public function.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Callable, NoReturn

import numpy as np

from .._check import as_loads
from ..placement import Placement

LOAD_SUFFIXES = (".npy", ".npz", ".pt", ".pth", ".csv", ".txt")


class UsageError(Exception):
    """Bad user input: reported as one line and exit status 2, without a traceback."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line on stderr (plus exit status 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def run_guarded(fn: Callable[[], int], prog: str = "moebalance") -> int:
    """Run ``fn``; turn a UsageError into a one-line message and status 2."""
    try:
        return fn()
    except UsageError as exc:
        print(f"{prog}: error: {' '.join(str(exc).split())}", file=sys.stderr)  # one line
        return 2


def run_subcommand(name: str, description: str, add_arguments: Callable, run: Callable,
                   argv=None) -> int:
    """``moebalance bench <name> ...`` as a function: parse ``argv`` (default ``sys.argv[1:]``,
    without the program name) with ``add_arguments``, then ``run(args, command line)`` guarded."""
    prog = f"moebalance bench {name}"
    parser = ArgumentParser(prog=prog, description=description)
    add_arguments(parser)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    return run_guarded(lambda: run(args, ["moebalance", "bench", name, *argv]), prog=prog)


# -- argument types (argparse names the flag in its message) --------------------------------------


def _int_at_least(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
    return value


def positive_int_arg(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _int_at_least(text, 1)


def nonneg_int_arg(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _int_at_least(text, 0)


def positive_float_arg(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not np.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


# -- reading user files ---------------------------------------------------------------------------


def read_loads(path: str, key: str | None = None, flag: str = "LOADS",
               steps: bool = False) -> np.ndarray:
    """Per-expert loads [L, E] float64 from a .npy, .npz, .pt or text (.csv, .txt) file.

    A text file is a table, one row per layer (one row: one layer), comma-separated in a .csv,
    separated by spaces or commas in a .txt; a first row of names is skipped. An .npz or a .pt
    holding a dict gives the array under ``key`` (default: ``loads``, or its only array).
    Per-step counts [steps, L, E] are averaged over the steps, or kept as they are with
    ``steps`` (for a plan for the steps).
    """
    p = Path(path)
    if p.suffix not in LOAD_SUFFIXES:
        raise UsageError(f"{flag} must be a {', '.join(LOAD_SUFFIXES)} file, got {path!r}")
    if not p.is_file():
        raise UsageError(f"{flag}: no such file {path!r}")
    _check_kind(p, flag, {".npy": ("npy",), ".npz": ("zip",), ".pt": ("zip", "pickle"),
                          ".pth": ("zip", "pickle"), ".csv": ("text",),
                          ".txt": ("text",)}[p.suffix])
    try:
        if p.suffix in (".csv", ".txt"):
            arr = _read_table(p, flag)
        elif p.suffix == ".npy":
            arr = np.load(p, allow_pickle=False)
        elif p.suffix == ".npz":
            with np.load(p, allow_pickle=False) as data:
                arr = data[_pick_key(list(data.keys()), key, flag, path)]
        else:
            import torch

            obj = torch.load(p, map_location="cpu", weights_only=True)
            if isinstance(obj, dict):
                obj = obj[_pick_key(list(obj.keys()), key, flag, path)]
            if not isinstance(obj, torch.Tensor):
                raise UsageError(f"{flag}: {path!r} holds a {type(obj).__name__}, not a tensor "
                                 "of loads")
            arr = obj.detach().to(torch.float64).numpy()
    except UsageError:
        raise
    except Exception as exc:  # any unreadable file is the user's to fix; say which and why
        raise UsageError(f"{flag}: cannot read {path!r}: {exc}") from None
    arr = np.asarray(arr)
    try:
        if arr.ndim == 3 and steps:
            if arr.shape[0] < 1:
                raise ValueError(f"{flag}: per-step counts [steps, layers, experts] need at "
                                 f"least one step, got shape {arr.shape}")
            return as_loads(arr.reshape(-1, arr.shape[2]), flag).reshape(arr.shape)
        if arr.ndim == 3:
            arr = arr.mean(axis=0)
        return as_loads(arr, flag)
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from None


def _read_table(p: Path, flag: str) -> np.ndarray:
    """A text table of loads, one row per layer; a first row of names is skipped."""
    lines = [line for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
    delimiter = "," if p.suffix == ".csv" or any("," in line for line in lines) else None
    if lines:
        try:
            np.loadtxt(lines[:1], delimiter=delimiter, dtype=np.float64)
        except ValueError:
            lines = lines[1:]                 # column names
    try:
        return np.loadtxt(lines, delimiter=delimiter, ndmin=2, dtype=np.float64)
    except ValueError:
        raise UsageError(f"{flag}: {str(p)!r} is not a table of numbers with rows of one length: "
                         f"write one row of loads per layer, one column per expert") from None


# What a file's first bytes say it is, and how to make the file its name promises.
_KINDS = {
    "npy": "a numpy array (.npy)",
    "zip": "a zip archive (.npz, or a torch.save file)",
    "pickle": "a pickle (an old-style torch.save file)",
    "text": "text",
    "empty": "empty",
    "binary": "binary data of no kind moebalance reads",
}
_HOW = {
    ".npy": "write it with numpy.save (a text table: numpy.save(path, numpy.loadtxt(text_path)))",
    ".npz": "write it with numpy.savez, or with moebalance.Placement.save / moebalance plan --out",
    ".pt": "write it with torch.save(tensor or dict of tensors)",
    ".pth": "write it with torch.save(tensor or dict of tensors)",
    ".csv": "write it as a text table, one row of comma-separated loads per layer",
    ".txt": "write it as a text table, one row of loads per layer",
}


def file_kind(path: Path) -> str:
    """What the first bytes of ``path`` say it holds: a key of ``_KINDS``."""
    with open(path, "rb") as f:
        head = f.read(512)
    if not head:
        return "empty"
    if head.startswith(b"\x93NUMPY"):
        return "npy"
    if head.startswith(b"PK\x03\x04") or head.startswith(b"PK\x05\x06"):
        return "zip"
    if head[:1] == b"\x80":
        return "pickle"
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(head) - 4:  # not just a character cut at the 512th byte
            return "binary"
    return "text"


def _check_kind(path: Path, flag: str, expected: tuple[str, ...]) -> None:
    """UsageError unless ``path`` holds one of the ``expected`` kinds, saying what it holds."""
    kind = file_kind(path)
    if kind not in expected:
        raise UsageError(f"{flag}: {str(path)!r} is named {path.suffix} but holds {_KINDS[kind]}; "
                         f"{_HOW.get(path.suffix, 'give a file of the kind its name says')}")


def writable_dir(path: str, flag: str) -> Path:
    """``path`` as a folder that exists and takes new files (made if missing), checked before any
    work starts; UsageError naming ``flag`` otherwise."""
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=p):
            pass
    except OSError as exc:
        raise UsageError(f"{flag}: cannot write into {path!r} ({exc.strerror or exc}); choose a "
                         f"folder you can write to with {flag} DIR") from None
    return p


def writable_file(path: str, flag: str) -> Path:
    """``path`` as a file that can be written (its folder exists and takes files), checked before
    any work starts; UsageError naming ``flag`` otherwise. Nothing is written to ``path``."""
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"{flag}: {path!r} is a folder; give a file name, e.g. {flag} "
                         f"{os.path.join(path, 'placement.npz')}")
    folder = p.parent
    if not folder.is_dir():
        raise UsageError(f"{flag}: the folder {str(folder)!r} does not exist; create it or "
                         f"choose another path")
    if not os.access(folder, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise UsageError(f"{flag}: cannot write {path!r} (permission denied); choose another "
                         f"path with {flag} FILE")
    return p


def _pick_key(keys: list, key: str | None, flag: str, path: str) -> str:
    if key is not None:
        if key not in keys:
            raise UsageError(f"--key: {path!r} has no array {key!r}; it has "
                             f"{sorted(map(str, keys))}")
        return key
    if "loads" in keys:
        return "loads"
    if len(keys) == 1:
        return keys[0]
    raise UsageError(f"{flag}: {path!r} holds {sorted(map(str, keys))}; name the loads with --key")


def read_placement(path: str, flag: str = "PLACEMENT"):
    """``(placement, topology or None)`` from a file written by ``Placement.save`` (``moebalance
    plan --out``); UsageError naming ``flag`` for anything else."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"{flag}: no such file {path!r}")
    kind = file_kind(p)
    if kind != "zip":
        raise UsageError(f"{flag}: {path!r} holds {_KINDS[kind]}, not a saved moebalance "
                         f"placement{' (loads, perhaps?)' if kind == 'npy' else ''}; pass the "
                         f".npz that moebalance plan --out or Placement.save wrote")
    try:
        return Placement.load_with_topology(p)
    except Exception as exc:  # a corrupt or foreign archive: report it, don't trace it back
        raise UsageError(f"{flag}: {path!r} is not a saved moebalance placement ({exc}); pass "
                         f"a file written by moebalance plan --out or Placement.save") from None
