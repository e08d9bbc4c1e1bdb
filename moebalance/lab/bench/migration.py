"""The migration frontier of the planner benchmark: balance bought per expert moved.

For a drift sequence (loads [L, E] per re-plan), every budget of :data:`BUDGETS_PCT` percent of
all slots x layers is the ``max_moves`` of each re-plan (``plan(previous=...)`` along the
sequence); beside them the first placement left as it is (stale: no move, shares as planned),
the previous placement kept with its shares re-split (keep-old: budget 0), the re-plan without a
budget, and a fresh plan every time. Moves are also priced in bytes, for a
DeepSeek-V3 expert (:data:`EXPERT_BYTES`).

Shapes: L layers, E experts, S slots.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from ...metrics import summary_imbalance
from ...planner import plan
from ...topology import Topology

BUDGETS_PCT = (1, 2, 3, 5, 10)
# One DeepSeek-V3 expert (3 x 7168 x 2048 parameters): bf16 weights, and weights with an fp32
# master copy and two Adam moments (14 bytes per parameter).
EXPERT_BYTES = {"weights": 88e6, "with optimizer": 617e6}


@dataclass
class FrontierPoint:
    """Mean over the re-plans of one sequence at one move budget."""

    workload: str
    scenario: str
    drift: float | None
    budget: str  # "stale", "keep-old", "1%" ... "10%", "unlimited", "fresh"
    budget_pct: float | None
    imbalance: float
    moves: float
    moves_pct: float
    gb_weights: float
    gb_with_optimizer: float


def run_frontier(workload: str, name: str, topology: Topology, sequence: Sequence[np.ndarray],
                 rel: float | None, budgets: Sequence[int] = BUDGETS_PCT) -> list[FrontierPoint]:
    """Re-plan along ``sequence`` (the first entry is the starting point) at every budget of
    ``budgets`` (percent), beside the stale, keep-old, unlimited and fresh policies."""
    L, S = sequence[0].shape[0], topology.num_slots
    start = plan(sequence[0], topology)
    policies: list[tuple[str, float | None]] = [("keep-old", 0.0)]
    policies += [(f"{b}%", float(b)) for b in budgets]
    policies += [("unlimited", None), ("fresh", None), ("stale", None)]
    points = []
    for label, pct in policies:
        previous, imbalances, moves = start, [], []
        for loads in sequence[1:]:
            if label == "stale":
                p = start
            elif label == "fresh":
                p = plan(loads, topology)
            else:
                budget = None if pct is None else int(pct / 100.0 * L * S)
                p = plan(loads, topology, previous=previous, max_moves=budget)
            imbalances.append(summary_imbalance(loads, p, topology))
            moves.append(p.moves_from(previous))
            previous = p
        m = float(np.mean(moves))
        points.append(FrontierPoint(
            workload=workload, scenario=name, drift=rel, budget=label, budget_pct=pct,
            imbalance=float(np.mean(imbalances)), moves=m, moves_pct=100.0 * m / (L * S),
            gb_weights=m * EXPERT_BYTES["weights"] / 1e9,
            gb_with_optimizer=m * EXPERT_BYTES["with optimizer"] / 1e9))
    return points


FRONTIER_COLUMNS = ("scenario", "drift", "budget", "imbalance", "moves", "moves %",
                    "GB weights", "GB with optimizer")


def frontier_cells(points: Sequence[FrontierPoint]) -> list[list[str]]:
    return [[p.scenario, "replay" if p.drift is None else f"{p.drift:.0%}", p.budget,
             f"{p.imbalance:.4f}", f"{p.moves:.0f}", f"{p.moves_pct:.2f}", f"{p.gb_weights:.1f}",
             f"{p.gb_with_optimizer:.1f}"] for p in points]


def plot_frontier(points: Sequence[FrontierPoint], path: Path) -> None:
    """Imbalance against moves (% of slots) per re-plan, one line per drift sequence; keep-old
    and fresh plans as markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(p.scenario, p.drift if p.drift is not None else -1.0) for p in points})
    # one colour per cluster, one line style per drift: every series tells itself apart
    scenarios = list(dict.fromkeys(k[0] for k in keys))
    drifts = sorted({k[1] for k in keys})
    colours = plt.get_cmap("tab20" if len(scenarios) > 10 else "tab10")
    styles = ("-", "--", ":", "-.")
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for scenario, drift in keys:
        mine = [p for p in points if p.scenario == scenario
                and (p.drift if p.drift is not None else -1.0) == drift]
        curve = [p for p in mine if p.budget not in ("fresh", "stale")]
        label = f"{scenario}, {'replay' if drift < 0 else f'drift {drift:.0%}'}"
        line, = ax.plot([p.moves_pct for p in curve], [p.imbalance for p in curve], marker="o",
                        label=label, color=colours(scenarios.index(scenario) % colours.N),
                        linestyle=styles[drifts.index(drift) % len(styles)])
        for budget, marker in (("fresh", "x"), ("stale", "s")):
            point = [p for p in mine if p.budget == budget]
            if point:
                ax.scatter([point[0].moves_pct], [point[0].imbalance], marker=marker, s=40,
                           color=line.get_color(), facecolors="none" if marker == "s" else None)
    ax.set_xscale("symlog", linthresh=1.0)
    ax.set_xlabel("moves per re-plan, % of slots x layers (x: a fresh plan; square: the first "
                  "placement left stale)")
    ax.set_ylabel("imbalance (1 = ideal)")
    ax.set_title("migration frontier: re-plans with previous= at move budgets from 0 (shares "
                 "re-split) to unlimited, and fresh plans")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
