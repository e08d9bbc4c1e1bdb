"""The simulation loop: a trace, a cluster, a model and policies in; modelled steps out.

:func:`simulate` scales every step and layer of the trace to the model's (token, expert) pairs
per step, gives each policy the first ``warmup`` steps as history, then walks the remaining
steps. Between re-plans a policy's placement is fixed, so the device loads of such a stretch
are computed at once: each expert's tokens times its replicas' shares summed per device, or,
with the per-step re-split, every step's tokens re-split over the replicas by the dispatcher's
own kernel (:func:`moebalance.dispatch.resplit_kernel.resplit_loads`: water-filling sweeps, then
the exact flow, with the speeds the policy believes). The :class:`~.stepmodel.StepModel` turns
loads into seconds at the speeds the devices run at (the cluster's ``speed_changes`` applied step
by step). A policy with transient slots (:mod:`.transient`) re-splits every step over its placement
plus that step's transient copies, and the step model charges the copies' transfers.

Legend: T steps, L layers, E experts, G devices, S slots.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ...dispatch.resplit_kernel import RESPLIT_SWEEPS
from ...placement import Placement
from ...planner import MoveCost, _jit
from ...topology import Topology
from .cluster import ClusterSpec, ModelShape
from .policies import Policy
from .stepmodel import StepModel

__all__ = ["PolicyRun", "Simulation", "simulate", "scale_trace", "move_price"]

TERMS = ("expert_compute", "all_to_all", "non_moe", "migration", "transient")


@dataclass
class PolicyRun:
    """What one policy did over the simulated steps.

    Attributes:
        name: the policy's name.
        step_seconds: [T] modelled seconds of every step.
        terms: [T] seconds of each of :data:`TERMS` per step (their sum is ``step_seconds``).
        imbalance: [T] summary imbalance (sum over layers of the slowest device's load / speed,
            over the same sum at perfect balance).
        replans: one dict per new placement: step, plan_seconds, moves, bytes, seconds (the
            transfer, slowest stage) and exposed (seconds it added to the step).
        layer_loads: [G] mean load of every device on the layer ``Simulation.shown_layer``.
        start_plan_seconds: the initial placement's planning time.
        copies: [T] transient copies made at every step (all layers; zeros without them).
    """

    name: str
    step_seconds: np.ndarray
    terms: dict[str, np.ndarray]
    imbalance: np.ndarray
    replans: list[dict] = field(default_factory=list)
    layer_loads: np.ndarray | None = None
    start_plan_seconds: float = 0.0
    copies: np.ndarray | None = None

    def summary(self, tokens_per_step: float) -> dict:
        """Scalar figures of the run (see ``moebalance simulate``'s table)."""
        mean = float(self.step_seconds.mean())
        n = len(self.replans)
        return {
            "policy": self.name,
            "tokens_per_s": tokens_per_step / mean,
            "mean_step_s": mean,
            "p99_step_s": float(np.percentile(self.step_seconds, 99)),
            "mean_imbalance": float(self.imbalance.mean()),
            "replans": n,
            "moves_per_replan": float(np.mean([r["moves"] for r in self.replans])) if n else 0.0,
            "bytes_per_replan": float(np.mean([r["bytes"] for r in self.replans])) if n else 0.0,
            "exposed_migration_s": float(sum(r["exposed"] for r in self.replans)),
            "plan_s": float(np.mean([r["plan_seconds"] for r in self.replans])) if n else
            self.start_plan_seconds,
            "copies_per_step": float(self.copies.mean()) if self.copies is not None else 0.0,
            **{f"mean_{k}_s": float(v.mean()) for k, v in self.terms.items()},
        }


@dataclass
class Simulation:
    """Every policy's run on one trace, cluster and model."""

    cluster: ClusterSpec
    model: ModelShape
    topology: Topology
    runs: list[PolicyRun]
    first_step: int
    shown_layer: int
    trace: str = ""

    @property
    def tokens_per_step(self) -> float:
        return float(self.cluster.num_devices * self.model.tokens_per_device)

    def summaries(self) -> list[dict]:
        return [run.summary(self.tokens_per_step) for run in self.runs]


def scale_trace(counts_TLE: np.ndarray, model: ModelShape, num_devices: int) -> np.ndarray:
    """``counts_TLE`` rescaled so every step and layer holds the model's pairs per step
    (``G x tokens_per_device x K``): only a trace's shares matter. Empty layers stay empty."""
    counts = np.asarray(counts_TLE, dtype=np.float64)
    totals = counts.sum(axis=-1, keepdims=True)
    pairs = float(num_devices * model.tokens_per_device * model.top_k)
    return np.divide(counts * pairs, totals, out=np.zeros_like(counts), where=totals > 0)


def move_price(step_model: StepModel, every: int, num_layers: int) -> MoveCost:
    """The move price of a re-plan every ``every`` steps: one expert's moved bytes over the
    slowest device's network link, against the balanced expert compute of a step."""
    return MoveCost(bytes_per_move=step_model.model.bytes_per_move,
                    bandwidth=float(step_model.inter_bw_G.min()), steps=float(every),
                    step_seconds=step_model.ideal_moe_seconds(num_layers))


def _static_loads(w_BLE: np.ndarray, placement: Placement, G: int) -> np.ndarray:
    """[B, L, G]: each expert's tokens split by its replicas' shares, summed per device."""
    B, L, _ = w_BLE.shape
    out = np.zeros((B, L, G))
    device_onehot = np.zeros((placement.num_slots, G))
    device_onehot[np.arange(placement.num_slots), placement.slot_device] = 1.0
    for layer in range(L):
        per_slot = w_BLE[:, layer, placement.phy2log[layer]] * placement.share[layer]   # [B, S]
        out[:, layer] = per_slot @ device_onehot
    return out


def _resplit_loads(w_BLE: np.ndarray, placement: Placement, topology: Topology) -> np.ndarray:
    """[B, L, G]: every step's tokens re-split over the replicas as the dispatcher does it
    (water-filling sweeps from the placement's shares, then the exact flow)."""
    B, L, _ = w_BLE.shape
    resplit = _jit.kernels().resplit_loads
    speed_G = np.ascontiguousarray(topology.speed, dtype=np.float64)
    out = np.empty((B, L, topology.num_devices))
    for layer in range(L):
        out[:, layer] = resplit(np.ascontiguousarray(w_BLE[:, layer], dtype=np.float64),
                                placement.phy2log[layer], placement.share[layer], speed_G,
                                placement.slot_device, RESPLIT_SWEEPS, True)
    return out


def _transient_loads(policy: Policy, w_BLE: np.ndarray, guide_BLE: np.ndarray,
                     placement: Placement, topology: Topology, step_model: StepModel
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Loads [B, L, G], copy seconds [B, L, G] and copies [B] of steps ``w_BLE`` under
    ``placement`` plus each step's transient copies, chosen on ``guide_BLE`` [B, L, E]."""
    B, L, _ = w_BLE.shape
    G = topology.num_devices
    devices_G5 = np.stack([topology.speed, step_model.node_G.astype(np.float64),
                           np.full(G, float(policy.transient)), step_model.intra_bw_G,
                           step_model.inter_bw_G], axis=1)
    unit_bytes = np.array([step_model.model.flops_per_pair / step_model.flops_G.max(),
                           step_model.model.copy_bytes])
    kernel = _jit.kernels().transient_loads   # registered when .policies imports .transient
    loads = np.empty((B, L, G))
    seconds = np.empty((B, L, G))
    copies = np.zeros(B, dtype=np.int64)
    for layer in range(L):
        loads[:, layer], seconds[:, layer], made = kernel(
            np.ascontiguousarray(w_BLE[:, layer]), np.ascontiguousarray(guide_BLE[:, layer]),
            placement.phy2log[layer], placement.share[layer], placement.slot_device, devices_G5,
            unit_bytes)
        copies += made
    return loads, seconds, copies


def _device_loads(policy: Policy, w_BLE: np.ndarray, placement: Placement | None,
                  topology: Topology, speed_BG: np.ndarray) -> np.ndarray:
    """[B, L, G] loads of steps ``w_BLE`` under ``placement``; ``topology`` is what the policy
    believes (its re-split's speeds), ``speed_BG`` what the devices run at (the oracle's)."""
    if policy.oracle:
        share_BG = speed_BG / speed_BG.sum(axis=-1, keepdims=True)
        return w_BLE.sum(axis=-1, keepdims=True) * share_BG[:, None, :]
    if policy.resplit:
        return _resplit_loads(w_BLE, placement, topology)
    return _static_loads(w_BLE, placement, topology.num_devices)


def simulate(counts_TLE: np.ndarray, cluster: ClusterSpec, model: ModelShape,
             policies: list[Policy], *, warmup: int, shown_layer: int | None = None,
             progress=None, trace: str = "") -> Simulation:
    """Run every policy over ``counts_TLE[warmup:]`` (the first ``warmup`` steps are history).

    Args:
        counts_TLE: [T, L, E] router counts (any scale; rescaled by :func:`scale_trace`).
        cluster, model: the devices and the MoE shape (its L and E must match the trace's).
        policies: :class:`~.policies.Policy` objects (bound to the cluster's topology here).
        warmup: history steps before the first simulated one (>= 1, < T).
        shown_layer: the layer whose per-device loads are kept (default: the most skewed).
        progress: a callable ``(steps_done)`` told after every stretch of steps (a progress
            bar's update), or None.
        trace: a description kept with the result.
    """
    T, L, E = counts_TLE.shape
    if (model.num_layers, model.num_experts) != (L, E):
        raise ValueError(f"model {model.name!r} has {model.num_layers} layers x "
                         f"{model.num_experts} experts but the trace is {L} x {E}: use "
                         f"model.with_trace_shape({L}, {E}) or a trace of the model's shape")
    if not 1 <= warmup < T:
        raise ValueError(f"warmup must be in [1, {T - 1}] for a trace of {T} steps, got {warmup!r}")
    late = [c for c in cluster.speed_changes if c[0] >= T]
    if late:
        raise ValueError(f"speed change(s) {late} (step, device, factor) fall after the trace's "
                         f"last step {T - 1}: give steps in [0, {T - 1}] or a longer trace")
    w = scale_trace(counts_TLE, model, cluster.num_devices)
    topology = cluster.topology(model)
    step_model = StepModel(cluster, model, topology)
    factors_TG = cluster.speed_factors(T)
    if shown_layer is None:
        mean = w[warmup:].mean(axis=0)
        shown_layer = int((mean.max(axis=1) / np.maximum(mean.mean(axis=1), 1e-300)).argmax())
    runs = []
    for policy in policies:
        runs.append(_run_policy(policy.bind(topology, topology.speed * factors_TG), w, warmup,
                                step_model, factors_TG, shown_layer, progress))
    return Simulation(cluster=cluster, model=model, topology=topology, runs=runs,
                      first_step=warmup, shown_layer=shown_layer, trace=trace)


# Steps whose device loads [steps, L, G] are held at once (bounds memory at 1024 devices).
CHUNK_STEPS = 64


def _run_policy(policy: Policy, w_TLE: np.ndarray, warmup: int, step_model: StepModel,
                factors_TG: np.ndarray, shown_layer: int, progress) -> PolicyRun:
    T, L, _ = w_TLE.shape
    topology = step_model.topology
    speed_TG = topology.speed * factors_TG
    current = policy.start(w_TLE[:warmup])
    start_plan = sum(policy.plan_seconds)
    # The steps at which the placement changes come first: loads then go stretch by stretch.
    # A policy that measures speeds may change its topology with a placement: kept beside it.
    changes: list[tuple[int, Placement, Placement | None, float]] = []
    placements = {warmup: (current, policy.topology)}
    for t in range(warmup + 1, T):
        planned = len(policy.plan_seconds)
        new = policy.step(t, w_TLE[:t], current)
        if new is not None:
            changes.append((t, new, current, sum(policy.plan_seconds[planned:])))
            current = new
            placements[t] = (current, policy.topology)
    n = T - warmup
    if policy.transient:
        step_model.cluster.check_transient(step_model.model, policy.transient)
    transient = np.zeros(n)
    copies = np.zeros(n, dtype=np.int64)
    layer_terms = {k: np.empty((n, L)) for k in ("expert_compute", "all_to_all", "non_moe")}
    imbalance = np.empty(n)
    shown = np.zeros(topology.num_devices)
    bounds = sorted(placements) + [T]
    for begin, end in zip(bounds[:-1], bounds[1:]):
        for lo in range(begin, end, CHUNK_STEPS):
            hi = min(lo + CHUNK_STEPS, end)
            placement, believed = placements[begin]
            if policy.transient:
                guide = w_TLE[lo - 1:hi - 1] if policy.guide == "previous" else w_TLE[lo:hi]
                loads, copy_seconds, copies[lo - warmup:hi - warmup] = _transient_loads(
                    policy, w_TLE[lo:hi], guide, placement, believed, step_model)
            else:
                loads = _device_loads(policy, w_TLE[lo:hi], placement, believed, speed_TG[lo:hi])
            chunk_terms = step_model.layer_terms(loads, factors_TG[lo:hi])
            for k, v in chunk_terms.items():
                layer_terms[k][lo - warmup:hi - warmup] = v
            if policy.transient:
                transient[lo - warmup:hi - warmup] = step_model.transient_seconds(
                    copy_seconds, loads, chunk_terms, policy.guide)
            imbalance[lo - warmup:hi - warmup] = step_model.imbalance(loads, factors_TG[lo:hi])
            shown += loads[:, shown_layer].sum(axis=0)
        if progress is not None:
            progress(end - begin)
    terms = {k: v.sum(axis=1) for k, v in layer_terms.items()}
    terms["migration"] = np.zeros(n)
    terms["transient"] = transient
    replans = []
    for t, new, old, plan_seconds in changes:
        stage_seconds, nbytes, moves = step_model.migration(old, new)
        exposed = step_model.exposed_migration(
            stage_seconds, {k: v[t - warmup] for k, v in layer_terms.items()}, policy.migration)
        terms["migration"][t - warmup] += exposed
        replans.append({"step": t, "plan_seconds": plan_seconds, "moves": moves, "bytes": nbytes,
                        "seconds": float(stage_seconds.max()), "exposed": exposed})
    return PolicyRun(name=policy.name, step_seconds=sum(terms.values()), terms=terms,
                     imbalance=imbalance, replans=replans, layer_loads=shown / n,
                     start_plan_seconds=start_plan, copies=copies)
