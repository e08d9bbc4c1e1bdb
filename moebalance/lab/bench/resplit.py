"""Per-step re-split benchmark: this step's shares over the existing replicas, on real traces.

For every router trace shipped with the package and for a homogeneous and a heterogeneous
cluster sized for its experts (:func:`moebalance.lab.workloads.trace_clusters`): the trace is cut
into windows; a placement is planned on each window's per-step counts (``plan(window_TLE,
previous=...)``, as the Rebalancer does) and scored on every step of the *following* window,
on that step's own counts. Per step, three figures over the same replicas:

- **static**: the placement's shares;
- **re-split**: :func:`moebalance.dispatch.shares.resplit_shares` from that step's counts
  (the Dispatcher's default, ``resplit=True``), ``--sweeps`` water-filling sweeps then the
  exact flow, by the backend :func:`moebalance.backends` reports for the CPU;
- **LP optimum**: the best any re-split over those replicas can do, one linear program per layer
  (:func:`moebalance.dispatch.shares.optimal_max_time`).

Each is the step's imbalance ``sum_l max_g(load/speed) / sum_l ideal`` (DESIGN.md section 2);
the table reports their means over all scored steps, the re-split's gap to the LP, the window
mean's own imbalance (what the planner sees), and the re-split's time per layer.

A second table times each form of the re-split at DeepSeek-V3's size (E = 256 experts, 64
devices with 8 slots each) on a generated trace: placements planned on a window's mean, scored
on the next window's steps: microseconds per layer (wall and CPU time of the calling thread,
one thread; the fastest of a few runs of each call, median over calls) and the largest and
mean gap to the per-step LP optimum, in units of the ideal time.

Legend: L layers, E experts, S slots, G devices.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np

from ...backends import backend
from ...cli.args import UsageError, positive_int_arg, run_subcommand, writable_dir
from ...metrics import summary_imbalance
from ...placement import Placement
from ...planner import plan
from .. import workloads
from ..report import format_markdown, format_text, machine_info, phase

DESCRIPTION = ("Per-step re-split benchmark: placement shares vs per-step re-split vs the per-step "
               "LP optimum over the same replicas, on the shipped router traces, homogeneous and "
               "heterogeneous clusters.")
FULL = {"window": 20, "windows": 0}
QUICK = {"window": 20, "windows": 4}
COLUMNS = ["trace", "cluster", "steps", "window mean", "static", "re-split", "LP optimum",
           "re-split - LP", "us/layer"]
KERNEL_COLUMNS = ["cluster", "form", "layer calls", "us/layer wall", "us/layer cpu",
                  "max gap to LP", "mean gap to LP"]
# The kernel timing case: DeepSeek-V3's experts on 64 devices with 8 slots each.
KERNEL_CASE = {"experts": 256, "devices": 64, "slots": 8, "layers": 4, "window": 20}
# Each layer call is timed this many times and the fastest kept (the machine may be shared).
KERNEL_REPEATS = 5


@dataclass
class Row:
    trace: str
    cluster: str
    steps: int
    window_mean: float
    static: float
    resplit: float
    optimum: float
    resplit_us_per_layer: float

    @property
    def gap(self) -> float:
        return self.resplit - self.optimum


def _step_figures(w_LE: np.ndarray, placement, topology, tables, plans, sweeps: int):
    """(static, re-split, LP optimum) imbalance of one step's loads, and seconds spent in
    the re-split."""
    import torch

    from ...dispatch.shares import optimal_max_time, resplit_shares

    L = w_LE.shape[0]
    ideal = w_LE.sum(axis=1) / topology.speed.sum()
    if ideal.sum() <= 0:
        return 1.0, 1.0, 1.0, 0.0
    static = summary_imbalance(w_LE, placement, topology)
    share = placement.share.copy()
    seconds = 0.0
    for layer in range(L):
        table = tables[layer]
        w = torch.from_numpy(w_LE[layer])
        start = time.perf_counter()
        share_EX = resplit_shares(w, table.share_EX, plans[layer], sweeps=sweeps)
        seconds += time.perf_counter() - start
        valid = table.valid_EX.numpy()
        share[layer, table.slots_EX.numpy()[valid]] = share_EX.numpy()[valid]
    resplit_placement = Placement(placement.phy2log, share, placement.slot_device,
                                  placement.num_experts)
    resplit = summary_imbalance(w_LE, resplit_placement, topology)
    best = sum(optimal_max_time(w_LE[layer], placement.phy2log[layer], placement.slot_device,
                                topology.speed) for layer in range(L))
    return static, resplit, best / ideal.sum(), seconds


def run_trace(name: str, counts_TLE: np.ndarray, window: int, max_windows: int,
              sweeps: int) -> list[Row]:
    """Rows of one trace: both clusters, every scored window."""
    from ...dispatch.routing import replica_table
    from ...dispatch.shares import resplit_plan

    steps, L, E = counts_TLE.shape
    count = steps // window
    if max_windows:
        count = min(count, max_windows)
    if count < 2:
        raise UsageError(f"--window {window}: trace {name!r} has {steps} steps, fewer than two "
                         f"windows; choose a smaller window")
    rows = []
    for c in workloads.trace_clusters(E):
        topo = c.topology()
        previous = None
        figures, means, seconds, layer_calls = [], [], 0.0, 0
        for i in range(count - 1):
            window_TLE = counts_TLE[i * window:(i + 1) * window]
            mean_LE = window_TLE.mean(axis=0)
            # the Rebalancer's call: the window's per-step counts, planned for the steps
            placement = plan(window_TLE, topo, previous=previous)
            previous = placement
            means.append(summary_imbalance(mean_LE, placement, topo))
            tables = [replica_table(placement, layer) for layer in range(L)]
            plans = [resplit_plan(t, topo.speed) for t in tables]
            for step in range((i + 1) * window, (i + 2) * window):
                static, resplit, best, spent = _step_figures(counts_TLE[step], placement, topo,
                                                             tables, plans, sweeps)
                figures.append((static, resplit, best))
                seconds += spent
                layer_calls += L
        f = np.asarray(figures)
        rows.append(Row(name, c.name, f.shape[0], float(np.mean(means)), float(f[:, 0].mean()),
                        float(f[:, 1].mean()), float(f[:, 2].mean()),
                        seconds / max(layer_calls, 1) * 1e6))
    return rows


@dataclass
class KernelRow:
    cluster: str
    form: str
    layer_calls: int
    us_wall: float
    us_cpu: float
    max_gap: float
    mean_gap: float


def kernel_rows(quick: bool, sweeps: int) -> list[KernelRow]:
    """Each form of the re-split timed at :data:`KERNEL_CASE` on a generated trace."""
    import torch

    from ...dispatch.routing import replica_table
    from ...dispatch.shares import (
        RESPLIT_TORCH_SWEEPS,
        optimal_max_time,
        resplit_plan,
        resplit_shares_torch,
    )
    from ...planner import _jit
    from ...topology import Topology
    from ..sim.traces import generate_trace

    c = KERNEL_CASE
    window, G, E = c["window"], c["devices"], c["experts"]
    steps = 2 * window if quick else 3 * window
    counts = generate_trace(steps, num_layers=c["layers"], num_experts=E, seed=0)
    clusters = {
        f"uniform-{G}x{c['slots']}": Topology.uniform(num_devices=G, slots_per_device=c["slots"],
                                                      devices_per_node=8),
        f"half-speed-{G}x{c['slots']}": Topology.from_arrays(
            speed=[1.0] * (G // 2) + [0.5] * (G - G // 2), slots=[c["slots"]] * G,
            node=[g // 8 for g in range(G)]),
    }
    k = _jit.kernels("numba")

    def numba_form(w, table, plan, exact, n):
        share = table.share_EX.numpy().copy()
        load = np.empty(G)
        k.resplit_layer(w, plan.device_EX.numpy(), plan.speed_G.numpy(), plan.order_V.numpy(),
                        share, load, n, exact)
        return load

    def torch_form(w, table, plan, exact, n):
        share = resplit_shares_torch(torch.from_numpy(w), table.share_EX, plan, sweeps=n)
        return (plan.holds_GEX * (torch.from_numpy(w)[:, None] * share)[None]).sum(dim=(1, 2)
                                                                                   ).numpy()

    forms = [(f"numba: {sweeps} sweeps + exact flow (default)", numba_form, True, sweeps),
             ("numba: 16 sweeps, no flow", numba_form, False, 16),
             (f"torch: {RESPLIT_TORCH_SWEEPS} sweeps", torch_form, False, RESPLIT_TORCH_SWEEPS)]
    rows = []
    for name, topo in clusters.items():
        figures = {f[0]: ([], [], []) for f in forms}
        for i in range(steps // window - 1):
            mean_LE = counts[i * window:(i + 1) * window].mean(axis=0)
            placement = plan(mean_LE, topo)
            tables = [replica_table(placement, layer) for layer in range(c["layers"])]
            plans = [resplit_plan(t, topo.speed) for t in tables]
            for step in range((i + 1) * window, (i + 2) * window):
                for layer in range(c["layers"]):
                    w = counts[step, layer]
                    ideal = w.sum() / topo.speed.sum()
                    best = optimal_max_time(w, placement.phy2log[layer], placement.slot_device,
                                            topo.speed)
                    for form, fn, exact, n in forms:
                        fn(w, tables[layer], plans[layer], exact, n)  # warm (JIT, caches)
                        wall, cpu = np.inf, np.inf
                        for _ in range(KERNEL_REPEATS):
                            w0, c0 = time.perf_counter(), time.thread_time()
                            load = fn(w, tables[layer], plans[layer], exact, n)
                            cpu = min(cpu, time.thread_time() - c0)
                            wall = min(wall, time.perf_counter() - w0)
                        walls, cpus, gaps = figures[form]
                        walls.append(wall)
                        cpus.append(cpu)
                        gaps.append((np.max(load / topo.speed) - best) / ideal)
        for form, _, _, _ in forms:
            walls, cpus, gaps = figures[form]
            rows.append(KernelRow(name, form, len(walls), float(np.median(walls) * 1e6),
                                  float(np.median(cpus) * 1e6), float(np.max(gaps)),
                                  float(np.mean(gaps))))
    return rows


def _kernel_cells(rows: Sequence[KernelRow]) -> list[list[str]]:
    return [[r.cluster, r.form, str(r.layer_calls), f"{r.us_wall:.0f}", f"{r.us_cpu:.0f}",
             f"{r.max_gap:+.5f}", f"{r.mean_gap:+.5f}"] for r in rows]


def _warm_resplit() -> None:
    """One re-split call, so that no timed call pays for compiling (or loading) the kernel."""
    import torch

    from ...dispatch.routing import replica_table
    from ...dispatch.shares import resplit_plan, resplit_shares
    from ...topology import Topology

    table = replica_table(plan(np.ones((1, 3)), Topology.uniform(2, 2)), 0)
    resplit_shares(torch.ones(3), table.share_EX, resplit_plan(table, [1.0, 1.0]))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help=f"score only the first {QUICK['windows']} windows of each trace")
    parser.add_argument("--traces", default=None,
                        help="comma-separated shipped traces (default: every one shipped)")
    parser.add_argument("--window", type=positive_int_arg, default=None,
                        help=f"steps per planning window (default {FULL['window']})")
    parser.add_argument("--sweeps", type=positive_int_arg, default=None,
                        help="water-filling sweeps before the exact flow (default: the "
                             "Dispatcher's RESPLIT_SWEEPS)")
    parser.add_argument("--out", default=os.path.join("bench-out", "resplit"), metavar="DIR",
                        help="folder for results.json and summary.md (default ./bench-out/resplit)")


def _cells(rows: Sequence[Row]) -> list[list[str]]:
    return [[r.trace, r.cluster, str(r.steps), f"{r.window_mean:.4f}", f"{r.static:.4f}",
             f"{r.resplit:.4f}", f"{r.optimum:.4f}", f"{r.gap:+.4f}",
             f"{r.resplit_us_per_layer:.0f}"] for r in rows]


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    import torch

    from ...dispatch.shares import RESPLIT_SWEEPS

    preset = QUICK if args.quick else FULL
    window = args.window or preset["window"]
    sweeps = args.sweeps or RESPLIT_SWEEPS
    names = (workloads.trace_names() if args.traces is None
             else [t.strip() for t in args.traces.split(",") if t.strip()])
    unknown = sorted(set(names) - set(workloads.trace_names()))
    if unknown or not names:
        raise UsageError(f"--traces: unknown {unknown or names}; shipped: "
                         f"{','.join(workloads.trace_names())}")
    torch.set_num_threads(1)
    _warm_resplit()
    print(f"moebalance re-split benchmark: traces {names}, window {window} steps, "
          f"{sweeps} sweeps", flush=True)
    started = time.perf_counter()
    rows, models = [], {}
    t0 = time.time()
    for name in names:
        phase("moebalance bench resplit", f"trace {name}", t0)
        counts, meta = workloads.trace_loads(name)
        models[name] = meta.get("model", "model not recorded")
        rows += run_trace(name, counts, window, preset["windows"], sweeps)
    kernels = kernel_rows(args.quick, sweeps)
    elapsed = time.perf_counter() - started
    notes = ["placement planned on each window's per-step counts (plan(window, previous=...)), "
             "scored on "
             "every step of the next window; imbalance = sum_l max_g(load/speed) / sum_l ideal "
             "per step, mean over steps; window mean: the placement on the window's mean "
             "(plans are for its recent level when the loads moved within it); us/layer: one "
             "resplit_shares call (backend "
             f"{backend('resplit', 'cpu')}), one thread",
             f"kernel timing: {KERNEL_CASE['layers']} layers of a generated DeepSeek-V3-shape "
             f"trace (seed 0), planned on each {KERNEL_CASE['window']}-step window's mean, "
             "scored on the next window; us/layer: median over layer calls of the fastest of "
             f"{KERNEL_REPEATS} warm runs; gap: "
             "(slowest time - LP optimum) / ideal time"] + [
                 f"trace {n}: {m}" for n, m in models.items()]
    table = format_text(COLUMNS, _cells(rows))
    print()
    print(table)
    print()
    print(format_text(KERNEL_COLUMNS, _kernel_cells(kernels)))
    for line in notes:
        print(f"note: {line}")
    info = machine_info(argv)
    out = writable_dir(args.out, "--out")
    config = {"quick": args.quick, "traces": names, "window": window, "sweeps": sweeps,
              "wall_s": round(elapsed, 2)}
    (out / "results.json").write_text(json.dumps(
        {"machine": info, "config": config,
         "rows": [dict(asdict(r), gap=r.gap) for r in rows],
         "kernel_rows": [asdict(r) for r in kernels], "notes": notes},
        indent=2) + "\n", encoding="utf-8")
    md = ["# moebalance per-step re-split benchmark", "",
          f"- machine: {info['cpu']}, {info['cores']} cores",
          f"- versions: python {info['python']}, torch {info['torch']}, "
          f"moebalance {info['moebalance']}",
          f"- command: {info['command']}", f"- date: {info['timestamp']}", "",
          format_markdown(COLUMNS, _cells(rows)), "",
          format_markdown(KERNEL_COLUMNS, _kernel_cells(kernels)), ""] + [
              f"- note: {x}" for x in notes]
    (out / "summary.md").write_text("\n".join(md).rstrip() + "\n", encoding="utf-8")
    print(f"\nwrote {out / 'results.json'}, {out / 'summary.md'} ({elapsed:.1f} s)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``moebalance bench resplit`` as a function; ``argv`` excludes the program name."""
    return run_subcommand("resplit", DESCRIPTION, add_arguments, run, argv)
