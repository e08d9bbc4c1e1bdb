"""What every benchmark report shares: plain-text and markdown tables, the legend of the names
that appear in them, figure captions, and the record of the machine, versions and command line
that produced the figures."""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import os
import platform
import shlex
import textwrap
from typing import Iterable, Sequence

import numpy as np

from .. import __version__
from ..backends import backends
from . import workloads

__all__ = ["format_text", "format_markdown", "machine_info", "legend_entries", "legend_text",
           "legend_markdown", "PLANNER_PLOT_CAPTION", "add_caption"]


def _is_number(text: str) -> bool:
    return text.rstrip("x%").replace(".", "", 1).replace("-", "", 1).isdigit()


def phase(prog: str, text: str, since: float) -> None:
    """One progress line on stderr for a step of a long command: ``prog [12 s] text``;
    ``since`` is the command's start (``time.time()``, so that spawned ranks can pass it on)."""
    import sys
    import time

    print(f"{prog} [{time.time() - since:4.0f} s] {text}", file=sys.stderr, flush=True)


def part_of(count: float, total: int) -> str:
    """``4.5 of 80 (5.6%)``: a count (a median may end in .5) and its share, the same figure in
    both."""
    return f"{count:g} of {total} ({count / total:.1%})"


def _numeric_column(cells: Sequence[Sequence[str]], i: int) -> bool:
    """Column ``i`` holds numbers: every cell that is not blank is one (and one is not blank)."""
    filled = [row[i] for row in cells if row[i]]
    return bool(filled) and all(_is_number(x) for x in filled)


def format_text(columns: Sequence[str], cells: Sequence[Sequence[str]]) -> str:
    """Plain-text table, numbers right-aligned (blank cells allowed among them)."""
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    numeric = [_numeric_column(cells, i) for i in range(len(columns))]

    def line(items: Sequence[str]) -> str:
        return "  ".join(x.rjust(w) if right else x.ljust(w)
                         for x, w, right in zip(items, widths, numeric)).rstrip()

    return "\n".join([line(columns), "  ".join("-" * w for w in widths)] + [line(r) for r in cells])


def format_markdown(columns: Sequence[str], cells: Sequence[Sequence[str]]) -> str:
    head = "| " + " | ".join(columns) + " |"
    rule = "|" + "|".join("---:" if _numeric_column(cells, i) else "---"
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
            f"- versions: python {info['python']}, torch {info['torch']}, moebalance "
            f"{info['moebalance']}",
            f"- command: {info['command']}", f"- date: {info['timestamp']}"]


# -- what the names in the tables mean ------------------------------------------------------------

# Methods (the "method" and "baseline" columns), in the order a reader meets them.
METHODS = {
    "moebalance": "moebalance.plan(); in drift and replay rows it re-plans from its own last "
                  "placement (previous=), so it moves few experts",
    "moebalance (fresh)": "moebalance.plan() from scratch at every re-plan: the balance a re-plan "
                          "that moves few experts is compared with",
    "eplb (hierarchical)": "DeepSeek's EPLB itself, hierarchical policy (expert groups packed onto "
                           "nodes, then replicas onto GPUs); used where the groups divide among "
                           "the nodes",
    "eplb (global)": "DeepSeek's EPLB itself, global policy (all replicas packed onto all GPUs at "
                     "once); used on one node or where the groups do not divide among the nodes",
    "eplb-style": "EPLB's method (equal-split replicas, greedy packing by load) generalised to "
                  "devices of unlike speed or slots, which EPLB itself cannot express",
    "rebalance_experts": "moebalance.rebalance_experts(): moebalance behind EPLB's own arguments "
                         "and outputs (the drop-in table)",
}
# Columns of the drop-in table that need more than their name.
DROPIN_NOTES = {
    "duplicates": "replicas placed on a GPU that already holds a copy of the same expert (EPLB "
                  "allows it; such a copy adds no capacity to that GPU)",
    "speed-up": "EPLB's plan time over the drop-in's, same arguments and loads",
}
SCENARIO_LABELS = {
    "drift P% xN": "N re-plans in a row, the loads jittered by P% before each one",
    "replay xN": "N re-plans on the following windows of the router trace",
}
_TRACE_CLUSTERS = {
    "trace-homogeneous-": "identical devices with {} slots in all, sized for the trace's experts "
                          "(about 1.25 slots per expert)",
    "trace-heterogeneous-": "the same devices and {} slots, the second half of the devices at "
                            "speed 0.5",
}


def _describe(name: str) -> str | None:
    if name in workloads.CLUSTERS:
        return workloads.CLUSTERS[name].description
    if name in METHODS:
        return METHODS[name]
    for prefix, text in _TRACE_CLUSTERS.items():
        if name.startswith(prefix):
            return text.format(name[len(prefix):])
    return None


def legend_entries(rows: Iterable, dropins: Sequence[dict] = ()) -> list[tuple[str, str]]:
    """(name, meaning) for every scenario and method in ``rows`` (objects with ``scenario``,
    ``method`` and ``kind`` attributes), then the drop-in table's columns when ``dropins``."""
    rows = list(rows)
    used = {r.method for r in rows} | {d["baseline"] for d in dropins}
    if dropins:
        used.add("rebalance_experts")
    names = list(dict.fromkeys(r.scenario for r in rows)) + [m for m in METHODS if m in used]
    entries = [(n, text) for n in names if (text := _describe(n)) is not None]
    sequences = {r.drift is None for r in rows if r.kind == "drift"}  # True: a trace replay
    if False in sequences:
        entries.append(("drift P% xN", SCENARIO_LABELS["drift P% xN"]))
    if True in sequences:
        entries.append(("replay xN", SCENARIO_LABELS["replay xN"]))
    if dropins:
        entries += list(DROPIN_NOTES.items())
    return entries


def legend_text(rows: Iterable, dropins: Sequence[dict] = (), width: int = 100) -> str:
    """The legend as indented plain text, wrapped to ``width``."""
    entries = legend_entries(rows, dropins)
    lines = ["names:"]
    for name, text in entries:
        lines.append(textwrap.fill(text, width=width, initial_indent=f"  {name}: ",
                                   subsequent_indent="      ", break_on_hyphens=False))
    return "\n".join(lines)


def legend_markdown(rows: Iterable, dropins: Sequence[dict] = ()) -> str:
    """The legend as a markdown list."""
    return "\n".join(f"- **{name}**: {text}" for name, text in legend_entries(rows, dropins))


# -- figure captions ------------------------------------------------------------------------------

PLANNER_PLOT_CAPTION = (
    "Side by side, for the same loads (not before and after): each device's load / speed "
    "relative to the ideal (dashed line at 1) under the baseline named in the legend (DeepSeek's "
    "EPLB, or the EPLB-style plan where EPLB cannot express the cluster) and under moebalance. "
    "One layer per panel, heavy skew: the layer whose baseline imbalance is the median over "
    "layers. The tallest bar sets the step time.")


def add_caption(fig, text: str, width: int = 150) -> None:
    """Write ``text`` under the axes of matplotlib ``fig`` and lay it out with room for it
    (call instead of ``fig.tight_layout()``)."""
    wrapped = textwrap.fill(text, width=width, break_on_hyphens=False)
    lines = wrapped.count("\n") + 1
    height = fig.get_figheight()
    room = min(0.4, (0.2 + 0.17 * lines) / height)  # inches of text, as a fraction of the figure
    fig.text(0.01, 0.01, wrapped, ha="left", va="bottom", fontsize=9)
    fig.tight_layout(rect=(0.0, room, 1.0, 1.0))


# -- timers of multi-rank benchmarks: a step is as slow as its slowest rank ------------------------


def slowest(seconds):
    """The largest of every rank's ``seconds`` (a collective): a float for a float, a list for a
    sequence (elementwise)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(np.atleast_1d(np.asarray(seconds, dtype=np.float64)))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0]) if np.ndim(seconds) == 0 else t.tolist()


def timed(fn) -> float:
    """Seconds of ``fn()`` on the slowest rank, ranks aligned by an untimed barrier first."""
    import time

    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    return slowest(time.perf_counter() - start)
