"""The planner benchmark's verdict: one line per cluster, moebalance against the EPLB baseline.

Built from the rows the benchmark already measured (:mod:`.planner`'s static and drift rows,
:mod:`.migration`'s frontier points, :mod:`.per_step`'s per-step figures); it measures nothing
itself. Every cell reads ``moebalance / baseline`` unless its column says otherwise.
"""

from __future__ import annotations

from typing import Sequence

from ..report import format_text

COLUMNS = ("cluster", "baseline", "imbalance", "per step (re-split)", "plan ms",
           "moves / re-plan", "stale > re-split > re-plan")


def _pair(a: float, b: float, digits: int) -> str:
    return f"{a:.{digits}f} / {b:.{digits}f}"


def verdict_cells(rows: Sequence, frontier: Sequence, per_step: Sequence[dict],
                  drift: float, skew: str = "moderate") -> list[list[str]]:
    """One line per cluster of ``rows`` (planner Rows), in their order.

    imbalance and plan ms: the first placement for ``skew`` loads (the trace's first window);
    per step: mean over a window's steps of a plan for its mean load (trace only); moves: per
    re-plan of the ``drift`` sequence (the trace's replay), % of slots x layers; the last column:
    moebalance along that sequence with its first placement left as it is, with shares re-split
    and no move, and re-planned with moves.
    """
    cells = []
    for name in dict.fromkeys(r.scenario for r in rows if r.kind == "static"):
        trace = name.startswith("trace-")
        static = [r for r in rows if r.scenario == name and r.kind == "static"
                  and r.skew == ("trace" if trace else skew)]
        ours = next((r for r in static if r.method == "moebalance"), None)
        base = next((r for r in static if not r.method.startswith("moebalance")
                     and not r.method.endswith("optimal shares")), None)
        if ours is None or base is None:
            continue
        want = None if trace else drift
        seq = [r for r in rows if r.scenario == name and r.kind == "drift" and r.drift == want]
        seq_ours = next((r for r in seq if r.method == "moebalance"), None)
        seq_base = next((r for r in seq if r.method == base.method), None)
        moves = (f"{seq_ours.moves_pct:.1f}% / {seq_base.moves_pct:.1f}%"
                 if seq_ours and seq_base else "-")
        points = {p.budget: p for p in frontier if p.scenario == name and p.drift == want}
        after = "-"
        if all(k in points for k in ("stale", "keep-old", "unlimited")):
            after = " > ".join(f"{points[k].imbalance:.3f}" for k in ("stale", "keep-old",
                                                                      "unlimited"))
        step = "-"
        mine = {d["method"]: d for d in per_step if d["scenario"] == name}
        theirs = mine.get(f"{base.method} (window mean)")
        if "moebalance (window mean)" in mine and theirs is not None:
            m = mine["moebalance (window mean)"]
            step = (f"{_pair(m['per_step_static'], theirs['per_step_static'], 3)} "
                    f"({m['per_step_resplit']:.3f})")
        cells.append([name, base.method,
                      _pair(ours.imbalance, base.imbalance, 3), step,
                      f"{ours.plan_ms:.1f} / {base.plan_ms:.1f}", moves, after])
    return cells


def verdict_legend(drift: float, replans: int, window: int | None, slow_s: float,
                   skew: str = "moderate") -> str:
    """What the verdict's columns hold."""
    text = (f"moebalance / baseline in every pair. imbalance: slowest device's time over the "
            f"ideal, summed over layers (1 is perfect), first placement for the {skew} skew (the "
            f"trace: its first window's mean load). per step: the same plans met by each step of "
            f"that window, mean over steps, and in brackets moebalance with the best re-split of "
            f"each step's tokens over its replicas (trace only: the synthetic loads have no "
            f"steps). plan ms: "
            f"one call for all layers, warm, one thread; median of the repeats, but EPLB calls "
            f"over {slow_s} s are timed once. moves / re-plan: expert copies per re-plan along "
            f"{replans} re-plans of loads drifting {drift:.0%} each (the trace: its replay), % "
            f"of slots x layers; EPLB plans from scratch. stale > re-split > re-plan: moebalance's "
            f"mean imbalance along that sequence with its first placement left as it is, with "
            f"the shares re-split and no expert moved, and re-planned with live moves.")
    if window:
        text += f" Trace windows: {window} steps."
    return text


def verdict_text(rows: Sequence, frontier: Sequence, per_step: Sequence[dict], drift: float,
                 replans: int, window: int | None, slow_s: float) -> str:
    """The verdict table and its legend as plain text."""
    import textwrap

    cells = verdict_cells(rows, frontier, per_step, drift)
    legend = textwrap.fill(verdict_legend(drift, replans, window, slow_s), width=100,
                           break_on_hyphens=False)
    return format_text(COLUMNS, cells) + "\n" + legend
