"""What every benchmark report shares: plain-text and markdown tables, and the record of the
machine, versions and command line that produced the figures."""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import os
import platform
import shlex
from typing import Sequence

import numpy as np

from .. import __version__
from ..backends import backends

__all__ = ["format_text", "format_markdown", "machine_info"]


def _is_number(text: str) -> bool:
    return text.rstrip("x%").replace(".", "", 1).replace("-", "", 1).isdigit()


def format_text(columns: Sequence[str], cells: Sequence[Sequence[str]]) -> str:
    """Plain-text table, numbers right-aligned."""
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    numeric = [bool(cells) and _is_number(cells[0][i]) for i in range(len(columns))]

    def line(items: Sequence[str]) -> str:
        return "  ".join(x.rjust(w) if right else x.ljust(w)
                         for x, w, right in zip(items, widths, numeric)).rstrip()

    return "\n".join([line(columns), "  ".join("-" * w for w in widths)] + [line(r) for r in cells])


def format_markdown(columns: Sequence[str], cells: Sequence[Sequence[str]]) -> str:
    head = "| " + " | ".join(columns) + " |"
    rule = "|" + "|".join("---:" if _is_number(cells[0][i]) else "---"
                          for i in range(len(columns))) + "|" if cells else ""
    return "\n".join([head, rule] + ["| " + " | ".join(r) + " |" for r in cells])


def _version_of(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def machine_info(argv: Sequence[str]) -> dict:
    """CPU, cores, versions and the command line, for the record."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for text in f:
                if text.startswith("model name"):
                    cpu = text.split(":", 1)[1].strip()
                    break
    except OSError:
        pass  # not Linux: platform's answer stands
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "cores_usable": affinity,
        "threads_used": 1,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "numba": _version_of("numba"),
        "torch": _version_of("torch"),
        "moebalance": __version__,
        "backends": backends(),
        "command": " ".join(shlex.quote(a) for a in argv),
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def markdown_header(title: str, info: dict) -> list[str]:
    """The first lines of a benchmark's summary.md: title, machine, versions, command, date."""
    return [f"# {title}", "", f"- machine: {info['cpu']}, {info['cores']} cores",
            f"- versions: python {info['python']}, torch {info['torch']}, moebalance {info['moebalance']}",
            f"- command: {info['command']}", f"- date: {info['timestamp']}"]
