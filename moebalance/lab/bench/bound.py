"""``moebalance bench bound``: the planner's placements against a floor no placement goes under.

For chosen layers of the planner benchmark's synthetic loads on one of its clusters, a
mixed-integer program over one layer (``scipy.optimize.milp``, HiGHS) finds the placement that
minimises the slowest device's time: which devices hold a replica of each expert (at most a
device's slots) and which share of the expert's tokens each replica takes. Every slot need not be
filled, so the program is a relaxation of the planner's problem and its **dual bound is a floor
no placement can go under**. On the benchmark's clusters HiGHS rarely proves optimality within
its time limit; the floor it has reached by then is still a floor, and the best placement it
found is reported beside it.

Per layer: the planner's imbalance (``plan(loads, topology)``, the benchmark's first plan), the
floor, the best placement HiGHS found, the planner's excess over the floor, HiGHS's status and
its seconds. Imbalance is the slowest device's time over the ideal (1 is perfect).

Writes ``results.json`` and ``summary.md`` under ``--out``.
Legend: E experts, G devices.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np

from ...cli.args import UsageError, run_subcommand, writable_dir
from ...metrics import imbalance
from ...planner import plan
from ...topology import Topology
from .. import workloads
from ..report import format_markdown, format_text, machine_info, markdown_header, phase

DESCRIPTION = ("A floor under any placement of a layer (a mixed-integer program, HiGHS) against "
               "the planner's imbalance, on the planner benchmark's loads and clusters.")
COLUMNS = ["layer", "planner", "floor", "best found", "planner over floor", "status", "seconds"]


@dataclass
class Bound:
    """The program's answer for one layer, in units of the ideal time (1 is perfect)."""

    floor: float           # HiGHS's dual bound: no placement does better
    best: float            # the best placement it found (inf: none within the time limit)
    optimal: bool          # the floor is proven to be the optimum
    seconds: float


def placement_floor(load_E: np.ndarray, topology: Topology, time_limit: float = 60.0) -> Bound:
    """A floor under ``max_g(load_g / speed_g) / ideal`` over every placement of one layer's
    loads ``load_E`` on ``topology``: each expert on at least one device, at most one replica of
    it per device, at most ``slots`` replicas per device, any shares.

    Variables: ``x[e, g]`` (share of expert e's tokens on device g), ``y[e, g]`` (a replica of e
    on g, binary) and ``T`` (the slowest device's time over the ideal); minimise T subject to
    ``sum_g x[e, g] = 1``, ``sum_e load_e x[e, g] <= T speed_g ideal``, ``sum_e y[e, g] <= slots_g``
    and ``x <= y``.
    """
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    load_E = np.asarray(load_E, dtype=np.float64)
    if load_E.ndim != 1 or not np.all(np.isfinite(load_E)) or np.any(load_E < 0):
        raise ValueError("load_E must be a 1-D array of finite loads >= 0, one per expert")
    speed, slots = topology.speed, topology.slots
    E, G = load_E.shape[0], topology.num_devices
    if load_E.sum() <= 0:
        return Bound(1.0, 1.0, True, 0.0)
    w_E = load_E / (load_E.sum() / speed.sum())          # loads in units of the ideal time
    n_x = E * G
    x_of = np.arange(n_x).reshape(E, G)                  # column of x[e, g]; y[e, g] is n_x later
    T = 2 * n_x
    e_idx, g_idx = np.divmod(np.arange(n_x), G)
    rows, cols, vals, lower, upper = [], [], [], [], []

    def add(r, c, v, lo, hi):          # one block of constraints: entries and row bounds
        for into, part in zip((rows, cols, vals, lower, upper), (r, c, v, lo, hi)):
            into.append(part)

    r = 0
    add(r + e_idx, x_of.ravel(), np.ones(n_x), np.ones(E), np.ones(E))           # shares sum to 1
    r += E
    add(np.r_[r + g_idx, r + np.arange(G)], np.r_[x_of.ravel(), np.full(G, T)],
        np.r_[w_E[e_idx], -speed], np.full(G, -np.inf), np.zeros(G))             # device time
    r += G
    add(r + g_idx, n_x + x_of.ravel(), np.ones(n_x), np.full(G, -np.inf),
        slots.astype(np.float64))                                                # slots
    r += G
    add(np.r_[r + np.arange(n_x), r + np.arange(n_x)], np.r_[np.arange(n_x), n_x + np.arange(n_x)],
        np.r_[np.ones(n_x), -np.ones(n_x)], np.full(n_x, -np.inf), np.zeros(n_x))  # x <= y
    r += n_x
    A = coo_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
                   shape=(r, T + 1)).tocsr()
    cost = np.zeros(T + 1)
    cost[T] = 1.0
    integrality = np.zeros(T + 1)
    integrality[n_x:T] = 1
    start = time.perf_counter()
    constraints = LinearConstraint(A, np.concatenate(lower), np.concatenate(upper))
    result = milp(cost, constraints=constraints, integrality=integrality,
                  bounds=Bounds(np.zeros(T + 1), np.r_[np.ones(T), np.inf]),
                  options={"time_limit": float(time_limit), "mip_rel_gap": 1e-4})
    seconds = time.perf_counter() - start
    best = float(result.fun) if result.x is not None else float("inf")
    floor = best if result.status == 0 else getattr(result, "mip_dual_bound", None)
    if floor is None or not np.isfinite(floor):
        floor = 1.0              # stopped before a bound: no placement beats the perfect balance
    # The program's bound can also start below 1, where the perfect balance is the floor.
    return Bound(max(float(floor), 1.0), best, result.status == 0, seconds)


# -- the command ----------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cluster", default="heterogeneous", choices=sorted(workloads.CLUSTERS),
                        help="the planner benchmark's cluster (default heterogeneous)")
    parser.add_argument("--skew", default="moderate", choices=("moderate", "heavy"),
                        help="the synthetic loads' skew (default moderate)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the loads (default 0)")
    parser.add_argument("--layers", default=None, metavar="N[,N...]",
                        help="layers to bound (default: the planner's best, median and worst)")
    parser.add_argument("--time-limit", type=float, default=60.0, metavar="S",
                        help="HiGHS's seconds per layer (default 60); the floor rises with time")
    parser.add_argument("--out", default=os.path.join("bench-out", "bound"), metavar="DIR",
                        help="folder for results.json and summary.md (default ./bench-out/bound)")


def _layers(text: str | None, imbalance_L: np.ndarray) -> list[int]:
    L = imbalance_L.shape[0]
    if text is None:
        order = np.argsort(imbalance_L, kind="stable")
        return sorted({int(order[0]), int(order[L // 2]), int(order[-1])})
    try:
        layers = [int(part) for part in text.split(",")]
    except ValueError:
        raise UsageError(f"--layers must be layer numbers separated by commas, got {text!r}") \
            from None
    bad = [layer for layer in layers if not 0 <= layer < L]
    if bad:
        raise UsageError(f"--layers {bad}: the loads have layers 0..{L - 1}")
    return layers


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    if not args.time_limit > 0:
        raise UsageError(f"--time-limit must be seconds > 0, got {args.time_limit!r}")
    out = writable_dir(args.out, "--out")
    cluster = workloads.cluster(args.cluster)
    topology = cluster.topology()
    loads_LE = workloads.synthetic_loads(args.skew, args.seed)
    planned = imbalance(loads_LE, plan(loads_LE, topology), topology)
    layers = _layers(args.layers, planned)
    print(f"moebalance bench bound: {args.cluster} ({cluster.description}); {args.skew} loads, "
          f"{loads_LE.shape[1]} experts; layers {layers}, up to {args.time_limit:g} s each",
          flush=True)
    started = time.time()
    rows, records = [], []
    for layer in layers:
        phase("bench bound", f"layer {layer}", started)
        b = placement_floor(loads_LE[layer], topology, args.time_limit)
        over = planned[layer] / b.floor - 1
        rows.append([str(layer), f"{planned[layer]:.4f}", f"{b.floor:.4f}", f"{b.best:.4f}",
                     f"{over:.2%}", "optimal" if b.optimal else "time limit", f"{b.seconds:.1f}"])
        records.append({"layer": layer, "planner": float(planned[layer]), **asdict(b)})
    table = format_text(COLUMNS, rows)
    worst = max(r["planner"] / r["floor"] - 1 for r in records)
    verdict = (f"over the {len(records)} layers bounded: planner mean "
               f"{np.mean([r['planner'] for r in records]):.4f}, floor mean "
               f"{np.mean([r['floor'] for r in records]):.4f}, the planner at most {worst:.2%} "
               f"over a layer's floor (planner mean over all {planned.shape[0]} layers "
               f"{planned.mean():.4f})")
    print(table)
    print(verdict)
    info = machine_info(argv)
    (out / "results.json").write_text(json.dumps(
        {"machine": info, "cluster": args.cluster, "skew": args.skew, "seed": args.seed,
         "time_limit_s": args.time_limit, "planner_imbalance": planned.tolist(),
         "layers": records}, indent=2) + "\n", encoding="utf-8")
    md = markdown_header("moebalance bench bound: the planner against a floor", info) + [
        f"- {args.cluster}: {cluster.description}; {args.skew} synthetic loads, seed {args.seed}",
        f"- HiGHS (scipy.optimize.milp), up to {args.time_limit:g} s per layer", "",
        format_markdown(COLUMNS, rows), "", f"- {verdict}"]
    (out / "summary.md").write_text("\n".join(md) + "\n", encoding="utf-8")
    print(f"\nwrote {out / 'results.json'}, {out / 'summary.md'}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``moebalance bench bound`` as a function; ``argv`` excludes the program name."""
    return run_subcommand("bound", DESCRIPTION, add_arguments, run, argv)
