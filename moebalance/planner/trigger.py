"""When a re-plan pays: the saving a new placement brings over the steps until the next one,
against the price of its moves.

A re-plan costs its moves (bytes over a link, :class:`~moebalance.planner.MoveCost`) and saves
step time on every step until the next re-plan. :func:`plan` with ``move_cost`` already keeps
a layer's moves only where they pay; :func:`replan_if_it_pays` asks it, with the placement in
service as ``previous``, and answers with the new placement when at least one layer's moves pay
(else None: the per-step re-split keeps serving the placement in service). The figures it
reports (summary imbalance before and after on the loads, moves, the saving in units of the
ideal step) let a training loop log why it did or did not re-plan.

Legend: T steps, L layers, E experts.
"""

from __future__ import annotations

from .._check import to_numpy
from ..placement import Placement
from ..topology import Topology

__all__ = ["replan_if_it_pays"]


def replan_if_it_pays(loads, current: Placement, topology: Topology, move_cost,
                      ) -> tuple[Placement | None, dict]:
    """The re-plan to make now, or None when no layer's moves pay for themselves.

    Args:
        loads: [L, E] tracked loads, or [T, L, E] the recent per-step counts (then judged
            step by step after the re-split, see :func:`moebalance.plan`).
        current: the placement in service (not modified).
        topology: the devices.
        move_cost: a :class:`~moebalance.planner.MoveCost`: the moves' price against the step
            time they save over ``move_cost.steps`` steps.

    Returns:
        (placement or None, figures): figures holds ``imbalance_before`` /
        ``imbalance_after`` (summary imbalance on the loads the plan is for: per-step
        counts' recent level, see :func:`moebalance.plan`), ``moves`` and ``saving`` (the
        summary imbalance saved on those loads, times the steps it serves, in ideal steps).
    """
    from ..metrics import summary_imbalance
    from . import MoveCost, plan
    from .steps import planned_loads

    if not isinstance(current, Placement):
        raise TypeError(f"current must be the moebalance.Placement in service, got "
                        f"{type(current).__name__}")
    if not isinstance(move_cost, MoveCost):
        raise TypeError(f"move_cost must be a moebalance.planner.MoveCost, got "
                        f"{type(move_cost).__name__}")
    new = plan(loads, topology, previous=current, move_cost=move_cost)
    arr = to_numpy(loads, "loads")
    mean = planned_loads(arr)
    before = summary_imbalance(mean, current, topology)
    after = summary_imbalance(mean, new, topology)
    moves = new.moves_from(current)
    figures = {"imbalance_before": before, "imbalance_after": after, "moves": int(moves),
               "saving": float(max(before - after, 0.0) * move_cost.steps)}
    if moves == 0:
        return None, figures
    return new, figures
