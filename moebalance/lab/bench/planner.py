"""Planner benchmark: ``moebalance.plan`` against the EPLB baseline.

Shapes: L layers, E experts, S slots, G devices.

What it compares, on the clusters of :mod:`moebalance.lab.workloads`:

- **static**: one first placement per cluster and skew. Homogeneous clusters use DeepSeek's EPLB
  itself as the baseline (hierarchical where the expert groups divide among the nodes, else
  global); clusters EPLB cannot express (uneven slots, unequal speeds) use the EPLB-style
  baseline generalised to any topology.
- **drift**: a sequence of re-plans, loads jittered by 5% and by 20% each time. moebalance plans
  with ``previous=`` its last placement; the baseline plans from scratch, as EPLB does.
- **drop-in**: ``moebalance.rebalance_experts`` against DeepSeek's ``rebalance_experts`` on the
  homogeneous clusters, same arguments: balancedness, replicas that share a GPU with another
  replica of their expert (EPLB allows it), plan times and speed-up.
- **trace** (when a router trace ships with the package): loads are the mean counts over a
  window of steps, on clusters sized for the trace's experts; the replay re-plans on each
  following window, like the drift sequences.

Figures (DESIGN.md section 2): imbalance is ``sum_l max_g(load/speed) / sum_l ideal``; worst
layer is the largest per-layer imbalance; balancedness is EPLB's mean/max device load averaged
over layers; moves are expert copies to transfer from the previous placement (all slots for a
first placement); plan time is the median wall time of one call for all layers, warm, on one
thread, with the methods' calls interleaved so that machine noise hits them alike; an EPLB call
slower than ``SLOW_CALL_S`` is timed once. Only the planning call is timed: not validation, not
the conversion of EPLB's output to a Placement.

Runs: the default (the model's size on one cluster of each kind and the trace, about a minute on
2 cores), ``--quick`` (8 layers, every cluster) and ``--full`` (every cluster, every move
budget, the drop-in table). Output opens with the verdict (:mod:`.verdict`), one line per
cluster, then the full tables.

Writes ``results.json`` (rows, machine, versions, command line), ``summary.md`` and
``plot.png`` to the output folder.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import textwrap
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ...backends import backend, has_numba
from ...cli.args import (
    ArgumentParser,
    UsageError,
    nonneg_int_arg,
    positive_int_arg,
    run_guarded,
    writable_dir,
)
from ...metrics import balancedness, imbalance, summary_imbalance
from ...placement import Placement
from ...planner import plan, rebalance_experts
from ...topology import Topology
from .. import eplb_reference as eplb
from .. import workloads
from ..report import (
    PLANNER_PLOT_CAPTION,
    add_caption,
    format_markdown,
    format_text,
    legend_markdown,
    legend_text,
    machine_info,
)
from .migration import BUDGETS_PCT, FRONTIER_COLUMNS, frontier_cells, plot_frontier, run_frontier
from .per_step import optimal_share_figures, per_step_figures
from .verdict import COLUMNS as VERDICT_COLUMNS
from .verdict import verdict_cells, verdict_legend, verdict_text

DESCRIPTION = ("Planner benchmark: moebalance.plan() against the EPLB baseline; balance, moves "
               "and plan time on built-in clusters and workloads.")
# The synthetic model (module docstring of moebalance.lab.workloads): DeepSeek-V3 sized.
MODEL = {"num_layers": 58, "num_experts": 256, "num_groups": 8, "top_k": 8, "tokens": 8192}
# Two more alike clusters beside the built-in ones: 3 slots per device (S - E = G) and 2 slots
# per device (S - E < G: too few spare slots for a valve on every device).
EXTRA_CLUSTERS = {c.name: c for c in (
    workloads.Cluster("homogeneous-384", "384 slots on 128 identical devices (3 each), 16 nodes "
                      "of 8", (1.0,) * 128, (3,) * 128, tuple(g // 8 for g in range(128))),
    workloads.Cluster("homogeneous-288-144", "288 slots on 144 identical devices (2 each), 18 "
                      "nodes of 8", (1.0,) * 144, (2,) * 144, tuple(g // 8 for g in range(144))),
)}
STATIC_CLUSTERS = ("homogeneous-320", "homogeneous-288", "homogeneous-384", "homogeneous-288-144",
                   "uneven-288", "heterogeneous")
DRIFT_CLUSTERS = STATIC_CLUSTERS
DRIFT_RELS = (0.05, 0.2)
VERDICT_DRIFT = 0.2  # the drift sequence the verdict reports
PLOT_CLUSTERS = ("homogeneous-320", "heterogeneous")
# The runs. --quick: few enough layers and calls that a run, JIT warm-up included, stays under
# 30 s on 2 cores. The default run: the model's own size on one cluster of each class, its
# verdict within a minute on 2 cores. --full: every cluster, more re-plans, every move budget
# and the EPLB drop-in table.
QUICK = {"num_layers": 8, "repeats": 2, "drift_steps": 2, "clusters": STATIC_CLUSTERS,
         "budgets": "all", "dropin": True}
DEFAULT = {"num_layers": MODEL["num_layers"], "repeats": 5, "drift_steps": 3,
           "clusters": ("homogeneous-320", "uneven-288", "heterogeneous"), "budgets": "verdict",
           "dropin": False}
FULL = {"num_layers": MODEL["num_layers"], "repeats": 5, "drift_steps": 6,
        "clusters": STATIC_CLUSTERS, "budgets": "all", "dropin": True}
# A call of an EPLB baseline slower than this is timed once (its first call; torch and the
# baselines are warmed on a small input at start): five timings of a 7 s call buy nothing.
SLOW_CALL_S = 0.5



def bench_cluster(name: str) -> workloads.Cluster:
    """A built-in cluster of :mod:`moebalance.lab.workloads` or one of :data:`EXTRA_CLUSTERS`."""
    return EXTRA_CLUSTERS[name] if name in EXTRA_CLUSTERS else workloads.cluster(name)


# -- methods ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Method:
    """One way to plan, as the benchmark calls it.

    ``run(loads_LE, previous)`` returns ``(result, seconds)``: the timed call's raw result and
    its wall time. ``to_placement(result)`` turns the result into a Placement, outside the timing.
    """

    name: str
    run: Callable[[np.ndarray, "Placement | None"], tuple[object, float]]
    to_placement: Callable[[object], Placement]
    reference: bool = False  # an EPLB baseline: a slow call is timed once (SLOW_CALL_S)


def _timed(fn: Callable[[], object]) -> tuple[object, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def moebalance_method(topology: Topology) -> Method:
    return Method(
        name="moebalance",
        run=lambda w, prev: _timed(lambda: plan(w, topology, previous=prev)),
        to_placement=lambda p: p,
    )


def fresh_method(topology: Topology) -> Method:
    """moebalance planning from scratch at every re-plan: the balance a re-plan is held to."""
    return Method(
        name="moebalance (fresh)",
        run=lambda w, prev: _timed(lambda: plan(w, topology)),
        to_placement=lambda p: p,
    )


def eplb_layout(topology: Topology) -> tuple[int, int] | None:
    """``(num_nodes, num_gpus)`` when DeepSeek's EPLB can express ``topology`` (identical devices,
    equal slots, nodes of equal size numbered in rank order), else None."""
    if not topology.is_homogeneous:
        return None
    G, nodes = topology.num_devices, topology.num_nodes
    if G % nodes or not np.array_equal(topology.node, np.arange(G) // (G // nodes)):
        return None
    return nodes, G


def baseline_method(topology: Topology, num_experts: int, num_groups: int) -> Method:
    """DeepSeek's EPLB where it applies (see :func:`eplb_layout`), else the EPLB-style plan."""
    layout = eplb_layout(topology)
    if layout is None:
        return Method(
            name="eplb-style",
            run=lambda w, prev: _timed(lambda: eplb.eplb_style_plan(w, topology)),
            to_placement=lambda p: p,
            reference=True,
        )
    nodes, gpus = layout
    groups = num_groups if num_experts % num_groups == 0 else 1
    # one node or one group: EPLB's hierarchical code path reduces to its global policy
    kind = "hierarchical" if groups % nodes == 0 and nodes > 1 and groups > 1 else "global"
    S = topology.num_slots
    return Method(
        name=f"eplb ({kind})",
        run=lambda w, prev: _timed(lambda: eplb.eplb_baseline(w, S, groups, nodes, gpus)),
        to_placement=lambda out: eplb.placement_from_phy2log(out[0], num_experts, topology),
        reference=True,
    )


def dropin_method(topology: Topology, num_experts: int, num_groups: int) -> Method:
    """``moebalance.rebalance_experts`` with EPLB's arguments (EPLB-expressible topologies only)."""
    nodes, gpus = eplb_layout(topology)
    groups = num_groups if num_experts % num_groups == 0 else 1
    S = topology.num_slots
    return Method(
        name="rebalance_experts",
        run=lambda w, prev: _timed(lambda: rebalance_experts(w, S, groups, nodes, gpus)),
        to_placement=lambda out: eplb.placement_from_phy2log(out[0], num_experts, topology),
    )


# -- measuring -------------------------------------------------------------------------------------


@dataclass
class Row:
    """One line of the results table."""

    workload: str
    scenario: str
    kind: str  # "static" or "drift"
    skew: str
    method: str
    imbalance: float
    worst_layer_imbalance: float
    balancedness: float
    moves: float
    moves_pct: float
    plan_ms: float
    plan_ms_samples: list[float]
    num_layers: int
    num_slots: int
    num_devices: int
    drift: float | None = None
    replans: int = 0


@dataclass
class Figures:
    """Balance of one placement on one load matrix."""

    summary: float
    worst: float
    balancedness: float
    per_layer: np.ndarray = field(repr=False)

    @classmethod
    def of(cls, loads_LE: np.ndarray, placement: Placement, topology: Topology) -> "Figures":
        per_layer = imbalance(loads_LE, placement, topology)
        return cls(summary=summary_imbalance(loads_LE, placement, topology),
                   worst=float(per_layer.max()),
                   balancedness=float(balancedness(loads_LE, placement, topology).mean()),
                   per_layer=per_layer)


def _interleaved(methods: Sequence[Method], loads_LE: np.ndarray, previous: Sequence,
                 repeats: int) -> tuple[list[object], list[list[float]]]:
    """Call every method ``repeats`` times, round-robin; return each one's last result and times."""
    results: list[object] = [None] * len(methods)
    times: list[list[float]] = [[] for _ in methods]
    for _ in range(repeats):
        for i, m in enumerate(methods):
            results[i], seconds = m.run(loads_LE, previous[i])
            times[i].append(seconds * 1e3)
    return results, times


def _timed_calls(methods: Sequence[Method], loads_LE: np.ndarray, repeats: int
                 ) -> tuple[list[object], list[list[float]]]:
    """First placements by every method, timed: one untimed warm call each, then ``repeats``
    interleaved timed calls; a reference (EPLB) whose first call took over ``SLOW_CALL_S`` keeps
    that call as its one timing instead. Returns each method's last result and its times (ms)."""
    results, first = _interleaved(methods, loads_LE, [None] * len(methods), 1)
    again = [i for i, m in enumerate(methods)
             if not (m.reference and first[i][0] > SLOW_CALL_S * 1e3)]
    times = [[] if i in again else first[i] for i in range(len(methods))]
    if again:
        more, more_times = _interleaved([methods[i] for i in again], loads_LE,
                                        [None] * len(again), repeats)
        for i, r, t in zip(again, more, more_times):
            results[i], times[i] = r, t
    return results, times


def warm_references() -> None:
    """One small call of each EPLB baseline path (torch's first calls pay for set-up), so that
    a slow reference call timed once is timed warm."""
    w = np.linspace(1.0, 16.0, 16).reshape(2, 8)
    eplb.eplb_baseline(w, 16, 4, 2, 4)   # hierarchical
    eplb.eplb_baseline(w, 16, 1, 1, 4)   # global
    eplb.eplb_style_plan(w, Topology.from_arrays([1.0, 0.5], [5, 3]))


def _duplicates(placement: Placement) -> int:
    """Replicas that sit on a device already holding their expert (EPLB can do that)."""
    E = placement.num_experts
    total = 0
    for layer in range(placement.num_layers):
        key = placement.slot_device * E + placement.phy2log[layer]
        total += key.size - np.unique(key).size
    return total


@dataclass
class StaticCase:
    """What the static run keeps for the plot and the drop-in table."""

    cluster: str
    skew: str
    topology: Topology
    loads: np.ndarray
    placements: dict[str, Placement]


def run_static(workload: str, name: str, skew: str, topology: Topology, loads_LE: np.ndarray,
               num_groups: int, repeats: int, dropin: bool = True
               ) -> tuple[list[Row], StaticCase, dict | None]:
    """First placements of ``loads_LE [L, E]`` on ``topology`` by every method (the drop-in
    ``rebalance_experts`` too where EPLB applies and ``dropin``)."""
    E = loads_LE.shape[1]
    methods = [moebalance_method(topology), baseline_method(topology, E, num_groups)]
    if dropin and eplb_layout(topology) is not None:
        methods.append(dropin_method(topology, E, num_groups))
    results, times = _timed_calls(methods, loads_LE, repeats)
    placements = {m.name: m.to_placement(r) for m, r in zip(methods, results)}
    L, S = loads_LE.shape[0], topology.num_slots
    rows = []
    for m, t in zip(methods[:2], times[:2]):
        f = Figures.of(loads_LE, placements[m.name], topology)
        rows.append(Row(workload=workload, scenario=name, kind="static", skew=skew, method=m.name,
                        imbalance=f.summary, worst_layer_imbalance=f.worst,
                        balancedness=f.balancedness, moves=float(L * S), moves_pct=100.0,
                        plan_ms=statistics.median(t), plan_ms_samples=t, num_layers=L,
                        num_slots=S, num_devices=topology.num_devices))
    # the baseline's replicas with the best shares (its plan time: the shares are not timed):
    # how much of its gap is only the equal split
    summary, worst, balanced = optimal_share_figures(loads_LE, placements[methods[1].name],
                                                     topology)
    rows.append(Row(workload=workload, scenario=name, kind="static", skew=skew,
                    method=f"{methods[1].name} + optimal shares", imbalance=summary,
                    worst_layer_imbalance=worst, balancedness=balanced, moves=float(L * S),
                    moves_pct=100.0, plan_ms=rows[1].plan_ms,
                    plan_ms_samples=rows[1].plan_ms_samples, num_layers=L,
                    num_slots=S, num_devices=topology.num_devices))
    dropin = None
    if len(methods) == 3:
        base_ms, fast_ms = statistics.median(times[1]), statistics.median(times[2])
        dropin = {
            "workload": workload, "scenario": name, "skew": skew, "baseline": methods[1].name,
            "balancedness_eplb": Figures.of(loads_LE, placements[methods[1].name],
                                            topology).balancedness,
            "balancedness_dropin": Figures.of(loads_LE, placements["rebalance_experts"],
                                              topology).balancedness,
            "eplb_duplicates": _duplicates(placements[methods[1].name]),
            "dropin_duplicates": _duplicates(placements["rebalance_experts"]),
            "eplb_ms": base_ms, "dropin_ms": fast_ms,
            "speedup": base_ms / fast_ms if fast_ms > 0 else float("inf"),
        }
    return rows, StaticCase(name, skew, topology, loads_LE, placements), dropin


def run_drift(workload: str, name: str, skew: str, topology: Topology,
              sequence: Sequence[np.ndarray], num_groups: int, rel: float | None) -> list[Row]:
    """Re-plan along ``sequence`` (loads [L, E] per step; the first is the starting point).

    moebalance gets its last placement as ``previous``; "moebalance (fresh)" and the baseline
    start from scratch each time (the fresh row is the balance a re-plan is compared with). Figures
    are averaged over the re-plans (steps 1..n); moves count each re-plan's copies.
    """
    E = sequence[0].shape[1]
    methods = [moebalance_method(topology), fresh_method(topology),
               baseline_method(topology, E, num_groups)]
    first, _ = _interleaved(methods, sequence[0], [None] * len(methods), 1)
    previous = [m.to_placement(r) for m, r in zip(methods, first)]
    # warm the re-planning path too (its kernels differ from a first plan's)
    _interleaved(methods[:1], sequence[1], previous[:1], 1)
    L, S = sequence[0].shape[0], topology.num_slots
    stats = {m.name: {"figs": [], "moves": [], "ms": []} for m in methods}
    for loads_LE in sequence[1:]:
        results, times = _interleaved(methods, loads_LE, previous, 1)
        for i, (m, r) in enumerate(zip(methods, results)):
            p = m.to_placement(r)
            stats[m.name]["figs"].append(Figures.of(loads_LE, p, topology))
            stats[m.name]["moves"].append(p.moves_from(previous[i]))
            stats[m.name]["ms"].append(times[i][0])
            previous[i] = p
    rows = []
    for m in methods:
        s = stats[m.name]
        moves = float(np.mean(s["moves"]))
        rows.append(Row(workload=workload, scenario=name, kind="drift", skew=skew, method=m.name,
                        imbalance=float(np.mean([f.summary for f in s["figs"]])),
                        worst_layer_imbalance=float(max(f.worst for f in s["figs"])),
                        balancedness=float(np.mean([f.balancedness for f in s["figs"]])),
                        moves=moves, moves_pct=100.0 * moves / (L * S),
                        plan_ms=statistics.median(s["ms"]), plan_ms_samples=s["ms"],
                        num_layers=L, num_slots=S, num_devices=topology.num_devices,
                        drift=rel, replans=len(sequence) - 1))
    return rows


# -- reporting -------------------------------------------------------------------------------------


LEGEND = ("imbalance: sum over layers of the slowest device's time over the ideal time (1 is "
          "perfect; speed-aware); worst layer: the largest per-layer imbalance; balancedness: "
          "EPLB's mean/max device load, averaged over layers (blind to speed, so on unequal "
          "devices a lower figure can be the better plan); moves: expert copies to transfer "
          "(every slot for a first plan; per re-plan in drift and replay rows); plan ms: median "
          f"wall time of one call for all layers, warm, one thread; an EPLB call over "
          f"{SLOW_CALL_S} s is timed once (its first call, after a small warm-up call), its "
          f"median is that one time.")
COLUMNS = ("scenario", "skew", "method", "imbalance", "worst layer", "balancedness", "moves",
           "moves %", "plan ms")


def _scenario_label(row: Row) -> str:
    if row.kind == "static":
        return row.scenario
    if row.drift is None:
        return f"{row.scenario}, replay x{row.replans}"
    return f"{row.scenario}, drift {row.drift:.0%} x{row.replans}"


def table_cells(rows: Sequence[Row]) -> list[list[str]]:
    cells = []
    for r in rows:
        cells.append([_scenario_label(r), r.skew, r.method, f"{r.imbalance:.3f}",
                      f"{r.worst_layer_imbalance:.3f}", f"{r.balancedness:.3f}",
                      f"{r.moves:.0f}", f"{r.moves_pct:.1f}", f"{r.plan_ms:.1f}"])
    return cells


DROPIN_COLUMNS = ("scenario", "skew", "baseline", "balancedness eplb", "balancedness drop-in",
                  "duplicates eplb", "duplicates drop-in", "eplb ms", "drop-in ms", "speed-up")


def dropin_cells(dropins: Sequence[dict]) -> list[list[str]]:
    return [[d["scenario"], d["skew"], d["baseline"], f"{d['balancedness_eplb']:.4f}",
             f"{d['balancedness_dropin']:.4f}", str(d["eplb_duplicates"]),
             str(d["dropin_duplicates"]),
             f"{d['eplb_ms']:.1f}", f"{d['dropin_ms']:.2f}", f"{d['speedup']:.1f}x"]
            for d in dropins]


PER_STEP_COLUMNS = ("workload", "scenario", "method", "window mean", "per step, static shares",
                    "per step, best re-split", "steps")


def per_step_cells(items: Sequence[dict]) -> list[list[str]]:
    return [[d["workload"], d["scenario"], d["method"], f"{d['window_mean']:.4f}",
             f"{d['per_step_static']:.4f}", f"{d['per_step_resplit']:.4f}", str(d["steps"])]
            for d in items]


def machine_lines(info: dict) -> list[str]:
    return [
        f"machine: {info['cpu']}, {info['cores']} cores ({info['cores_usable']} usable), "
        f"one thread used; {info['platform']}",
        f"versions: python {info['python']}, numpy {info['numpy']}, numba {info['numba']}, "
        f"torch {info['torch']}, moebalance {info['moebalance']} (planner backend "
        f"{info['backends']['planner']})",
        f"command: {info['command']}",
        f"date: {info['timestamp']}",
    ]


def plot(cases: Sequence[StaticCase], baseline_of: dict[str, str], path: Path) -> None:
    """Per-device load/speed under the baseline and under moebalance, one layer per case.

    The layer shown is the one whose baseline imbalance is the median over layers.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(cases), 1, figsize=(13, 3.6 * len(cases)), squeeze=False)
    for ax, case in zip(axes[:, 0], cases):
        topo, w = case.topology, case.loads
        base_name = baseline_of[case.cluster]
        base, ours = case.placements[base_name], case.placements["moebalance"]
        per_layer = imbalance(w, base, topo)
        layer = int(np.argsort(per_layer)[len(per_layer) // 2])
        ideal = w[layer].sum() / topo.speed.sum()
        x = np.arange(topo.num_devices)
        before = base.device_loads(w)[layer] / topo.speed / ideal
        after = ours.device_loads(w)[layer] / topo.speed / ideal
        ax.bar(x - 0.2, before, width=0.4, color="#c9a27e", label=base_name)
        ax.bar(x + 0.2, after, width=0.4, color="#2f6f9f", label="moebalance")
        ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label="ideal")
        slow = topo.speed < topo.speed.max()
        if slow.any():
            ax.axvspan(np.flatnonzero(slow)[0] - 0.5, np.flatnonzero(slow)[-1] + 0.5,
                       color="grey", alpha=0.08, label="slower devices")
        ax.set_xlim(-0.8, topo.num_devices - 0.2)
        ax.set_ylim(0, 1.3 * max(before.max(), after.max()))  # headroom for the legend
        ax.set_xlabel("device")
        ax.set_ylabel("load / speed (1 = ideal)")
        ax.set_title(f"{case.cluster}, {case.skew} skew, layer {layer} (median baseline "
                     f"imbalance): max {before.max():.2f} {base_name}, {after.max():.2f} "
                     "moebalance")
        ax.legend(loc="upper right", fontsize=8, ncol=4)
    add_caption(fig, PLANNER_PLOT_CAPTION)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- the run ---------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``moebalance bench`` (shared by the command line and the script)."""
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true",
                      help=f"a fast run: {QUICK['num_layers']} layers, {QUICK['repeats']} repeats, "
                           f"{QUICK['drift_steps']} drift steps, every cluster")
    size.add_argument("--full", action="store_true",
                      help=f"every cluster ({len(FULL['clusters'])}), {FULL['drift_steps']} "
                           f"re-plans per drift sequence, every move budget and the EPLB drop-in "
                           f"table (several minutes; the default run: "
                           f"{', '.join(DEFAULT['clusters'])} and the trace, about a minute)")
    parser.add_argument("--repeats", type=positive_int_arg, default=None,
                        help=f"timed calls per method and case (default {DEFAULT['repeats']}, "
                             f"--quick {QUICK['repeats']}; EPLB calls over {SLOW_CALL_S} s are "
                             f"timed once)")
    parser.add_argument("--layers", type=positive_int_arg, default=None,
                        help=f"MoE layers of the synthetic model (default {DEFAULT['num_layers']}, "
                             f"--quick {QUICK['num_layers']})")
    parser.add_argument("--drift-steps", type=positive_int_arg, default=None,
                        help=f"re-plans per drift sequence (default {DEFAULT['drift_steps']}, "
                             f"--quick {QUICK['drift_steps']}, --full {FULL['drift_steps']})")
    parser.add_argument("--seed", type=nonneg_int_arg, default=0,
                        help="seed of the synthetic loads")
    parser.add_argument("--workload", choices=("synthetic", "trace", "all"), default="all",
                        help="synthetic loads, the shipped router trace, or both (default: all; "
                             "the trace is skipped with a note when none ships)")
    parser.add_argument("--trace", default="mixtral", metavar="NAME",
                        help="which shipped trace to replay (default: mixtral)")
    parser.add_argument("--window", type=positive_int_arg, default=None, metavar="T",
                        help="instead of the tables above: time plan() on a window of T per-step "
                             "counts [T, L, E] (generated DeepSeek-V3-like trace, 64 devices x 5 "
                             "slots), fresh and as a re-plan, and the per-step imbalance after "
                             "the re-split on the following T steps against the window-mean plan")
    parser.add_argument("--out", default="bench-out", metavar="DIR",
                        help="folder for results.json, summary.md and plot.png "
                             "(default: ./bench-out)")


def _set_one_thread() -> None:
    import torch

    torch.set_num_threads(1)
    if has_numba():
        import numba

        numba.set_num_threads(1)


def _progress(total: int, quiet: bool):
    from tqdm import tqdm

    # disable=None: a bar on a terminal, nothing in logs and pipes
    return tqdm(total=total, desc="bench", unit="case", file=sys.stderr,
                disable=True if quiet else None, leave=False)


def _synthetic_plan(args) -> list[tuple]:
    """(label, callable) tasks of the synthetic workload, in table order."""
    L = args.layers
    loads = {skew: workloads.synthetic_loads(skew, args.seed, num_layers=L,
                                             num_experts=MODEL["num_experts"],
                                             num_groups=MODEL["num_groups"], top_k=MODEL["top_k"],
                                             tokens=MODEL["tokens"])
             for skew in workloads.SKEWS}
    groups = MODEL["num_groups"]
    tasks = []
    budgets = BUDGETS_PCT if args.preset["budgets"] == "all" else ()
    for name in args.preset["clusters"]:
        topo = bench_cluster(name).topology()
        for skew in workloads.SKEWS:
            tasks.append(("static", lambda name=name, topo=topo, skew=skew: run_static(
                "synthetic", name, skew, topo, loads[skew], groups, args.repeats,
                args.preset["dropin"])))
    for name in args.preset["clusters"]:
        topo = bench_cluster(name).topology()
        for k, rel in enumerate(DRIFT_RELS):
            seq = [loads["moderate"]]
            for step in range(args.drift_steps):
                seq.append(workloads.drift(seq[-1], rel, seed=args.seed * 1_000 + 100 * k + step))
            tasks.append(("drift", lambda name=name, topo=topo, rel=rel, seq=seq: run_drift(
                "synthetic", name, "moderate", topo, seq, groups, rel)))
            tasks.append(("frontier", lambda name=name, topo=topo, rel=rel, seq=seq: run_frontier(
                "synthetic", name, topo, seq, rel, budgets)))
    return tasks


def _trace_plan(args, counts_TLE: np.ndarray, meta: dict) -> tuple[list[tuple], int]:
    """Tasks replaying the router trace, and the window length in steps: window means are the
    loads; consecutive windows are the re-plans of the replay."""
    steps, _, E = counts_TLE.shape
    windows = min(steps, args.drift_steps + 1)
    size = steps // windows
    seq = [counts_TLE[i * size:(i + 1) * size].mean(axis=0) for i in range(windows)]
    groups = int(meta.get("num_groups", 1)) or 1
    tasks = []
    for c in workloads.trace_clusters(E):
        topo = c.topology()
        tasks.append(("static", lambda c=c, topo=topo: run_static(
            f"trace:{args.trace}", c.name, "trace", topo, seq[0], groups, args.repeats)))
        if len(seq) > 1:  # a trace of one step has nothing to replay
            tasks.append(("drift", lambda c=c, topo=topo: run_drift(
                f"trace:{args.trace}", c.name, "trace", topo, seq, groups, None)))
            tasks.append(("frontier", lambda c=c, topo=topo: run_frontier(
                f"trace:{args.trace}", c.name, topo, seq, None,
                BUDGETS_PCT if args.preset["budgets"] == "all" else ())))
            # per step: planned for window 0's mean, met by each of its steps
            tasks.append(("per_step", lambda c=c, topo=topo: run_per_step(
                f"trace:{args.trace}", c.name, topo, counts_TLE[:size], groups)))
    return tasks, size


def run_per_step(workload: str, name: str, topology: Topology, window_TLE: np.ndarray,
                 num_groups: int = 1) -> list[dict]:
    """The per-step view (:mod:`.per_step`) of a plan for ``window_TLE``'s mean load, met by
    each of the window's steps: moebalance's plans, then the baseline's."""
    mean_LE = window_TLE.mean(axis=0)
    out = []
    for method, spread in (("moebalance (window mean)", None),
                           ("moebalance (mean + spread)", window_TLE)):
        placement = plan(mean_LE, topology, spread=spread)
        out.append({"workload": workload, "scenario": name, "method": method,
                    **per_step_figures(window_TLE, placement, topology)})
    base = baseline_method(topology, mean_LE.shape[1], num_groups)
    placement = base.to_placement(base.run(mean_LE, None)[0])
    out.append({"workload": workload, "scenario": name, "method": f"{base.name} (window mean)",
                **per_step_figures(window_TLE, placement, topology)})
    return out


WINDOW_COLUMNS = ["input", "plan", "plan ms (median)", "moves", "per-step imbalance (next T)",
                  "window-mean imbalance"]


def run_window(args, out: Path, argv: list[str]) -> int:
    """``--window T``: plan() on a window of per-step counts (see ``add_arguments``)."""
    from ...planner import resplit_device_loads
    from ..sim.cluster import load_model
    from ..sim.traces import generate_trace

    T, L, E = args.window, args.layers, MODEL["num_experts"]
    topology = Topology.uniform(64, 5, devices_per_node=8)
    model = load_model("deepseek-v3")
    tokens = 64 * model.tokens_per_device          # the simulator's trace for 64 devices
    counts = generate_trace(3 * T, num_layers=L, num_experts=E, num_groups=MODEL["num_groups"],
                            top_k=MODEL["top_k"], tokens=tokens,
                            sequences=tokens / model.sequence_length, seed=args.seed)
    first, second, later = counts[:T], counts[T:2 * T], counts[2 * T:]

    def per_step(p: Placement) -> float:
        worst = sum((resplit_device_loads(later[:, layer], p.phy2log[layer], p.share[layer],
                                          topology) / topology.speed).max(axis=1).sum()
                    for layer in range(L))
        return float(worst / (later.sum() / topology.speed.sum()))

    rows, figures = [], []
    mean_plan = plan(first.mean(axis=0), topology)
    window_plan = plan(first, topology)
    cases = [("mean [L, E]", "fresh", lambda: plan(second.mean(axis=0), topology), None),
             ("window [T, L, E]", "fresh", lambda: plan(second, topology), None),
             ("mean [L, E]", "re-plan", lambda: plan(second.mean(axis=0), topology,
                                                     previous=mean_plan), mean_plan),
             ("window [T, L, E]", "re-plan", lambda: plan(second, topology,
                                                          previous=window_plan), window_plan)]
    for label, kind, fn, previous in cases:
        fn()                                          # warm: compiled kernels, caches
        times = []
        for _ in range(args.repeats):
            placement, seconds = _timed(fn)
            times.append(seconds)
        moves = placement.moves_from(previous) if previous is not None else 0
        item = {"input": label, "plan": kind, "plan_ms": statistics.median(times) * 1e3,
                "moves": moves, "per_step_imbalance": per_step(placement),
                "mean_imbalance": summary_imbalance(second.mean(axis=0), placement, topology)}
        figures.append(item)
        rows.append([label, kind, f"{item['plan_ms']:.1f}", str(moves),
                     f"{item['per_step_imbalance']:.3f}", f"{item['mean_imbalance']:.4f}"])
    head = (f"window plans: {T} steps x {L} layers x {E} experts, 64 devices x 5 slots; planner "
            f"backend {backend('planner')}, one thread, {args.repeats} timed repeats; per-step "
            f"imbalance after the re-split on the {T} steps after the planned window")
    print(head)
    print(format_text(WINDOW_COLUMNS, rows))
    info = machine_info(argv)
    for line in machine_lines(info):
        print(line)
    (out / "results.json").write_text(json.dumps({"machine": info, "window": figures},
                                                 indent=2) + "\n", encoding="utf-8")
    (out / "summary.md").write_text("\n".join(
        ["# moebalance planner benchmark: window plans", "",
         *[f"- {x}" for x in machine_lines(info)], "", head, "",
         format_markdown(WINDOW_COLUMNS, rows)]) + "\n", encoding="utf-8")
    print(f"\nwrote {out / 'results.json'}, {out / 'summary.md'}")
    return 0


def run(args: argparse.Namespace, argv: Sequence[str] | None = None) -> int:
    """Run the benchmark described by parsed ``args``; print the table; write the files.

    ``argv`` is the command line to record (default ``sys.argv``).
    """
    preset = QUICK if args.quick else FULL if getattr(args, "full", False) else DEFAULT
    args.preset = preset
    args.repeats = args.repeats or preset["repeats"]
    args.layers = args.layers or preset["num_layers"]
    args.drift_steps = args.drift_steps or preset["drift_steps"]
    out = writable_dir(args.out, "--out")
    argv = list(sys.argv if argv is None else argv)
    if argv and Path(argv[0]).name == "__main__.py":
        argv = ["python", "-m", "moebalance", *argv[1:]]
    elif argv and Path(argv[0]).name == "moebalance":
        argv = ["moebalance", *argv[1:]]
    _set_one_thread()
    if args.window is not None:
        return run_window(args, out, argv)

    notes: list[str] = []
    tasks: list[tuple] = []
    window = None
    if args.workload in ("synthetic", "all"):
        tasks += _synthetic_plan(args)
    if args.workload in ("trace", "all"):
        try:
            counts, meta = workloads.trace_loads(args.trace)
        except FileNotFoundError as exc:
            if args.workload == "trace":
                raise UsageError(f"--workload trace: {exc}") from None
            notes.append(f"trace workload skipped: {exc}")
        else:
            trace_tasks, window = _trace_plan(args, counts, meta)
            tasks += trace_tasks
            notes.append(f"trace {args.trace!r} ({meta.get('model', 'model not recorded')}): "
                         f"{counts.shape[0]} steps x {counts.shape[1]} layers x {counts.shape[2]} "
                         f"experts; loads are means over windows of {window} steps, the replay "
                         f"re-plans on each following window")

    warm_references()
    print(f"moebalance planner benchmark: one thread (torch and numba set to 1), planner backend "
          f"{backend('planner')}; synthetic model {args.layers} layers x {MODEL['num_experts']} "
          f"experts in {MODEL['num_groups']} groups, {MODEL['tokens']} tokens x top-"
          f"{MODEL['top_k']} per step; {args.repeats} timed repeats (median), "
          f"{args.drift_steps} re-plans per drift sequence; seed {args.seed}", flush=True)
    started = time.perf_counter()
    rows: list[Row] = []
    dropins: list[dict] = []
    cases: list[StaticCase] = []
    frontier: list = []
    per_step: list[dict] = []
    with _progress(len(tasks), quiet=False) as bar:
        for kind, task in tasks:
            if kind == "static":
                new_rows, case, dropin = task()
                cases.append(case)
                if dropin is not None:
                    dropins.append(dropin)
            elif kind == "frontier":
                frontier += task()
                new_rows = []
            elif kind == "per_step":
                per_step += task()
                new_rows = []
            else:
                new_rows = task()
            rows += new_rows
            bar.update(1)
    elapsed = time.perf_counter() - started

    info = machine_info(argv)
    verdict = verdict_text(rows, frontier, per_step, VERDICT_DRIFT, args.drift_steps, window,
                           SLOW_CALL_S)
    print(f"\nVerdict: moebalance against the EPLB baseline, per cluster ({elapsed:.0f} s)")
    print(verdict)
    print("\nFull tables" + ("" if args.preset is FULL else " (--full: every cluster, more "
                                                              "re-plans, every move budget)"))
    table = format_text(COLUMNS, table_cells(rows))
    print()
    print(table)
    print(textwrap.fill(LEGEND, width=100, break_on_hyphens=False))
    print(legend_text(rows, dropins))
    if dropins:
        print("\nEPLB drop-in: moebalance.rebalance_experts vs DeepSeek EPLB, same arguments")
        print(format_text(DROPIN_COLUMNS, dropin_cells(dropins)))
    if frontier:
        print("\nMigration frontier: mean over the re-plans of each sequence, re-planned with "
              "previous= at a move budget (% of slots x layers per re-plan)")
        print(format_text(FRONTIER_COLUMNS, frontier_cells(frontier)))
    if per_step:
        print("\nPer step: a plan for one window's mean load, met by each step of that window "
              "(mean over steps)")
        print(format_text(PER_STEP_COLUMNS, per_step_cells(per_step)))
    for line in notes:
        print(f"note: {line}")
    print()
    for line in machine_lines(info):
        print(line)

    baseline_of = {r.scenario: r.method for r in rows
                   if r.kind == "static" and not r.method.startswith("moebalance")
                   and not r.method.endswith("optimal shares")}
    shown = [c for c in cases if c.cluster in PLOT_CLUSTERS and c.skew == "heavy"]
    if shown:
        plot(shown, baseline_of, out / "plot.png")
    if frontier:
        plot_frontier(frontier, out / "frontier.png")

    config = {"quick": args.quick, "repeats": args.repeats, "num_layers": args.layers,
              "drift_steps": args.drift_steps, "seed": args.seed, "workload": args.workload,
              "trace": args.trace, "model": MODEL,
              "skews": {k: asdict(v) for k, v in workloads.SKEWS.items()},
              "clusters": {c.name: c.description for c in
                           [bench_cluster(n) for n in args.preset["clusters"]]},
              "drift_rels": list(DRIFT_RELS), "wall_s": round(elapsed, 2),
              "run": "quick" if args.preset is QUICK else "full" if args.preset is FULL
              else "default", "slow_call_s": SLOW_CALL_S}
    (out / "results.json").write_text(json.dumps(
        {"machine": info, "config": config,
         "verdict": [dict(zip(VERDICT_COLUMNS, c)) for c in verdict_cells(
             rows, frontier, per_step, VERDICT_DRIFT)],
         "rows": [asdict(r) for r in rows],
         "dropin": dropins, "frontier": [asdict(p) for p in frontier], "per_step": per_step,
         "notes": notes}, indent=2) + "\n", encoding="utf-8")
    md = ["# moebalance planner benchmark", "", *[f"- {x}" for x in machine_lines(info)], "",
          "## Verdict", "", format_markdown(VERDICT_COLUMNS, verdict_cells(
              rows, frontier, per_step, VERDICT_DRIFT)), "",
          verdict_legend(VERDICT_DRIFT, args.drift_steps, window, SLOW_CALL_S), "",
          "## All figures", "",
          f"- model: {args.layers} layers x {MODEL['num_experts']} experts, "
          f"{MODEL['tokens']} tokens x top-{MODEL['top_k']} per step; skews "
          + ", ".join(f"{k} (Zipf s={v.zipf_exponent})" for k, v in workloads.SKEWS.items()),
          f"- plan ms: median of {args.repeats} warm calls, one thread (EPLB calls over "
          f"{SLOW_CALL_S} s: one call); drift rows: mean over "
          f"{args.drift_steps} re-plans (moves per re-plan), median time", "",
          format_markdown(COLUMNS, table_cells(rows)), "", LEGEND, "",
          legend_markdown(rows, dropins),
          "", *([f"plot.png: {PLANNER_PLOT_CAPTION}", ""] if shown else [])]
    if dropins:
        md += ["## EPLB drop-in", "",
               "moebalance.rebalance_experts vs DeepSeek EPLB, same arguments.",
               "", format_markdown(DROPIN_COLUMNS, dropin_cells(dropins)), ""]
    if frontier:
        md += ["## Migration frontier", "", "Re-plans with previous= at a move budget per re-plan "
               "(% of slots x layers); stale: the first placement left as it is; keep-old: no "
               "move, shares re-split; fresh: a plan from "
               "scratch each time. Bytes for a DeepSeek-V3 expert (88 MB of weights, 617 MB "
               "with an fp32 master copy and two Adam moments).", "",
               format_markdown(FRONTIER_COLUMNS, frontier_cells(frontier)), ""]
    if per_step:
        md += ["## Per step", "", "A plan for one window's mean load, met by each step of the "
               "window: imbalance with the plan's shares and with the best re-split of "
               "each step's tokens over the plan's replicas (an LP per step and layer), beside "
               "the figure for the window's mean load.", "",
               format_markdown(PER_STEP_COLUMNS, per_step_cells(per_step)), ""]
    md += [f"- note: {x}" for x in notes]
    (out / "summary.md").write_text("\n".join(md).rstrip() + "\n", encoding="utf-8")
    print(f"\nwrote {out / 'results.json'}, {out / 'summary.md'}"
          + (f", {out / 'plot.png'}" if shown else "")
          + (f", {out / 'frontier.png'}" if frontier else "") + f" ({elapsed:.1f} s)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``moebalance bench`` as a function; ``argv`` excludes the program name."""
    parser = ArgumentParser(prog="moebalance bench", description=DESCRIPTION)
    add_arguments(parser)
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    return run_guarded(lambda: run(args), prog="moebalance bench")
