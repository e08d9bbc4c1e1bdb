"""The ``moebalance`` command: bench, plan, inspect and simulate; alone, it prints its help.

    moebalance bench [--quick] [--out DIR] ...        planner benchmark vs EPLB
    moebalance bench dispatch ...                     dispatch benchmark
    moebalance bench train ...                        live-migration cost in training (4 gloo ranks)
    moebalance bench resplit ...                      per-step re-split benchmark
    moebalance bench wrap ...                         a wrapped transformers model vs one process
    moebalance bench simcheck ...                     the simulator's step model against training
    moebalance bench pretrained ...                   peak memory of mb.from_pretrained per rank
    moebalance bench faults ...                       one rank's error on every rank (4 gloo ranks)
    moebalance bench straggler ...                    measured speeds, a slowed rank (4 gloo ranks)
    moebalance bench bound ...                        the planner against a floor (HiGHS)
    moebalance plan LOADS (--devices N --slots K | --topology FILE | --cluster NAME) [--out FILE]
                    [--previous FILE [--max-moves N]] [--force]
    moebalance inspect PLACEMENT [--layout [--layer N]] [--loads LOADS] [--topology FILE | ...]
    moebalance simulate [--quick] [--cluster NAME|FILE] [--trace ...]  modelled step time per policy

Options given without a command (``moebalance --quick``) go to ``bench``.

Mistakes in what the user typed or pointed at (bad flags, unreadable files, loads that do not fit
the topology) print one line, ``moebalance <command>: error: ...``, and exit with status 2.
The parser, argument types and file readers it shares with the benchmark scripts live in
:mod:`moebalance.cli.args`.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Sequence

import numpy as np

from .args import (
    ArgumentParser,
    UsageError,
    nonneg_int_arg,
    read_loads,
    read_placement,
    run_guarded,
    writable_file,
)
from .topology_flags import add_topology_arguments, topology_from_args

COMMANDS = ("bench", "plan", "inspect", "simulate")


# -- commands -------------------------------------------------------------------------------------


def _figures_line(loads, placement, topology) -> str:
    from ..metrics import balancedness, imbalance, summary_imbalance

    per_layer = imbalance(loads, placement, topology)
    return (f"imbalance {summary_imbalance(loads, placement, topology):.4f} (worst layer "
            f"{per_layer.max():.4f}, layer {int(per_layer.argmax())}), balancedness "
            f"{balancedness(loads, placement, topology).mean():.4f} (mean over layers)")


def _steps_line(counts_TLE, placement, topology, previous) -> str:
    """The per-step imbalance on the file's own steps (what sets step time), planned for them."""
    from ..dispatch.shares import step_imbalance

    def figures(p) -> str:
        r = step_imbalance(counts_TLE, p, topology)
        return f"{r.mean():.4f} (worst step {r.max():.4f})"

    line = (f"per step ({_count(counts_TLE.shape[0], 'step')} of the file, each re-split over "
            f"the replicas as the dispatcher does): imbalance {figures(placement)}, "
            f"{step_imbalance(counts_TLE, placement, topology, resplit=False).mean():.4f} with "
            f"the planned shares")
    if previous is not None:
        line += f"; the placement in service: {figures(previous)}"
    return line


def _count(n: int, noun: str) -> str:
    """``1 layer``, ``3 layers``."""
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _first_call_note(seconds: float, loaded: int, compiled: int) -> str:
    """What the first planner call of this process spent its extra time on."""
    if compiled:
        what = "compiling the planner's Numba kernels (kept in Numba's on-disk cache, so later " \
               "runs load them)"
    else:
        what = "loading the planner's compiled kernels from Numba's on-disk cache"
    return f"the first call took {seconds:.2f} s, {what}"


def cmd_plan(args: argparse.Namespace) -> int:
    from ..backends import backend
    from ..planner import plan
    from ..warmup import jit_counts

    if args.max_moves is not None and args.previous is None:
        raise UsageError("--max-moves bounds the moves away from a current placement: give that "
                         "placement with --previous FILE, or leave --max-moves out")
    out = writable_file(args.out, "--out")  # before any work: a bad path fails at once
    written = out if out.suffix == ".npz" else out.with_name(out.name + ".npz")
    if written.exists() and not args.force:
        raise UsageError(f"--out: {str(written)!r} exists (a placement planned before?); give "
                         f"another --out FILE, or --force to replace it")
    counts = read_loads(args.loads, args.key, steps=True)   # [L, E], or [T, L, E] per step
    loads = counts.mean(axis=0) if counts.ndim == 3 else counts
    previous, saved = read_placement(args.previous, "--previous") if args.previous else (None, None)
    topology = topology_from_args(args, required=saved is None)
    if topology is None:  # --previous holds the devices it was planned for
        topology = saved
    if previous is not None and (
            (previous.num_layers, previous.num_experts) != loads.shape
            or not np.array_equal(previous.slot_device, topology.slot_device)):
        raise UsageError(
            f"--previous {args.previous!r} holds {_count(previous.num_layers, 'layer')} x "
            f"{_count(previous.num_experts, 'expert')} on {_count(previous.num_slots, 'slot')} of "
            f"{_count(previous.num_devices, 'device')}; these loads and devices are "
            f"{_count(loads.shape[0], 'layer')} x {_count(loads.shape[1], 'expert')} on "
            f"{_count(topology.num_slots, 'slot')} of {_count(topology.num_devices, 'device')}: "
            f"give the placement planned for them, or leave --previous out for a first placement")
    before = jit_counts()
    try:
        start = time.perf_counter()
        placement = plan(counts, topology, previous=previous, max_moves=args.max_moves)
        seconds = time.perf_counter() - start
        loaded, compiled = (a - b for a, b in zip(jit_counts(), before))
        note = ""
        if loaded or compiled:  # time a warm call too: that is what a job pays per re-plan
            note = "; " + _first_call_note(seconds, loaded, compiled)
            start = time.perf_counter()
            plan(counts, topology, previous=previous, max_moves=args.max_moves)
            seconds = time.perf_counter() - start
    except (ValueError, TypeError) as exc:
        raise UsageError(str(exc)) from None
    L, E = loads.shape
    print(f"planned {_count(L, 'layer')} x {_count(E, 'expert')} onto "
          f"{_count(topology.num_slots, 'slot')} on {_count(topology.num_devices, 'device')} in "
          f"{seconds * 1e3:.1f} ms (planner backend {backend('planner')}{note})")
    print(("on the steps' mean load: " if counts.ndim == 3 else "") +
          _figures_line(loads, placement, topology))
    if counts.ndim == 3:
        print(_steps_line(counts, placement, topology, previous))
    moves = placement.moves_from(previous)
    print(f"moves: {moves} expert {'copy' if moves == 1 else 'copies'} "
          f"({100.0 * moves / (L * topology.num_slots):.1f}% of slots x layers)"
          f"{' from ' + args.previous if previous is not None else ', first placement'}")
    try:
        placement.save(out, topology=topology)
    except OSError as exc:
        raise UsageError(f"--out: cannot write {args.out!r}: {exc.strerror or exc}") from None
    print(f"wrote {written} (the placement and its topology)")
    return 0


def _histogram(values: np.ndarray) -> str:
    numbers, counts = np.unique(values, return_counts=True)
    return ", ".join(f"{n}: {c}" for n, c in zip(numbers.tolist(), counts.tolist()))


def _layout_table(p, topology, layer: int, loads=None) -> str:
    """One layer of ``p``: per device its speed and node (given a topology), its experts with
    their shares, and (given loads) its load over speed relative to the ideal."""
    from ..lab.report import format_text

    columns = ["device"] + (["speed", "node"] if topology is not None else []) + ["experts (share)"]
    times = None
    if loads is not None:
        speed = topology.speed if topology is not None else np.ones(p.num_devices)
        device_time = p.device_loads(loads)[layer] / speed
        times = device_time / (loads[layer].sum() / speed.sum())
        columns.insert(-1, "load/speed vs ideal")
    cells = []
    for g in range(p.num_devices):
        slots = np.flatnonzero(p.slot_device == g)
        experts = "  ".join(f"{int(p.phy2log[layer, s])} ({p.share[layer, s]:.2f})" for s in slots)
        row = [str(g)]
        if topology is not None:
            row += [f"{topology.speed[g]:g}", str(int(topology.node[g]))]
        if times is not None:
            row.append(f"{times[g]:.3f}")
        cells.append(row + [experts])
    return format_text(columns, cells)


def cmd_inspect(args: argparse.Namespace) -> int:
    from ..topology import Topology

    p, saved = read_placement(args.placement)
    topology = topology_from_args(args, required=False)
    if args.layer is not None and args.layer >= p.num_layers:
        raise UsageError(f"--layer {args.layer}: the placement has {_count(p.num_layers, 'layer')} "
                         f"(0 to {p.num_layers - 1})")
    source = "given"
    if topology is None and saved is not None:
        topology, source = saved, "saved with the placement"
    slots_per_device = np.bincount(p.slot_device, minlength=p.num_devices)
    print(f"{args.placement}: {_count(p.num_layers, 'layer')}, {_count(p.num_slots, 'slot')} on "
          f"{_count(p.num_devices, 'device')}, {_count(p.num_experts, 'expert')}")
    if topology is not None:
        print(f"topology ({source}): {topology!r}")
    print(f"slots per device (slots: devices): {_histogram(slots_per_device)}")
    replicas = p.replicas
    print(f"replicas per expert (replicas: experts, over all layers): {_histogram(replicas)}; "
          f"most {int(replicas.max(initial=0))}")
    replicas_of_slot = np.take_along_axis(replicas, p.phy2log, axis=1)  # [L, S]
    equal = np.allclose(p.share, 1.0 / replicas_of_slot)
    print(f"shares: {'equal split' if equal else 'weighted'} among the replicas of each expert")
    try:
        p.validate(topology)
        print("valid: yes" + (f" (checked against the topology {source})" if topology is not None
                              else ""))
    except ValueError as exc:
        print(f"valid: no: {exc}")
    loads = None
    if args.loads is not None:
        counts = read_loads(args.loads, args.key, "--loads", steps=True)
        loads = counts.mean(axis=0) if counts.ndim == 3 else counts
        if loads.shape != (p.num_layers, p.num_experts):
            raise UsageError(f"--loads has shape {list(loads.shape)} but the placement needs "
                             f"[{p.num_layers}, {p.num_experts}] (layers, experts): give loads "
                             f"of the model it was planned for")
        if topology is None:
            topology = Topology.from_arrays(np.ones(p.num_devices), slots_per_device)
            print("speeds: none given (--topology) or saved; all devices taken as equally fast")
        elif topology.num_slots != p.num_slots or not np.array_equal(topology.slot_device,
                                                                       p.slot_device):
            raise UsageError(f"the topology has {_count(topology.num_slots, 'slot')} on "
                             f"{_count(topology.num_devices, 'device')}; the placement "
                             f"{p.num_slots} on {p.num_devices}: describe the devices it was "
                             f"planned for" + (", or drop the topology flags to use the one "
                                               "saved with it" if saved is not None else ""))
        print(("on the steps' mean load: " if counts.ndim == 3 else "") +
              _figures_line(loads, p, topology))
        if counts.ndim == 3:
            print(_steps_line(counts, p, topology, None))
    if args.layout or args.layer is not None:
        layers = range(p.num_layers) if args.layer is None else [args.layer]
        for layer in layers:
            print(f"\nlayer {layer}: experts of each device, with each replica's share of its "
                  f"expert's tokens")
            print(_layout_table(p, topology, layer, loads))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from ..lab.bench import planner

    return planner.run(args)


# `moebalance bench NAME ...` runs moebalance.lab.bench.NAME
SUB_BENCHMARK_HELP = {
    "dispatch": "the dispatch benchmark",
    "train": "the live-migration benchmark (4 gloo ranks)",
    "resplit": "the per-step re-split benchmark",
    "wrap": "a wrapped transformers model on gloo ranks against one process",
    "simcheck": "the simulator's step model against measured training (4 gloo ranks)",
    "straggler": "measured speeds and a rank that slows down (4 gloo ranks)",
    "pretrained": "peak memory per rank of mb.from_pretrained against the whole model",
    "faults": "one rank's error raised on every rank (4 gloo ranks)",
    "bound": "the planner's placements against a floor no placement goes under (HiGHS)",
}
SUB_BENCHMARKS = tuple(SUB_BENCHMARK_HELP)


def run_sub_bench(name: str, argv: Sequence[str]) -> int:
    """``moebalance bench NAME ...``: hand the rest of the line to that benchmark's ``main``."""
    import importlib

    module = f"moebalance.lab.bench.{name}"
    try:
        bench = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != module:
            raise
        print(f"moebalance bench: error: the {name} benchmark ({module}) is not part of this "
              f"installation", file=sys.stderr)
        return 2
    return int(bench.main(list(argv)) or 0)


# -- the parser -----------------------------------------------------------------------------------


def build_parser() -> ArgumentParser:
    from .. import __version__
    from ..lab.bench import planner

    parser = ArgumentParser(prog="moebalance", description=(
        "Keep the experts of a Mixture-of-Experts model evenly loaded. Start with "
        "'moebalance bench --quick' (a few seconds once the Numba kernels are compiled), or plan a "
        "placement for your own loads with 'moebalance plan LOADS.npy --devices N --slots K'."))
    parser.add_argument("--version", action="version", version=f"moebalance {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{bench,plan,inspect,simulate}",
                                parser_class=ArgumentParser)

    bench = sub.add_parser("bench", help="planner benchmark against EPLB (about a minute; "
                                         "--quick: a short run, --full: every cluster); "
                                         "'bench NAME --help' for the others: "
                                         + ", ".join(SUB_BENCHMARKS),
                           description=planner.DESCRIPTION + " " + " ".join(
                               f"'moebalance bench {name} ...' runs {what}." for name, what in
                               SUB_BENCHMARK_HELP.items()))
    planner.add_arguments(bench)
    bench.set_defaults(func=cmd_bench)

    plan = sub.add_parser("plan", help="plan a placement for loads read from a file",
                          description="Plan expert placement for per-expert loads and save it "
                                      "(.npz, readable with moebalance.Placement.load).")
    plan.add_argument("loads", metavar="LOADS",
                      help="loads [layers, experts], or per-step counts [steps, layers, "
                           "experts] (then planned for the steps), in a .npy, .npz or .pt file, "
                           "or a text table (.csv, .txt): one row per layer")
    plan.add_argument("--key", help="array name inside an .npz or a saved dict (default: loads)")
    add_topology_arguments(plan)
    plan.add_argument("--previous", metavar="FILE",
                      help="current placement, to move few experts; its saved topology serves "
                           "when no topology flag is given")
    plan.add_argument("--max-moves", type=nonneg_int_arg, metavar="N",
                      help="at most N expert copies in total (needs --previous)")
    plan.add_argument("--out", default="placement.npz", metavar="FILE",
                      help="where to save the placement and its topology (default: "
                           "placement.npz); an existing file is kept unless --force")
    plan.add_argument("--force", action="store_true", help="replace the --out file if it exists")
    plan.set_defaults(func=cmd_plan)

    inspect = sub.add_parser("inspect", help="summarise a saved placement",
                             description="Summarise a saved placement; with --loads, its balance; "
                                         "with --layout, which experts each device holds. The "
                                         "topology saved with the placement is used unless "
                                         "topology flags are given.")
    inspect.add_argument("placement", metavar="PLACEMENT", help="a placement .npz (from plan)")
    inspect.add_argument("--layout", action="store_true",
                         help="print per device its experts and their shares (every layer, or "
                              "the one --layer names)")
    inspect.add_argument("--layer", type=nonneg_int_arg, metavar="N",
                         help="print the layout of layer N only (implies --layout)")
    inspect.add_argument("--loads", metavar="FILE",
                         help="loads to evaluate it on (.npy/.npz/.pt); per-step counts "
                              "[steps, layers, experts] are also judged step by step")
    inspect.add_argument("--key", help="array name inside an .npz or a saved dict (default: loads)")
    add_topology_arguments(inspect)
    inspect.set_defaults(func=cmd_inspect)

    from ..lab.sim import command as simulation

    simulate = sub.add_parser("simulate", help="model each balancing policy's step time on "
                                               "described clusters (--quick: a short run)",
                              description=simulation.DESCRIPTION)
    simulation.add_arguments(simulate)
    simulate.set_defaults(func=lambda args: simulation.run(args, ["moebalance", *args.argv]))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``moebalance`` command; ``argv`` excludes the program name."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:  # what many type first: say what there is, start nothing
        build_parser().print_help()
        return 0
    if argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version"):
        argv = ["bench", *argv]  # options without a command are the benchmark's
    if argv[:1] == ["bench"] and argv[1:2] and argv[1] in SUB_BENCHMARKS:
        return run_sub_bench(argv[1], argv[2:])
    if argv[:2] == ["bench", "planner"]:
        argv = ["bench", *argv[2:]]
    args = build_parser().parse_args(argv)
    args.argv = argv  # the command line, recorded with results
    return run_guarded(lambda: args.func(args), prog=f"moebalance {args.command}")
