"""``moebalance simulate``: modelled step time of every balancing policy on described clusters.

    moebalance simulate [--quick] [--cluster NAME|FILE[,...]] [--model NAME|FILE]
                        [--trace generated|mixtral|qwen3_moe|FILE] [--steps N] [--every N]
                        [--window N] [--max-moves N | --no-move-price] [--out DIR]
                        [--straggler STEP:DEVICE:FACTOR ...] [--speed-every N]
                        [--transient K [--transient-guide previous|current|both]]

For every cluster: a trace (generated at the model's shape and the cluster's batch, or a recorded
one), the five policies of :func:`~.policies.default_policies`, and per policy the modelled
tokens per second, mean and p99 step time, mean imbalance, moves and bytes per re-plan, time to
plan and the mean of every step-time term. Writes ``results.json``, ``summary.md`` and plots
(imbalance over steps, step time over steps and its terms, per-device load of one layer) under
``--out``.

A cluster whose device speeds change (``--straggler``, or ``speed_changes`` in a cluster file)
gets a sixth row: moebalance with the re-split and speed tracking (a
:class:`moebalance.SpeedTracker` exchanging speeds every ``--speed-every`` steps); the other
policies keep planning for the nominal speeds.

With ``--transient K`` (K > 0) one more row per guide: moebalance with the re-split and K
transient slots per device, each step's hot experts' weights copied for that step to cold devices
(:mod:`.transient`), chosen on the previous step's counts (made ahead) and/or on the step's own
(on the critical path); the ``transient (s)`` column is the copies' exposed seconds per step.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Sequence

import numpy as np

from ...cli.args import UsageError, nonneg_int_arg, positive_int_arg, run_guarded, writable_dir
from .cluster import CLUSTER_PRESETS, MODELS, ClusterSpec, cluster_preset, load_cluster, load_model

DESCRIPTION = ("Replay a router trace on described clusters and model each balancing policy's "
               "step time: static, EPLB-style periodic re-planning, moebalance periodic (with "
               "and without the per-step re-split), and the bound.")

FULL = dict(steps=1000, every=100)
QUICK = dict(steps=200, every=50)
DEFAULT_CLUSTER = "h100-a100-64"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK['steps']} steps, a re-plan every {QUICK['every']} (well "
                             f"under 30 s once the planner's kernels are compiled)")
    parser.add_argument("--cluster", default=DEFAULT_CLUSTER, metavar="NAME|FILE[,...]",
                        help=f"hardware cluster preset(s) (GPU kinds, nodes, links) or "
                             f".json/.toml file(s), comma separated (default {DEFAULT_CLUSTER}; "
                             f"presets: {', '.join(CLUSTER_PRESETS)}). Not the slot layouts "
                             f"that 'moebalance plan --cluster' takes")
    parser.add_argument("--model", default="deepseek-v3", metavar="NAME|FILE",
                        help=f"model shape: {', '.join(MODELS)} or a .json/.toml file of "
                             f"ModelShape fields (default deepseek-v3)")
    parser.add_argument("--trace", default="generated", metavar="generated|NAME|FILE",
                        help="router counts [steps, layers, experts]: 'generated' (fitted to the "
                             "shipped traces, at the model's shape), a shipped trace (mixtral, "
                             "qwen3_moe) or a .npz/.npy file (default generated)")
    parser.add_argument("--steps", type=positive_int_arg, metavar="N",
                        help=f"simulated steps after the history window (default {FULL['steps']}; "
                             f"a recorded trace: what it holds)")
    parser.add_argument("--every", type=positive_int_arg, metavar="N",
                        help=f"steps between re-plans (default {FULL['every']})")
    parser.add_argument("--window", type=positive_int_arg, metavar="N",
                        help="steps of history a re-plan averages (default: --every)")
    parser.add_argument("--max-moves", type=nonneg_int_arg, metavar="N",
                        help="cap moebalance's moves per re-plan at N")
    parser.add_argument("--move-price", action="store_true",
                        help="price moebalance's moves: a move is made only when the step time "
                             "it saves until the next re-plan exceeds its transfer over the "
                             "slowest network link (default: no price; live moves hide behind "
                             "the step, and a layer moves only when it is off its fresh-plan "
                             "balance)")
    parser.add_argument("--skew", default="moderate", choices=("moderate", "heavy"),
                        help="base popularity of the generated trace (default moderate)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated trace")
    parser.add_argument("--layer", type=nonneg_int_arg, metavar="N",
                        help="layer of the per-device load plot (default: the most skewed)")
    parser.add_argument("--straggler", action="append", default=[], type=_straggler_arg,
                        metavar="STEP:DEVICE:FACTOR",
                        help="from trace step STEP on (the history window counts: the first "
                             "simulated step is --window), device DEVICE runs at FACTOR of its "
                             "throughput (e.g. 150:3:0.5); repeatable, applied to every cluster")
    parser.add_argument("--speed-every", type=positive_int_arg, default=10, metavar="N",
                        help="steps between the speed-tracking row's speed exchanges "
                             "(default 10)")
    parser.add_argument("--transient", type=nonneg_int_arg, default=0, metavar="K",
                        help="add moebalance + re-split rows with K transient slots per device "
                             "(a hot expert's weights copied to a cold device for one step; "
                             "default 0: no such rows)")
    parser.add_argument("--transient-guide", default="both",
                        choices=("previous", "current", "both"),
                        help="counts the transient copies are chosen on: the previous step's "
                             "(copies made ahead), the step's own (copies on the critical "
                             "path) or one row each (default both)")
    parser.add_argument("--no-plots", action="store_true", help="skip the plots")
    parser.add_argument("--out", default=os.path.join("bench-out", "simulate"), metavar="DIR",
                        help="folder for results.json, summary.md and plots "
                             "(default ./bench-out/simulate)")


def _straggler_arg(text: str) -> tuple[int, int, float]:
    parts = text.split(":")
    try:
        step, device, factor = int(parts[0]), int(parts[1]), float(parts[2])
        if len(parts) != 3:
            raise ValueError
    except (ValueError, IndexError):
        raise argparse.ArgumentTypeError(f"expected STEP:DEVICE:FACTOR (e.g. 150:3:0.5), got "
                                         f"{text!r}") from None
    return step, device, factor


def _clusters(spec: str, stragglers=()) -> list[ClusterSpec]:
    from .. import workloads

    out = []
    for item in [s.strip() for s in spec.split(",") if s.strip()]:
        if item in workloads.CLUSTERS:
            raise UsageError(f"--cluster {item!r} is a slot layout of 'moebalance plan' and "
                             f"'bench' (no hardware described); simulate takes hardware presets: "
                             f"{', '.join(CLUSTER_PRESETS)}, or a .json/.toml file")
        try:
            cluster = (load_cluster(item) if item.endswith((".json", ".toml"))
                       else cluster_preset(item))
        except ValueError as err:
            raise UsageError(f"--cluster: {err}") from None
        try:
            out.append(cluster.with_speed_changes(stragglers) if stragglers else cluster)
        except ValueError as err:
            raise UsageError(f"--straggler: {err}") from None
    if not out:
        raise UsageError("--cluster needs at least one preset name or file")
    return out


def _step_model(cluster: ClusterSpec, model):
    from .stepmodel import StepModel

    try:
        return StepModel(cluster, model)
    except ValueError as err:
        raise UsageError(f"--cluster {cluster.name}: {err}") from None


def _check_transient(transient: int, cluster: ClusterSpec, model) -> None:
    """UsageError unless ``transient`` slots per device fit beside the expert slots."""
    if transient:
        try:
            cluster.check_transient(model, transient)
        except ValueError as err:
            raise UsageError(f"--transient: {err}") from None


def _trace_for(args, cluster: ClusterSpec, model, steps: int, warmup: int):
    """(counts [T, L, E], model for its shape, description)."""
    from .traces import generate_trace, read_trace

    if args.trace == "generated":
        tokens = cluster.num_devices * model.tokens_per_device
        counts = generate_trace(steps + warmup, num_layers=model.num_layers,
                                num_experts=model.num_experts, num_groups=model.num_groups,
                                top_k=model.top_k, tokens=tokens, skew=args.skew,
                                sequences=tokens / model.sequence_length, seed=args.seed)
        return counts, model, (f"generated ({args.skew} skew, seed {args.seed}, dynamics fitted "
                               f"to the shipped traces, {tokens / model.sequence_length:.0f} "
                               f"sequences a step)")
    try:
        counts, what = read_trace(args.trace)
    except ValueError as err:
        raise UsageError(f"--trace: {err}") from None
    if counts.shape[0] <= warmup:
        raise UsageError(f"--trace {args.trace!r} holds {counts.shape[0]} steps, not more than the "
                         f"{warmup} steps of history a re-plan needs: lower --window/--every")
    if args.steps is not None:
        counts = counts[:warmup + args.steps]
    try:
        shaped = model.with_trace_shape(counts.shape[1], counts.shape[2])
    except ValueError as err:
        raise UsageError(f"--trace {args.trace!r} ({counts.shape[1]} layers x {counts.shape[2]} "
                         f"experts) does not suit --model {model.name}: {err}") from None
    top_k = _recorded_top_k(args.trace)
    if top_k is not None and top_k <= shaped.num_experts:
        shaped = replace(shaped, top_k=top_k)
        what += f"; top-{top_k} as recorded"
    else:
        what += f"; top-{shaped.top_k} from --model {model.name} (the trace does not record it)"
    return counts, shaped, what


def _recorded_top_k(trace: str) -> int | None:
    """The router's top-k a shipped trace records in its meta, else None (trace files)."""
    from ..workloads import trace_loads
    from .traces import trace_names

    if trace not in trace_names():
        return None
    meta = trace_loads(trace)[1]
    k = meta.get("top_k", meta.get("config", {}).get("num_experts_per_tok"))
    return int(k) if k else None


def _check_replans(simulated: int, window: int, every: int) -> None:
    """UsageError when ``simulated`` steps after ``window`` steps of history hold no re-plan."""
    if replans_in(simulated, window, every) == 0:
        raise UsageError(
            f"the trace gives {simulated} steps after the {window} steps of history, too few "
            f"for a re-plan every {every} steps (the first at step "
            f"{(window // every + 1) * every}): every policy would keep its first placement. "
            f"Lower --every (and --window), or give more --steps")


def replans_in(steps: int, warmup: int, every: int) -> int:
    """Re-plans a periodic policy makes over ``steps`` simulated steps after ``warmup`` steps of
    history (at every step index t > warmup with t % every == 0, as policies.Periodic does)."""
    first = (warmup // every + 1) * every
    return len(range(first, warmup + steps, every))


COLUMNS = ["policy", "tokens/s", "vs EPLB", "mean step (s)", "p99 step (s)", "imbalance",
           "re-plans", "moves/re-plan", "GB/re-plan", "plan (ms)", "experts (s)",
           "all-to-all (s)", "rest (s)", "migration (s)", "copies/step", "transient (s)"]


def _cells(summaries: list[dict]) -> list[list[str]]:
    eplb = next((s for s in summaries if s["policy"].startswith("EPLB")), None)
    rows = []
    for s in summaries:
        ratio = s["tokens_per_s"] / eplb["tokens_per_s"] if eplb else float("nan")
        rows.append([s["policy"], f"{s['tokens_per_s']:,.0f}", f"{ratio:.2f}x",
                     f"{s['mean_step_s']:.3f}", f"{s['p99_step_s']:.3f}",
                     f"{s['mean_imbalance']:.3f}", str(s["replans"]),
                     f"{s['moves_per_replan']:.0f}", f"{s['bytes_per_replan'] / 1e9:.1f}",
                     f"{s['plan_s'] * 1e3:.0f}", f"{s['mean_expert_compute_s']:.3f}",
                     f"{s['mean_all_to_all_s']:.3f}", f"{s['mean_non_moe_s']:.3f}",
                     f"{s['mean_migration_s']:.4f}", f"{s['copies_per_step']:.0f}",
                     f"{s['mean_transient_s']:.4f}"])
    return rows


def _plot(sim, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = np.arange(sim.first_step, sim.first_step + sim.runs[0].step_seconds.size)
    fig, axes = plt.subplots(2, 2, figsize=(14, 9))
    ax = axes[0, 0]
    for run in sim.runs:
        ax.plot(steps, run.imbalance, label=run.name, lw=0.9)
    ax.set(xlabel="step", ylabel="imbalance (hottest / balanced)", title="imbalance over steps")
    ax.legend(fontsize=7)
    ax = axes[0, 1]
    for run in sim.runs:
        ax.plot(steps, run.step_seconds, label=run.name, lw=0.9)
    ax.set(xlabel="step", ylabel="seconds", title="modelled step time")
    ax = axes[1, 0]
    bottom = np.zeros(len(sim.runs))
    for term in ("expert_compute", "all_to_all", "non_moe", "migration", "transient"):
        values = np.array([run.terms[term].mean() for run in sim.runs])
        ax.bar(range(len(sim.runs)), values, bottom=bottom, label=term.replace("_", " "))
        bottom += values
    ax.set_xticks(range(len(sim.runs)), [r.name for r in sim.runs], rotation=20, ha="right",
                  fontsize=7)
    ax.set(ylabel="seconds per step (mean)", title="step time by term")
    ax.legend(fontsize=7)
    ax = axes[1, 1]
    speed = sim.topology.speed
    G = speed.size
    for run in sim.runs:
        balanced = run.layer_loads.sum() * speed / speed.sum()
        ax.step(np.arange(G), run.layer_loads / np.maximum(balanced, 1e-300), where="mid",
                lw=0.9, label=run.name)
    ax.axhline(1.0, color="k", lw=0.6)
    ax.set(xlabel="device", ylabel="load / its speed's share",
           title=f"per-device load, layer {sim.shown_layer} (mean over steps)")
    fig.suptitle(f"{sim.cluster.name}: {sim.cluster.description}; {sim.model.name}; {sim.trace}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from tqdm import tqdm

    from ..report import format_markdown, format_text, machine_info, markdown_header
    from .policies import default_policies
    from .run import move_price, simulate

    out = writable_dir(args.out, "--out")
    clusters = _clusters(args.cluster, args.straggler)
    try:
        base_model = load_model(args.model)
    except ValueError as err:
        raise UsageError(f"--model: {err}") from None
    preset = QUICK if args.quick else FULL
    every = args.every or preset["every"]
    window = args.window or every
    steps = args.steps or preset["steps"]
    info = machine_info(argv)
    results, md = [], markdown_header("moebalance simulate", info)
    for cluster in clusters:
        started = time.perf_counter()
        if args.trace == "generated":        # a model that does not fit fails before any work
            _step_model(cluster, base_model)
            _check_replans(steps, window, every)
            _check_transient(args.transient, cluster, base_model)
        counts, model, what = _trace_for(args, cluster, base_model, steps, window)
        step_model = _step_model(cluster, model)
        price = move_price(step_model, every, model.num_layers) if args.move_price else None
        speeds = None
        if cluster.speed_changes:
            from ...speeds import SpeedTracker

            # a 5% move of some device's relative speed re-plans: steady speeds never do
            speeds = SpeedTracker(args.speed_every, min_change=0.05)
        _check_transient(args.transient, cluster, model)
        guides = ("previous", "current") if args.transient_guide == "both" else (
            args.transient_guide,)
        policies = default_policies(every, window, price, args.max_moves, speeds,
                                    transient=args.transient, guides=guides)
        simulated = counts.shape[0] - window
        _check_replans(simulated, window, every)
        if args.layer is not None and args.layer >= model.num_layers:
            raise UsageError(f"--layer {args.layer}: the model has {model.num_layers} layers "
                             f"(0..{model.num_layers - 1})")
        late = [c for c in cluster.speed_changes if c[0] >= counts.shape[0]]
        if late:
            raise UsageError(f"--straggler/speed_changes: step(s) {[c[0] for c in late]} fall "
                             f"after the trace's last step {counts.shape[0] - 1}")
        with tqdm(total=simulated * len(policies), desc=cluster.name, unit="step",
                  leave=False) as bar:
            sim = simulate(counts, cluster, model, policies, warmup=window,
                           shown_layer=args.layer, progress=bar.update, trace=what)
        elapsed = time.perf_counter() - started
        summaries = sim.summaries()
        topology = sim.topology
        head = (f"{cluster.name}: {cluster.description}; {model.name} ({model.num_layers} x "
                f"{model.num_experts}, top-{model.top_k}), {topology.num_slots} slots "
                f"({', '.join(sorted({str(s) for s in topology.slots}))} per device); trace "
                f"{what}; {simulated} steps, re-plan every {every} from {window} steps; "
                + "".join(f"device {d} at {f:g}x from step {t}; "
                          for t, d, f in cluster.speed_changes)
                + f"{elapsed:.1f} s")
        print(head)
        print(format_text(COLUMNS, _cells(summaries)))
        print()
        md += [f"## {cluster.name}", "", head, "", format_markdown(COLUMNS, _cells(summaries)), ""]
        plot = None
        if not args.no_plots:
            plot = out / f"simulate-{cluster.name}.png"
            _plot(sim, plot)
            md += [f"![{cluster.name}]({plot.name})", ""]
        results.append({
            "cluster": cluster.to_dict(), "model": model.__dict__, "trace": what,
            "steps": simulated, "every": every, "window": window, "seconds": elapsed,
            "shown_layer": sim.shown_layer, "summaries": summaries,
            "runs": [{"policy": r.name, "replans": r.replans,
                      "step_seconds": r.step_seconds.round(6).tolist(),
                      "imbalance": r.imbalance.round(5).tolist(),
                      "copies": r.copies.tolist(),
                      "layer_loads": r.layer_loads.tolist()} for r in sim.runs],
            "plot": plot.name if plot else None})
    md += ["Step model: moebalance/lab/sim/stepmodel.py (formulas in its docstring); "
           "policies: moebalance/lab/sim/policies.py."]
    (out / "results.json").write_text(json.dumps({"machine": info, "results": results}) + "\n",
                                      encoding="utf-8")
    (out / "summary.md").write_text("\n".join(md) + "\n", encoding="utf-8")
    print(f"wrote {out / 'results.json'}, {out / 'summary.md'}"
          + ("" if args.no_plots else " and plots"))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``moebalance simulate`` as a function; ``argv`` excludes the program name."""
    import sys

    from ...cli.args import ArgumentParser

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = ArgumentParser(prog="moebalance simulate", description=DESCRIPTION)
    add_arguments(parser)
    args = parser.parse_args(argv)
    return run_guarded(lambda: run(args, ["moebalance", "simulate", *argv]),
                       prog="moebalance simulate")
