"""Rebalancer (plain training loop): watch loads, re-plan with few moves, migrate beside the step.

Every step, after ``optimizer.step()``::

    rebalancer = mb.Rebalancer(model, topology, optimizer, every=200)
    for batch in data:
        loss = model(batch).loss; loss.backward(); optimizer.step(); optimizer.zero_grad()
        rebalancer.step()

At a trigger (every ``every`` steps, and/or when the tracked imbalance of the current placement
passes ``threshold``, and/or when a re-plan's moves pay for themselves under ``move_cost``) it
reads the recent steps' counts summed over the ranks: the Rebalancer keeps each step's counts
of its last ``STEPS_KEPT`` steps on the device (the tracker's step counts, copied into a ring
with no host sync), and reduces them with one all-reduce beside the tracker's snapshot (which
checks the ids). It then plans ``plan(counts_TLE, topology, previous=current, max_moves=...)``
on every rank: a plan for the steps, each re-split over the replicas as the dispatcher does,
not for their mean (deterministic from the reduced counts; a digest check proves the ranks
agree) and starts the migration. The layers commit their new rows before their next forward,
so training never stops for it.

Figures go to the ``moebalance`` logger (INFO) and to ``rebalancer.history``: one dict per
re-plan with the step, imbalance before and after on the steps' mean load
(``imbalance_before`` / ``imbalance_after``) and per step after the re-split
(``step_imbalance_before`` / ``step_imbalance_after``, :func:`moebalance.step_imbalance`; on
the tracker's loads when fewer than two steps were kept),
moves, bytes, plan time and, once every layer committed, the migration time.
"""

from __future__ import annotations

import hashlib
import logging
import time
import warnings
import weakref

import numpy as np
import torch
from torch import nn

from .._check import optional_positive_int
from ..dispatch.shares import step_imbalance
from ..frameworks import check_optimizer
from ..metrics import summary_imbalance
from ..migrate.transfer import MigrationError, Migrator
from ..migrate.wire import same_everywhere
from ..nn.slots import apply_placement, current_placement, moe_layers, set_device_speeds
from ..planner import MoveCost, plan
from ..planner.steps import planned_loads, planning_window, sampled
from ..planner.trigger import replan_if_it_pays
from ..topology import Topology
from ..tracker import LoadTracker
from .routers import attach, attached_tracker

__all__ = ["Rebalancer"]

# step() calls in a row with no optimizer step that make it warn (the wrong optimizer?)
IDLE_CALLS_WARNING = 1000
log = logging.getLogger("moebalance")

ON_FAILURE = ("warn", "raise")


def torch_optimizer(optimizer):
    """The torch optimizer under a framework's wrapper (Lightning's, accelerate's), or None."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer      # the wrapped optimizer holds the state and the hooks
    return optimizer


def _speed_tracker(speeds, model):
    from ..speeds import SpeedTracker

    if speeds is None:
        return None
    if not isinstance(speeds, SpeedTracker):
        raise TypeError(f"speeds must be a moebalance.SpeedTracker or None, got "
                        f"{type(speeds).__name__}")
    return speeds.attach(model)


# The steps whose counts a Rebalancer keeps for its plans (at most: fewer when it decides more
# often). The plan judges its candidates on a few evenly spaced steps of them and sizes the
# volatile experts' replicas by their spread; 64 steps give both, in L x E x 64 counts per rank.
STEPS_KEPT = 64


# A re-plan report's figures that the framework callbacks log, as ``moebalance/<key>``.
LOGGED_FIGURES = ("imbalance_before", "imbalance_after", "step_imbalance_before",
                  "step_imbalance_after", "moves", "bytes", "plan_ms")


def logged_figures(report: dict) -> dict[str, float]:
    """``moebalance/<key>``: figure, for every figure of a re-plan report."""
    return {f"moebalance/{key}": float(report[key]) for key in LOGGED_FIGURES}


def _for_plan(loads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(loads [L, E], steps [T, L, E]) a plan from ``loads`` is for: per-step counts [T, L, E]
    give their recent level and their steps moved to it (:func:`.planner.steps.planning_window`);
    loads [L, E] are both."""
    return planning_window(loads) if loads.ndim == 3 else (loads, loads[None])


class Rebalancer:
    """Re-plan and migrate the expert-parallel layers of ``model`` while it trains.

    Args:
        model: the model (its expert-parallel layers share one process group).
        topology: the devices (one per rank of the group), with speeds and slots.
        optimizer: the optimizer of the experts (its state moves with the rows); None for
            weights only. It must hold every slot parameter (create it after ``mb.wrap``).
        every: re-plan every this many steps (None: only when ``threshold`` or ``move_cost``
            triggers).
        threshold: also re-plan when the current placement's summary imbalance on the recent
            steps' mean load exceeds this (e.g. 1.05), checked every ``check_every`` steps.
        check_every: steps between threshold checks (default ``every`` or 50); each check is one
            all-reduce of the [L, E] loads and one of the kept steps' counts [T, L, E].
        max_moves: cap on expert copies per re-plan (passed to :func:`moebalance.plan`).
        move_cost: a :class:`~moebalance.planner.MoveCost`: also re-plan, at every check, as
            soon as some layer's moves save more step time over ``move_cost.steps`` steps than
            they take (:func:`moebalance.planner.trigger.replan_if_it_pays`); ``every`` then
            stays the longest interval between re-plans.
        tracker: a :class:`LoadTracker` attached to ``model``; None takes the one
            :func:`moebalance.wrap` attached, or attaches one whose window is the steps between
            decisions. A tracker without window or EMA restarts after each re-plan.
        blocking: finish each migration inside ``step()`` instead of beside the next forward.
        timeout_s, max_bytes_in_flight: see :func:`moebalance.apply_placement`.
        on_failure: "warn" (log, keep training on the placement the layers hold, retry at the
            next trigger) or "raise" (raise the MigrationError from ``step()`` on every rank).
        plan_options: extra keywords for :func:`moebalance.plan`.
        speeds: a :class:`moebalance.SpeedTracker` to follow the devices' measured speeds: it
            times the layers' experts every step, and at its checks the Rebalancer re-plans on
            the measured speeds when that saves more step time than the moves cost (the
            report's ``speeds`` holds them; ``topology`` becomes the measured one).
    """

    def __init__(self, model: nn.Module, topology: Topology, optimizer=None,
                 every: int | None = 200, *, threshold: float | None = None,
                 check_every: int | None = None,
                 max_moves: int | None = None, move_cost: MoveCost | None = None,
                 tracker: LoadTracker | None = None,
                 blocking: bool = False, timeout_s: float = 60.0,
                 max_bytes_in_flight: int | None = None, on_failure: str = "warn",
                 plan_options: dict | None = None, speeds=None) -> None:
        self.layers = moe_layers(model)
        if not self.layers:
            raise ValueError(f"{type(model).__name__} holds no expert-parallel layer; build the "
                             f"model from moebalance layers (or moebalance.wrap it) before adding "
                             f"a Rebalancer")
        if not isinstance(topology, Topology):
            raise TypeError("topology must be a moebalance.Topology, got "
                            f"{type(topology).__name__}")
        world = self.layers[0].dispatcher.world_size
        if topology.num_devices != world:
            raise ValueError(f"topology has {topology.num_devices} devices but the model's group "
                             f"has {world} ranks; describe one device per rank")
        self.every = optional_positive_int(every, "every")
        if threshold is not None and not (isinstance(threshold, (int, float)) and threshold >= 1.0):
            raise ValueError("threshold must be a summary imbalance >= 1.0 (e.g. 1.05) or None, "
                             f"got {threshold!r}")
        if move_cost is not None and not isinstance(move_cost, MoveCost):
            raise TypeError(f"move_cost must be a moebalance.planner.MoveCost or None, got "
                            f"{type(move_cost).__name__}")
        self.move_cost = move_cost
        if self.every is None and threshold is None and move_cost is None and speeds is None:
            raise ValueError("give every=N steps, threshold=imbalance, move_cost=MoveCost(...), "
                             "speeds=SpeedTracker(...), or several; with none the Rebalancer "
                             "never re-plans")
        self.threshold = None if threshold is None else float(threshold)
        self.check_every = optional_positive_int(check_every, "check_every") or self.every or 50
        self.max_moves = None if max_moves is None else int(max_moves)
        if on_failure not in ON_FAILURE:
            raise ValueError(f"on_failure must be one of {list(ON_FAILURE)}, got {on_failure!r}")
        self.on_failure = on_failure
        self.model = model
        self.topology = topology
        self.blocking = bool(blocking)
        self.timeout_s = timeout_s
        self.max_bytes_in_flight = max_bytes_in_flight
        self.plan_options = dict(plan_options or {})
        self.group = self.layers[0].dispatcher.group
        self.world_size = world
        optimizer = torch_optimizer(optimizer)
        if optimizer is not None and not hasattr(optimizer, "register_step_post_hook"):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer (or a wrapper of one), got "
                            f"{type(optimizer).__name__}")
        check_optimizer(model, optimizer)
        self.optimizer = optimizer
        # Step boundaries. A layer commits its moved rows before its next forward, zeroing the
        # gradient rows of the slots that change expert: between the micro-batches of gradient
        # accumulation (step() after each backward) that would drop the gradients accumulated
        # so far. The optimizer's steps and the layers' backward passes are counted by hooks:
        # step() acts once per optimizer step, and a migration commits only at a forward with
        # no backward since the last optimizer step (_at_step_boundary).
        self._optimizer_steps = 0
        self._acted_at = -1            # the optimizer step step() last acted on
        self._backwards = 0            # backward passes through the layers' slots
        self._backwards_at_step = 0
        self._idle_calls = 0
        if optimizer is not None:
            ref = weakref.ref(self)
            self._hooks = [optimizer.register_step_post_hook(_after_optimizer_step(ref))] + [
                layer.slot_parameters()[0].register_post_accumulate_grad_hook(
                    _count_backward(ref)) for layer in self.layers
                if layer.slot_parameters()[0].requires_grad]
        if tracker is None:
            tracker = attached_tracker(model)                       # e.g. by moebalance.wrap
        if tracker is None:
            tracker = attach(model, window=min(self.every or self.check_every, self.check_every))
        elif not isinstance(tracker, LoadTracker):
            raise TypeError("tracker must be a LoadTracker attached to model, got "
                            f"{type(tracker).__name__}")
        self.tracker = tracker
        # A tracker that sums every step (no window, no EMA) is read as "loads since the last
        # re-plan": it starts afresh after each one.
        self._reset_after_replan = tracker.window is None and tracker.ema is None
        self._rows = self._tracker_rows()
        if world > 1:
            # Connect the migration transfers now (a collective), not inside the first re-plan.
            Migrator(self.group, timeout_s=timeout_s).transfer_group()
        self.steps = 0
        self.last_counts = None
        # each step's counts [T, L_tracked, E] on the device, T = the steps between decisions
        self.steps_kept = min(self.every or self.check_every, self.check_every, STEPS_KEPT)
        self._kept_TLE = None
        self._kept_from = 0
        self.history: list[dict] = []
        self._migration = None
        self._report: dict | None = None
        self._last_replan = 0
        self.speeds = _speed_tracker(speeds, model)

    def _tracker_rows(self) -> list[tuple[int, int]]:
        """(tracker layer, placement layer) for every ExpertParallelMoE layer."""
        name_of = {id(m): name for name, m in self.model.named_modules()}
        rows = []
        for layer in self.layers:
            router = layer.router_module()
            tracked = self.tracker.layer_of(router)
            if tracked is None:
                raise ValueError(f"the tracker does not record the router "
                                 f"{name_of.get(id(router), '?')!r}; attach it to this model with "
                                 f"moebalance.attach(model)")
            rows.append((tracked, layer.layer))
        return rows

    # -- the loop --------------------------------------------------------------------------------

    def step(self) -> dict | None:
        """Call once per optimizer step, after it, on every rank. Returns the re-plan's report
        when this step started one, else None.

        With an optimizer, it acts once per optimizer step: with gradient accumulation, a call
        after every micro-batch acts at the first one after each optimizer step and returns None
        at the others; a migration it starts between micro-batches commits only after the
        optimizer's next step."""
        if self.optimizer is not None:
            if self._acted_at == self._optimizer_steps:
                self._idle_calls += 1            # this optimizer step is done already
                if self._idle_calls == IDLE_CALLS_WARNING:
                    warnings.warn(f"Rebalancer.step() was called {IDLE_CALLS_WARNING} times since "
                                  f"the optimizer it was given last stepped; it acts once per "
                                  f"step of that optimizer: pass the optimizer your loop steps",
                                  stacklevel=2)
                return None
            self._acted_at = self._optimizer_steps
            self._idle_calls = 0
        self.steps += 1
        self.last_counts = self.tracker.step()  # [L_tracked, E] of the step just closed, this rank
        self._keep(self.last_counts)
        if self.speeds is not None:
            self.speeds.step(self.group)
        self._check_migration()
        if self._migration is not None:
            return None                         # one migration at a time
        if self.speeds is not None:
            measured = self.speeds.check(self)
            if measured is not None:
                self.topology, loads = measured
                # Every rank reaches this at the same step with the same gathered speeds: the
                # re-split follows them from the next step, on the old placement and the new.
                set_device_speeds(self.model, self.topology.speed)
                current = current_placement(self.model)
                report = self._replan(loads, current,
                                      summary_imbalance(planned_loads(loads), current,
                                                        self.topology))
                report["speeds"] = self.topology.speed.tolist()
                return report
        since = self.steps - self._last_replan
        due = self.every is not None and since >= self.every
        check = ((self.threshold is not None or self.move_cost is not None)
                 and self.steps % self.check_every == 0)
        if not (due or check):
            return None
        loads = self._loads()
        current = current_placement(self.model)
        before = summary_imbalance(planned_loads(loads), current, self.topology)
        if due or (self.threshold is not None and before > self.threshold):
            return self._replan(loads, current, before)
        if self.move_cost is not None:       # same reduced loads on every rank: same answer
            new, _ = replan_if_it_pays(loads, current, self.topology, self.move_cost)
            if new is not None:
                return self._replan(loads, current, before, new)
        return None

    def _keep(self, counts_LE: torch.Tensor) -> None:
        """Copy this step's counts into the ring of kept steps (on their device, no host sync)."""
        if self._kept_TLE is None or self._kept_TLE.device != counts_LE.device:
            self._kept_TLE = counts_LE.new_zeros((self.steps_kept, *counts_LE.shape))
            self._kept_from = self.steps - 1     # steps before this one are not in the ring
        with torch.no_grad():
            self._kept_TLE[(self.steps - 1) % self.steps_kept].copy_(counts_LE)

    def _kept_counts(self) -> np.ndarray | None:
        """[T, L_tracked, E] float64: the kept steps' counts summed over the ranks, oldest
        first (one all-reduce; every rank holds the same steps), or None before two steps."""
        T = min(self.steps - self._kept_from, self.steps_kept) if self._kept_TLE is not None else 0
        if T < 2:
            return None
        order = [(self.steps - T + t) % self.steps_kept for t in range(T)]
        with torch.no_grad():
            kept = self._kept_TLE[order].to(torch.float64)
            if self.world_size > 1:
                torch.distributed.all_reduce(kept, group=self.group)
        return kept.cpu().numpy()

    def _loads(self) -> np.ndarray:
        """The counts to plan for: [T, L, E] per step when at least two steps are kept, else the
        tracker's [L, E]; every rank gets the same (reduced over the ranks)."""
        snapshot = self.tracker.snapshot(self.group)               # [L_tracked, E], all ranks
        kept = self._kept_counts()
        placement = self.layers[0].placement
        L, E = placement.num_layers, placement.num_experts
        loads = np.zeros((L, E) if kept is None else (kept.shape[0], L, E))
        source = snapshot if kept is None else kept
        for tracked, layer in self._rows:
            loads[..., layer, :] = source[..., tracked, :]
        covered = [layer for _, layer in self._rows]
        if len(covered) < L:
            # Layers without a module here are not re-planned: keep their rows (see _replan).
            loads[..., [i for i in range(L) if i not in covered], :] = 1.0
        return loads

    def _replan(self, loads: np.ndarray, current, before: float, new=None) -> dict:
        start = time.perf_counter()
        if new is None:
            new = plan(loads, self.topology, previous=current, max_moves=self.max_moves,
                       **self.plan_options)
        planned_ms = (time.perf_counter() - start) * 1e3
        self._check_agreement(new)
        level, window = _for_plan(loads)
        after = summary_imbalance(level, new, self.topology)
        # per step after the re-split, on the steps plan() judges (on the loads before two steps)
        judged = sampled(window)
        steps_before = float(step_imbalance(judged, current, self.topology).mean())
        steps_after = float(step_imbalance(judged, new, self.topology).mean())
        migration = apply_placement(self.model, new, self.optimizer, topology=self.topology,
                                    blocking=False, timeout_s=self.timeout_s,
                                    max_bytes_in_flight=self.max_bytes_in_flight)
        if self.optimizer is not None:
            migration.commit_gate = _at_boundary(weakref.ref(self))
        self._last_replan = self.steps
        if self._reset_after_replan:
            self.tracker.reset()
        report = {"step": self.steps, "imbalance_before": float(before),
                  "imbalance_after": float(after), "step_imbalance_before": steps_before,
                  "step_imbalance_after": steps_after, "moves": migration.plan.num_moves,
                  "bytes": migration.plan.total_bytes, "plan_ms": planned_ms,
                  "migration_s": None, "error": None}
        self.history.append(report)
        self._migration, self._report = migration, report
        log.info("moebalance: step %d re-plan: imbalance %.4f -> %.4f (per step %.4f -> %.4f), "
                 "%d moves, %.1f MB, plan %.1f ms", self.steps, before, after, steps_before,
                 steps_after, report["moves"], report["bytes"] / 1e6, planned_ms)
        if self.blocking and (self.optimizer is None or self._at_step_boundary()):
            try:
                migration.wait()
            except MigrationError:
                pass                             # handled below, like a failure found later
            self._check_migration()
        return report

    def _at_step_boundary(self) -> bool:
        """No backward ran through the layers since the last optimizer step (the same on
        every rank: they run the same micro-batches)."""
        return self._backwards == self._backwards_at_step

    def _check_agreement(self, placement) -> None:
        if self.world_size == 1:
            return
        digest = hashlib.sha256(placement.phy2log.tobytes() + placement.share.tobytes()).hexdigest()
        if not same_everywhere(digest, self.group):
            raise RuntimeError("ranks planned different placements from the same reduced loads; "
                               "check that every rank runs the same moebalance and numba versions")

    def _check_migration(self) -> None:
        migration = self._migration
        if migration is None or not migration.done:
            return
        self._migration = None
        figures = migration.report()
        self._report["migration_s"] = figures["seconds"]
        self._report["bytes_sent_this_rank"] = figures["bytes_sent"]
        self._report["resends"] = figures["resends"]
        if migration.error is not None:
            self._report["error"] = str(migration.error)
            if self.on_failure == "raise":
                raise migration.error
            log.warning("moebalance: %s", migration.error)
            return
        log.info("moebalance: migration of step %d done: %d moves, %.1f MB in %.3f s",
                 self._report["step"], figures["moves"], figures["bytes_total"] / 1e6,
                 figures["seconds"])

    def finish(self) -> None:
        """Commit a migration still in flight now (e.g. before saving or at the end of training)."""
        if self._migration is not None:
            try:
                self._migration.wait()
            except MigrationError:
                pass
            self._check_migration()

    # -- state -------------------------------------------------------------------------------------

    def resume(self, steps: int) -> None:
        """Continue counting from ``steps`` (a restarted job's optimizer steps so far)."""
        self.steps = self._last_replan = int(steps)

    @property
    def migrating(self) -> bool:
        return self._migration is not None

    def state_dict(self) -> dict:
        """Step counters and history (the placement itself lives in the model's state_dict)."""
        state = {"steps": self.steps, "last_replan": self._last_replan,
                 "history": [dict(r) for r in self.history],
                 "tracker": self.tracker.state_dict()}
        if self.speeds is not None:
            # the measured topology in force and the speed tracker's figures
            state["speeds"] = self.speeds.state_dict()
            state["topology"] = self.topology.to_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.steps = int(state["steps"])
        self._last_replan = int(state["last_replan"])
        self.history = [dict(r) for r in state.get("history", [])]
        if "tracker" in state:
            self.tracker.load_state_dict(state["tracker"])
        if self.speeds is not None and "speeds" in state:
            self.speeds.load_state_dict(state["speeds"])
            topology = Topology.from_dict(state["topology"])
            if topology.num_devices != self.topology.num_devices:
                raise ValueError(f"state holds a topology of {topology.num_devices} devices but "
                                 f"this job has {self.topology.num_devices}; load it into a "
                                 f"Rebalancer of the same size")
            self.topology = topology
            set_device_speeds(self.model, topology.speed)

    def __repr__(self) -> str:
        return (f"Rebalancer(every={self.every}, threshold={self.threshold}, steps={self.steps}, "
                f"replans={len(self.history)}, migrating={self.migrating})")


def _after_optimizer_step(ref: weakref.ref):
    """The Rebalancer's optimizer step post-hook (held weakly: the optimizer must not keep a
    finished Rebalancer alive): count the step."""

    def stepped(optimizer, args, kwargs) -> None:
        owner = ref()
        if owner is not None:
            owner._optimizer_steps += 1
            owner._backwards_at_step = owner._backwards

    return stepped


def _count_backward(ref: weakref.ref):
    def counted(param) -> None:
        owner = ref()
        if owner is not None:
            owner._backwards += 1

    return counted


def _at_boundary(ref: weakref.ref):
    """A migration's commit gate: :meth:`Rebalancer._at_step_boundary` (held weakly)."""

    def gate() -> bool:
        owner = ref()
        return owner is None or owner._at_step_boundary()

    return gate
