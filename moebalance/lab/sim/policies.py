"""Balancing policies the simulator compares: each a small object asked once per step.

A policy sees the trace up to the step it is asked about, never the step itself (the oracle
excepted), and answers with the placement to use from that step on, or None to keep the one in
service. :func:`moebalance.lab.sim.simulate` calls ``start`` once with the warm-up steps,
then ``step`` at every simulated step, and charges every new placement's migration in the
policy's ``migration`` mode (see :mod:`.stepmodel`).

* :class:`StaticUniform`: one placement planned for equal loads, never changed (what a job
  without a balancer runs: experts spread evenly by device speed and slots).
* :class:`EPLBPeriodic`: every ``every`` steps a full re-plan from the last ``window`` steps'
  mean load with EPLB's method (replicas by load per replica, heaviest first to the least loaded
  device; speeds ignored, as EPLB ignores them; :func:`~moebalance.lab.eplb_reference.
  eplb_style_plan`), equal token shares, no regard for the placement in service, and training
  stops while the experts move (every move paid, as EPLB's rearrangement in vLLM and SGLang).
* :class:`MoebalancePeriodic`: every ``every`` steps :func:`moebalance.plan` on the same
  window's per-step counts ``[T, L, E]`` (planned for the steps, the Rebalancer's call) with
  the placement in service as ``previous``,
  under a move budget (``max_moves``) or a move price (:class:`~moebalance.planner.MoveCost`:
  the step time a move saves until the next re-plan against its transfer time); migrations are
  live. With ``resplit=True`` each step's tokens are also re-split over the replicas (the
  dispatcher's per-step re-split). With ``speeds=SpeedTracker(...)`` it also follows the
  devices' speeds as :class:`moebalance.SpeedTracker` does in training: the speeds the devices
  ran at in past steps are folded into the tracker every ``speeds.every`` steps (one work unit
  in ``1 / speed`` seconds a step, smoothed), and when they have moved (``SpeedTracker.moved``:
  ``min_change``, ``window``) the policy adopts the measured topology and re-plans at once; its
  plans and its re-split then use the measured speeds. The planner's move price (``move_cost``)
  stands in for the tracker's saving-against-price test. Without it, a policy plans for the
  nominal speeds throughout (what EPLB and a fixed topology do). With ``transient=k`` (and the
  re-split) every device has ``k`` transient slots per layer: each step, hot experts' weights are
  copied for that step to cold devices by :mod:`.transient`'s greedy rule, chosen on the
  ``guide`` counts ("previous": the step before, copies made ahead; "current": the step's own,
  copies on the critical path), and charged by the step model.
* :class:`Oracle`: the bound. It knows each step's loads and spreads them over the devices in
  proportion to their speed (what no placement with integer replicas beats), with no migration.

Legend: T steps, L layers, E experts.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod

import numpy as np

from ..._check import integer, positive_int
from ...placement import Placement
from ...planner import MoveCost, plan
from ...topology import Device, Topology
from .transient import GUIDES

__all__ = ["Policy", "StaticUniform", "EPLBPeriodic", "MoebalancePeriodic", "Oracle",
           "default_policies"]


class Policy(ABC):
    """What the simulator asks of a policy.

    Attributes:
        name: row label. resplit: re-split each step's tokens over the replicas.
        transient: transient slots per device and layer (0: none); guide: the counts their
            copies are chosen on ("previous" or "current" step's).
        migration: "live", "blocking" or "free" (see :mod:`.stepmodel`).
        oracle: loads follow device speed exactly (no placement).
        plan_seconds: wall time of every plan made so far (host seconds).
    """

    name = "policy"
    resplit = False
    transient = 0
    guide = "previous"
    migration = "live"
    oracle = False

    def __init__(self) -> None:
        self.plan_seconds: list[float] = []

    def bind(self, topology: Topology, speed_TG: np.ndarray | None = None) -> "Policy":
        """Use ``topology`` (the nominal speeds); ``speed_TG`` [T, G]: the relative speed each
        device runs at in every step of the trace (None: the topology's throughout), for
        policies that measure speeds (read only for steps already run). Returns self."""
        self.topology = self.nominal = topology
        if speed_TG is None:
            speed_TG = np.broadcast_to(topology.speed, (0, topology.num_devices))
        self.speed_TG = np.asarray(speed_TG, dtype=np.float64)
        self.plan_seconds = []
        return self

    @abstractmethod
    def start(self, history_TLE: np.ndarray) -> Placement | None:
        """The placement in service at the first simulated step, from the warm-up steps."""

    def step(self, t: int, history_TLE: np.ndarray, current: Placement | None) -> Placement | None:
        """A new placement from step ``t`` on, or None; ``history_TLE`` = steps before ``t``."""
        return None

    def _timed(self, fn):
        begin = time.perf_counter()
        out = fn()
        self.plan_seconds.append(time.perf_counter() - begin)
        return out


class StaticUniform(Policy):
    name = "static uniform"

    def start(self, history_TLE):
        L, E = history_TLE.shape[1:]
        return self._timed(lambda: plan(np.ones((L, E)), self.topology))


class _Periodic(Policy):
    def __init__(self, every: int, window: int | None = None) -> None:
        super().__init__()
        self.every = positive_int(every, "every (steps between re-plans)")
        self.window = positive_int(self.every if window is None else window,
                                   "window (steps averaged)")

    def _recent(self, history_TLE: np.ndarray) -> np.ndarray:
        return history_TLE[-self.window:]

    def start(self, history_TLE):
        return self._timed(lambda: self._plan(self._recent(history_TLE), None))

    def step(self, t, history_TLE, current):
        if t % self.every:
            return None
        return self._timed(lambda: self._plan(self._recent(history_TLE), current))

    @abstractmethod
    def _plan(self, recent_TLE: np.ndarray, current: Placement | None) -> Placement:
        """A placement for the ``window`` steps ``recent_TLE``, ``current`` the one in service."""


class EPLBPeriodic(_Periodic):
    migration = "blocking"

    def __init__(self, every: int, window: int | None = None) -> None:
        super().__init__(every, window)
        self.name = f"EPLB every {self.every}"

    def _plan(self, recent_TLE, current):
        from ..eplb_reference import eplb_style_plan

        return eplb_style_plan(recent_TLE.mean(axis=0), self.topology)


class MoebalancePeriodic(_Periodic):
    """moebalance's planner every ``every`` steps.

    Args:
        every, window: steps between re-plans, steps averaged (default ``every``).
        max_moves: at most this many expert copies per re-plan (None: no cap).
        move_cost: a :class:`~moebalance.planner.MoveCost` pricing moves (see
            :func:`~moebalance.lab.sim.move_price` for one from the cluster); None: no price.
        resplit: re-split each step's tokens over the replicas.
        speeds: a :class:`moebalance.SpeedTracker` to follow measured speeds, or None.
        transient: transient slots per device and layer (needs ``resplit``; 0: none).
        guide: "previous" or "current": the step whose counts the transient copies are chosen
            on (see :mod:`.transient`).
    """

    def __init__(self, every: int, window: int | None = None, *, max_moves: int | None = None,
                 move_cost: MoveCost | None = None, resplit: bool = False,
                 speeds=None, transient: int = 0, guide: str = "previous") -> None:
        from ...speeds import SpeedTracker

        super().__init__(every, window)
        self.transient = integer(transient, "transient (slots per device)", 0)
        if guide not in GUIDES:
            raise ValueError(f"guide must be one of {GUIDES} (the step whose counts choose the "
                             f"transient copies), got {guide!r}")
        if self.transient and not resplit:
            raise ValueError(f"transient={self.transient} needs resplit=True: the copies serve "
                             f"tokens through the per-step re-split")
        self.guide = guide
        if max_moves is not None:
            max_moves = integer(max_moves, "max_moves", 0)
        if speeds is not None and not isinstance(speeds, SpeedTracker):
            raise TypeError(f"speeds must be a moebalance.SpeedTracker (its every, smoothing, "
                            f"min_change and window are used) or None, got "
                            f"{type(speeds).__name__}")
        self.max_moves, self.move_cost, self.resplit = max_moves, move_cost, bool(resplit)
        self.speeds = speeds
        limit = (f", <= {max_moves} moves" if max_moves is not None
                 else ", priced moves" if move_cost is not None else "")
        self.name = (f"moebalance every {self.every}{limit}" + (" + re-split" if resplit else "")
                     + (" + speed tracking" if speeds is not None else "")
                     + (f" + {self.transient} transient ({guide})" if self.transient else ""))

    def bind(self, topology, speed_TG=None):
        from ...speeds import SpeedTracker

        super().bind(topology, speed_TG)
        if self.speeds is not None:      # a fresh tracker per run, with the given settings
            s = self.speeds
            self.tracker = SpeedTracker(s.every, smoothing=s.smoothing, min_change=s.min_change,
                                        window=s.window, horizon=s.horizon)
            self._measured_to = 0        # steps folded into the tracker so far
        return self

    def step(self, t, history_TLE, current):
        if self.speeds is not None and t % self.tracker.every == 0 and self._track(t):
            return self._timed(lambda: self._plan(self._recent(history_TLE), current))
        return super().step(t, history_TLE, current)

    def _track(self, t: int) -> bool:
        """Fold the speeds of steps before ``t`` into the tracker; adopt the measured topology
        when they moved (True: re-plan now)."""
        ran_GT = self.speed_TG[self._measured_to:t].T
        self._measured_to = max(self._measured_to, t)
        if ran_GT.shape[1] == 0:
            return False
        figures_GTP = np.stack([np.ones_like(ran_GT), 1.0 / ran_GT], axis=-1)
        self.tracker.update(figures_GTP)
        if not self.tracker.moved(self.topology.speed):
            return False
        self.topology = Topology([Device(speed=float(s), slots=d.slots, node=d.node)
                                  for s, d in zip(self.tracker.planning_speeds(),
                                                  self.nominal.devices)])
        return True

    def _plan(self, recent_TLE, current):
        # the Rebalancer's call: the window's per-step counts, planned for the steps
        if current is None:
            return plan(recent_TLE, self.topology)
        return plan(recent_TLE, self.topology, previous=current, max_moves=self.max_moves,
                    move_cost=self.move_cost)


class Oracle(Policy):
    name = "oracle (bound)"
    migration = "free"
    oracle = True

    def start(self, history_TLE):
        return None


def default_policies(every: int, window: int | None, move_cost: MoveCost | None,
                     max_moves: int | None = None, speeds=None, transient: int = 0,
                     guides: tuple[str, ...] = ("previous", "current")) -> list[Policy]:
    """The five rows of ``moebalance simulate``: static, EPLB periodic, moebalance periodic with
    and without the per-step re-split, and the oracle; with ``transient`` > 0, one row per guide
    in ``guides`` after the re-split's: moebalance periodic with the re-split and that many
    transient slots per device; with ``speeds`` (a :class:`moebalance.SpeedTracker`, for
    clusters whose speeds change) one more before the oracle: moebalance periodic with the
    re-split and speed tracking."""
    copies = [MoebalancePeriodic(every, window, max_moves=max_moves, move_cost=move_cost,
                                 resplit=True, transient=transient, guide=guide)
              for guide in (guides if transient else ())]
    tracked = [] if speeds is None else [
        MoebalancePeriodic(every, window, max_moves=max_moves, move_cost=move_cost,
                           resplit=True, speeds=speeds)]
    return [StaticUniform(), EPLBPeriodic(every, window),
            MoebalancePeriodic(every, window, max_moves=max_moves, move_cost=move_cost),
            MoebalancePeriodic(every, window, max_moves=max_moves, move_cost=move_cost,
                               resplit=True),
            *copies, *tracked, Oracle()]
