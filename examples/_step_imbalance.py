"""Per-step imbalance and wall time of a training run, and what its re-plans bought (examples).

``StepImbalance.record(rebalancer)``, called on every rank after each optimizer step (after
``Rebalancer.step()``), sums the step's tracked loads over the ranks and keeps the per-step
imbalance of those loads under the placement in force (re-split over its replicas, as the
dispatcher does: :func:`moebalance.step_imbalance`); ``bought()`` compares the steps on the
first placement with the steps after the first re-plan.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

import moebalance as mb


class StepImbalance:
    def __init__(self, model, topology) -> None:
        self.model, self.topology, self.rows = model, topology, []
        self.last = time.perf_counter()

    def record(self, rebalancer) -> None:
        counts = rebalancer.last_counts.to(torch.float64)
        dist.all_reduce(counts)
        imbalance = mb.step_imbalance(counts.numpy()[None], mb.current_placement(self.model),
                                      self.topology)[0]
        replanned = bool(rebalancer.history) and rebalancer.history[-1]["step"] == rebalancer.steps
        now = time.perf_counter()
        self.rows.append({"imbalance": float(imbalance), "replan": replanned,
                          "step_s": now - self.last})
        self.last = now

    def bought(self) -> str:
        return bought(self.rows)


def bought(rows: list) -> str:
    """What the re-plans bought in this run: per-step imbalance and wall step time on the first
    placement (up to the first re-plan) against the steps after it."""
    first = next((i for i, r in enumerate(rows) if r["replan"]), None)
    if first is None or first + 1 >= len(rows):
        return "no step ran after a re-plan: nothing to compare (raise --steps)"
    before, after = rows[:first + 1], rows[first + 1:]

    def mean(key, part):
        return sum(r[key] for r in part) / len(part)

    return (f"what rebalancing bought: per-step imbalance {mean('imbalance', before):.3f} on the "
            f"first placement (steps 0-{first}) -> {mean('imbalance', after):.3f} after "
            f"re-planning (steps {first + 1}-{len(rows) - 1}); the slowest device's modelled step "
            f"time scales "
            f"with it. Wall step time {1e3 * mean('step_s', before[1:] or before):.0f} -> "
            f"{1e3 * mean('step_s', after):.0f} ms: the gloo ranks share this machine's cores and "
            f"the speeds 0.5 are declared, not real, so wall time shows migration "
            f"cost, not gain (step 0, with start-up, left out)")
