"""Device speeds as the running job sees them: measured once, and tracked step by step.

Two ways to learn each rank's expert speed (relative tokens/s, the ``speed`` of a
:class:`~moebalance.Topology`):

* :meth:`moebalance.Topology.measure` (:mod:`moebalance.measure`, a collective) at the start:
  every rank times its expert arithmetic at the layer's shape and dtype, reads its memory for
  expert slots and its node, and every rank builds the same Topology.
* :class:`SpeedTracker` (``mb.Rebalancer(..., speeds=SpeedTracker())``): the layers' expert
  computation is timed every step by an :class:`ExpertTimer` (events recorded in the step and
  read at a later one once complete: no host sync on the GPU path; ``perf_counter`` on CPUs),
  every ``every`` steps the ranks exchange their per-step figures, a smoothed per-rank speed
  follows the job, and :meth:`SpeedTracker.check` tells the Rebalancer when the speeds moved
  enough that re-planning saves more step time than the moves cost.

Work is counted in expert rows: a forward row is 1, the backward of a row 2 (two GEMMs of the
forward's size per forward GEMM), so a step's speed ``work / seconds`` is comparable whatever
mix of forward and backward it ran. Legend: G ranks, M rows, D hidden size, F expert hidden size, T
steps, P = 2 figures per step (work, seconds).
"""

from __future__ import annotations

import logging
import time
from collections import deque

import numpy as np
import torch
import torch.distributed as dist

from ._check import positive_int
from .topology import Device, Topology

__all__ = ["ExpertTimer", "SpeedTracker"]

log = logging.getLogger("moebalance")

BACKWARD_WORK = 2.0   # work units of a row's backward (dgrad + wgrad GEMMs) per forward row


# -- the per-step timer -----------------------------------------------------------------------


class _Mark:
    """One point in time: a CUDA event recorded on the current stream, or ``perf_counter``."""

    __slots__ = ("event", "wall")

    def __init__(self, device: torch.device) -> None:
        if device.type == "cuda":
            self.event = torch.cuda.Event(enable_timing=True)
            self.event.record(torch.cuda.current_stream(device))
            self.wall = None
        else:
            self.event, self.wall = None, time.perf_counter()

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def seconds_to(self, end: "_Mark") -> float:
        if self.event is None:
            return end.wall - self.wall
        return self.event.elapsed_time(end.event) / 1e3


class _BackwardWindow:
    """The two ends of one expert call's backward, filled in by the autograd marks."""

    __slots__ = ("start", "rows", "timed")

    def __init__(self, rows: int) -> None:
        self.start, self.rows, self.timed = None, rows, False


class _BackwardStart(torch.autograd.Function):
    """Identity on the experts' output; its backward runs first, so it marks the start."""

    @staticmethod
    def forward(ctx, y, timer, window):
        ctx.timer, ctx.window = timer, window
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        ctx.window.start = _Mark(grad.device)
        return grad, None, None


class _BackwardEnd(torch.autograd.Function):
    """Identity on the experts' input; its backward runs once theirs is done: the end."""

    @staticmethod
    def forward(ctx, x, timer, window):
        ctx.timer, ctx.window = timer, window
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        window = ctx.window
        if window.start is not None:
            ctx.timer._pending.append((window.start, _Mark(grad.device),
                                       BACKWARD_WORK * window.rows))
        return grad, None, None


class ExpertTimer:
    """Times an expert-parallel layer's expert computation, forward and backward.

    :class:`~moebalance.nn.moe.ExpertParallelMoE` calls :meth:`begin` on the rows its slots receive
    and :meth:`end` on their outputs when its ``expert_timer`` is set (one timer may serve every
    layer of a model). :meth:`collect` returns the work and seconds of the windows finished
    since the last call; on a GPU a window whose end event has not completed stays for a later
    call (``Event.query()``, never a synchronize).
    """

    def __init__(self) -> None:
        self._pending: deque = deque()     # (start mark, end mark, work)
        self._open: list = []              # forward windows: (start mark, rows)

    def begin(self, x_MD: torch.Tensor) -> torch.Tensor:
        """Open a window on the rows ``x_MD [M, D]``; returns them (marked for backward)."""
        window = _BackwardWindow(int(x_MD.shape[0]))
        self._open.append((_Mark(x_MD.device), window))
        # Rows that need no gradient (the input of a first layer) leave no point at which the
        # experts' backward is known to end: that layer's backward goes untimed.
        if x_MD.requires_grad:
            x_MD = _BackwardEnd.apply(x_MD, self, window)
            window.timed = True
        return x_MD

    def end(self, y_MD: torch.Tensor) -> torch.Tensor:
        """Close the window :meth:`begin` opened; returns ``y_MD [M, D]`` (marked for backward)."""
        start, window = self._open.pop()
        self._pending.append((start, _Mark(y_MD.device), float(window.rows)))
        if window.timed and y_MD.requires_grad:
            y_MD = _BackwardStart.apply(y_MD, self, window)
        return y_MD

    def collect(self) -> tuple[float, float]:
        """(work, seconds) of the windows finished since the last call, in their order."""
        work = seconds = 0.0
        while self._pending and self._pending[0][1].ready():
            start, end, rows = self._pending.popleft()
            work += rows
            seconds += start.seconds_to(end)
        return work, seconds


# -- the tracker ------------------------------------------------------------------------------


def _fraction(value, name: str, *, low_open: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    value = float(value)
    if not np.isfinite(value) or value > 1 or value < 0 or (low_open and value == 0):
        raise ValueError(f"{name} must be in {'(0' if low_open else '[0'}, 1], got {value!r}")
    return value


class SpeedTracker:
    """Each rank's expert speed, measured every step and smoothed; the Rebalancer's speed trigger.

    Args:
        every: steps between exchanges of the per-step figures (one all-gather) and speed checks.
        smoothing: weight of a new step's speed in the exponential average (1: no smoothing).
        min_change: noise control: the speeds have moved only when some rank's relative speed
            (speeds over their mean) differs from the topology's by at least this fraction...
        window: ...at each of the last ``window`` steps (ordinary jitter does not persist).
            With the defaults (0, 1) any change lets the saving-versus-price test decide.
        horizon: steps a new placement is expected to serve (the saving is counted over them).
        warmup: steps whose timings :meth:`step` leaves out when this process starts (or resumes):
            a first step allocates, compiles and faults memory in, unevenly across ranks, and
            its time says nothing of the device's speed.
        move_price_s: seconds one expert move costs the job; None: the seconds per move of the
            Rebalancer's last finished migration (an upper bound: live migrations overlap the
            steps), 0 before the first.

    Figures (all ranks hold the same): ``speed`` ([G] smoothed work per second, None before
    the first exchange), ``expert_s`` (the slowest rank's mean expert seconds per step over the
    last exchange), ``history`` (one [G] relative speed per step) and ``decisions`` (one dict
    per check that found the speeds moved: speeds, expected saving and price, re-planned or not).
    """

    def __init__(self, every: int = 10, *, smoothing: float = 0.3, min_change: float = 0.0,
                 window: int = 1, horizon: int = 100, move_price_s: float | None = None,
                 warmup: int = 1) -> None:
        self.every = positive_int(every, "every")
        self.smoothing = _fraction(smoothing, "smoothing")
        self.min_change = float(min_change)
        if not np.isfinite(self.min_change) or self.min_change < 0:
            raise ValueError(f"min_change must be a fraction >= 0 (e.g. 0.1), got {min_change!r}")
        self.window = positive_int(window, "window")
        self.horizon = positive_int(horizon, "horizon")
        if not isinstance(warmup, (int, np.integer)) or isinstance(warmup, bool) or warmup < 0:
            raise ValueError(f"warmup must be a number of steps >= 0, got {warmup!r}")
        self.warmup = int(warmup)
        self._warmed = 0                               # steps left out in this process so far
        if move_price_s is not None and not (np.isfinite(move_price_s) and move_price_s >= 0):
            raise ValueError(f"move_price_s must be seconds >= 0 or None, got {move_price_s!r}")
        self.move_price_s = None if move_price_s is None else float(move_price_s)
        self.timer = ExpertTimer()
        self.speed: np.ndarray | None = None
        self.expert_s: float | None = None
        self.history: list[np.ndarray] = []
        self._raw: deque = deque(maxlen=self.window)   # the last steps' unsmoothed [G] speeds
        self.decisions: list[dict] = []
        self.steps = 0
        self._local: list[tuple[float, float]] = []    # this rank's (work, seconds) per step

    def attach(self, model: torch.nn.Module) -> "SpeedTracker":
        """Time the expert computation of every expert-parallel layer in ``model``
        (:class:`~moebalance.nn.moe.ExpertParallelMoE`, and the layers ``mb.wrap`` builds);
        returns self."""
        from .nn.slots import moe_layers

        layers = moe_layers(model)
        if not layers:
            raise ValueError(f"{type(model).__name__} holds no expert-parallel layer "
                             f"(ExpertParallelMoE or one built by mb.wrap) whose experts a "
                             f"SpeedTracker can time")
        for layer in layers:
            layer.expert_timer = self.timer
        return self

    def step(self, group=None) -> None:
        """Close a step: keep this rank's finished timings; every ``every`` steps exchange them
        (a collective on every rank of ``group``) and update the smoothed speeds."""
        self.steps += 1
        timings = self.timer.collect()
        if self._warmed < self.warmup:
            self._warmed += 1
        else:
            self._local.append(timings)
        if self.steps % self.every == 0:
            self.exchange(group)

    def exchange(self, group=None) -> None:
        """All-gather the per-step figures since the last exchange and fold them in."""
        local = np.asarray(self._local, dtype=np.float64).reshape(-1, 2)
        self._local = []
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            everyone = [None] * dist.get_world_size(group)
            dist.all_gather_object(everyone, local, group=group)
            steps = min(len(x) for x in everyone)
            figures_GTP = np.stack([x[:steps] for x in everyone])
        else:
            figures_GTP = local[None]
        self.update(figures_GTP)

    def update(self, figures_GTP: np.ndarray) -> None:
        """Fold in per-step figures ``[G, T, 2]`` (work, seconds) of every rank, step by step.

        A rank without timed work in a step keeps its speed; the average starts at the first
        step where every rank has one.
        """
        figures_GTP = np.asarray(figures_GTP, dtype=np.float64)
        work_GT, seconds_GT = figures_GTP[..., 0], figures_GTP[..., 1]
        timed = (work_GT > 0) & (seconds_GT > 0)
        if figures_GTP.shape[1]:
            self.expert_s = float(seconds_GT.max(axis=0).mean())
        a = self.smoothing
        for t in range(work_GT.shape[1]):
            ok = timed[:, t]
            raw = np.where(ok, work_GT[:, t] / np.where(ok, seconds_GT[:, t], 1.0), np.nan)
            if self.speed is None:
                if not ok.all():
                    continue
                self.speed = raw
            else:
                self.speed = np.where(ok, (1 - a) * self.speed + a * raw, self.speed)
            self._raw.append(np.where(ok, raw, self.speed))
            self.history.append(self.speed / self.speed.mean())

    def relative(self) -> np.ndarray:
        """[G] smoothed speeds over the fastest (1.0 for it); raises before the first figures."""
        if self.speed is None:
            raise ValueError("no speeds measured yet: call step() for at least `every` steps of "
                             "training with the tracker attached")
        return self.speed / self.speed.max()

    def planning_speeds(self) -> np.ndarray:
        """[G] the speeds a re-plan is for, over the fastest: with ``window`` >= 2 each rank's
        median over the last ``window`` steps' unsmoothed speeds, else the smoothed ones
        (:meth:`relative`).

        When the speeds moved, each of the window's steps showed the move (:meth:`moved`), so
        they measure the new level, and their median is not pulled by one step that a hiccup
        slowed (the mean of 3 steps, one of them at 0.7 of the rank's speed, reads 0.9, and a
        plan for that stays until the speeds move by ``min_change`` again); the exponential
        average still lags behind a
        step change (after 5 steps at smoothing 0.3 it has gone 83% of the way: a rank slowed to
        0.5 reads 0.58), and a plan for that speed leaves the slow rank overloaded by the rest,
        which is then too small a change to trigger another re-plan."""
        if self.window < 2 or len(self._raw) < self.window:
            return self.relative()
        level = np.median(np.stack(self._raw), axis=0)
        return level / level.max()

    def moved(self, reference_G) -> bool:
        """Whether the smoothed relative speeds differ from ``reference_G [G]`` (e.g. the
        topology's speeds) by ``min_change`` or more at each of the last ``window`` steps."""
        if len(self.history) < self.window:
            return False
        ref = np.asarray(reference_G, dtype=np.float64)
        ref = ref / ref.mean()
        changes = [np.abs(h / ref - 1).max() for h in self.history[-self.window:]]
        return min(changes) >= self.min_change and max(changes) > 0

    def check(self, rebalancer) -> tuple[Topology, np.ndarray] | None:
        """At a check step (after :meth:`step`), whether ``rebalancer`` should re-plan for the
        measured speeds: (new topology, the loads to plan for) if the expected saving over
        ``horizon`` steps beats the moves' price, else None. Collective when the speeds moved
        (it reads the reduced loads); every rank decides alike from the same figures."""
        from .metrics import summary_imbalance
        from .nn.slots import current_placement
        from .planner import plan
        from .planner.steps import planned_loads

        if self.steps % self.every or self.speed is None:
            return None
        topology = rebalancer.topology
        if not self.moved(topology.speed):
            return None
        measured = Topology([Device(speed=float(s), slots=d.slots, node=d.node)
                             for s, d in zip(self.planning_speeds(), topology.devices)])
        loads = rebalancer._loads()
        current = current_placement(rebalancer.model)
        new = plan(loads, measured, previous=current, max_moves=rebalancer.max_moves,
                   **rebalancer.plan_options)
        # Expert time per step is proportional to sum_l max_g(load/speed): the imbalance ratio
        # (on the loads the plan is for, the steps' recent level, when the Rebalancer reads
        # per-step counts [T, L, E]).
        mean = planned_loads(loads)
        before = summary_imbalance(mean, current, measured)
        after = summary_imbalance(mean, new, measured)
        saving_s = (self.expert_s or 0.0) * max(0.0, 1.0 - after / before) * self.horizon
        moves = new.moves_from(current)
        price_s = moves * self._move_price(rebalancer.history)
        # A plan that only re-weights shares moves nothing: its price is zero.
        replan = new != current and saving_s > price_s
        self.decisions.append({"step": rebalancer.steps, "speeds": measured.speed.tolist(),
                               "imbalance_now": before, "imbalance_planned": after,
                               "saving_s": saving_s, "moves": moves, "price_s": price_s,
                               "replan": replan})
        log.info("moebalance: step %d measured speeds %s: re-plan would save %.3f s over %d "
                 "steps for %d moves priced %.3f s -> %s", rebalancer.steps,
                 np.round(measured.speed, 3).tolist(), saving_s, self.horizon, moves, price_s,
                 "re-plan" if replan else "keep")
        return (measured, loads) if replan else None

    def _move_price(self, history: list[dict]) -> float:
        if self.move_price_s is not None:
            return self.move_price_s
        for report in reversed(history):
            if report.get("migration_s") is not None and report.get("moves"):
                return float(report["migration_s"]) / report["moves"]
        return 0.0

    def state_dict(self) -> dict:
        """What a resumed job needs to continue: the step count, smoothed speeds, the slowest
        rank's expert seconds, the last ``window`` relative and unsmoothed speeds (the noise
        control and the re-plan read them) and the decisions. Timings not yet exchanged are
        rank-local and left out."""
        return {"steps": self.steps,
                "speed": None if self.speed is None else self.speed.tolist(),
                "expert_s": self.expert_s,
                "history": [h.tolist() for h in self.history[-self.window:]],
                "raw": [r.tolist() for r in self._raw],
                "decisions": [dict(d) for d in self.decisions]}

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict`'s figures (the same on every rank)."""
        self.steps = int(state["steps"])
        speed = state.get("speed")
        self.speed = None if speed is None else np.asarray(speed, dtype=np.float64)
        self.expert_s = state.get("expert_s")
        self.history = [np.asarray(h, dtype=np.float64) for h in state.get("history", [])]
        self._raw = deque((np.asarray(r, dtype=np.float64) for r in state.get("raw", [])),
                          maxlen=self.window)
        self.decisions = [dict(d) for d in state.get("decisions", [])]
        self._local = []
        self._warmed = 0             # the resumed process warms up again

    def __repr__(self) -> str:
        speed = None if self.speed is None else np.round(self.relative(), 3).tolist()
        return (f"SpeedTracker(every={self.every}, min_change={self.min_change}, "
                f"window={self.window}, speeds={speed})")
