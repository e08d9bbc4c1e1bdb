"""The ``moebalance`` command: ``bench`` (the default), ``plan`` and ``inspect``.

    moebalance bench [--quick] [--out DIR] ...        planner benchmark vs EPLB
    moebalance bench dispatch ...                     dispatch benchmark
    moebalance bench train ...                        live-migration cost in training (4 gloo ranks)
    moebalance bench resplit ...                      per-step re-split benchmark
    moebalance bench wrap ...                         a wrapped transformers model against one process
    moebalance plan LOADS (--devices N --slots K | --topology FILE | --cluster NAME) [--out FILE]
    moebalance inspect PLACEMENT [--loads LOADS] [--topology FILE | ...]

Mistakes in what the user typed or pointed at (bad flags, unreadable files, loads that do not fit
the topology) print one line, ``moebalance <command>: error: ...``, and exit with status 2.
The parser, argument types and file readers it shares with the benchmark scripts live in
:mod:`moebalance.cli_args`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from .cli_args import (ArgumentParser, UsageError, add_topology_arguments, nonneg_int_arg,
                       read_loads, read_placement, run_guarded, topology_from_args)

COMMANDS = ("bench", "plan", "inspect")


# -- commands -------------------------------------------------------------------------------------


def _figures_line(loads, placement, topology) -> str:
    from .metrics import balancedness, imbalance, summary_imbalance

    per_layer = imbalance(loads, placement, topology)
    return (f"imbalance {summary_imbalance(loads, placement, topology):.4f} (worst layer "
            f"{per_layer.max():.4f}, layer {int(per_layer.argmax())}), balancedness "
            f"{balancedness(loads, placement, topology).mean():.4f} (mean over layers)")


def cmd_plan(args: argparse.Namespace) -> int:
    from .backends import backend
    from .planner import plan

    loads = read_loads(args.loads, args.key)
    topology = topology_from_args(args)
    previous = read_placement(args.previous, "--previous") if args.previous else None
    try:
        start = time.perf_counter()
        placement = plan(loads, topology, previous=previous, max_moves=args.max_moves)
        seconds = time.perf_counter() - start
    except (ValueError, TypeError) as exc:
        raise UsageError(str(exc)) from None
    L, E = loads.shape
    print(f"planned {L} layers x {E} experts onto {topology.num_slots} slots on "
          f"{topology.num_devices} devices in {seconds * 1e3:.1f} ms (planner backend "
          f"{backend('planner')}, first call includes compilation)")
    print(_figures_line(loads, placement, topology))
    moves = placement.moves_from(previous)
    print(f"moves: {moves} expert copies ({100.0 * moves / (L * topology.num_slots):.1f}% of slots x "
          f"layers){' from ' + args.previous if previous is not None else ', first placement'}")
    out = Path(args.out)
    try:
        placement.save(out)
    except OSError as exc:
        raise UsageError(f"--out: cannot write {args.out!r}: {exc.strerror or exc}") from None
    print(f"wrote {out if out.suffix == '.npz' else out.with_name(out.name + '.npz')}")
    return 0


def _histogram(values: np.ndarray) -> str:
    numbers, counts = np.unique(values, return_counts=True)
    return ", ".join(f"{n}: {c}" for n, c in zip(numbers.tolist(), counts.tolist()))


def cmd_inspect(args: argparse.Namespace) -> int:
    from .topology import Topology

    p = read_placement(args.placement)
    topology = topology_from_args(args, required=False)
    slots_per_device = np.bincount(p.slot_device, minlength=p.num_devices)
    print(f"{args.placement}: {p.num_layers} layers, {p.num_slots} slots on {p.num_devices} "
          f"devices, {p.num_experts} experts")
    print(f"slots per device (slots: devices): {_histogram(slots_per_device)}")
    replicas = p.replicas
    print(f"replicas per expert (replicas: experts, over all layers): {_histogram(replicas)}; "
          f"most {int(replicas.max())}")
    replicas_of_slot = np.take_along_axis(replicas, p.phy2log, axis=1)  # [L, S]
    equal = np.allclose(p.share, 1.0 / replicas_of_slot)
    print(f"shares: {'equal split' if equal else 'weighted'} among the replicas of each expert")
    try:
        p.validate(topology)
        print("valid: yes" + (" (checked against the topology)" if topology is not None else ""))
    except ValueError as exc:
        print(f"valid: no: {exc}")
    if args.loads is not None:
        loads = read_loads(args.loads, args.key, "--loads")
        if loads.shape != (p.num_layers, p.num_experts):
            raise UsageError(f"--loads has shape {list(loads.shape)} but the placement needs "
                             f"[{p.num_layers}, {p.num_experts}]")
        if topology is None:
            topology = Topology.from_arrays(np.ones(p.num_devices), slots_per_device)
            print("speeds: none given (--topology); all devices taken as equally fast")
        elif topology.num_slots != p.num_slots or not np.array_equal(topology.slot_device,
                                                                       p.slot_device):
            raise UsageError(f"the topology has {topology.num_slots} slots on "
                             f"{topology.num_devices} devices; the placement {p.num_slots} on "
                             f"{p.num_devices}")
        print(_figures_line(loads, p, topology))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .benchmarks import planner

    return planner.run(args)


# `moebalance bench NAME ...` runs moebalance.benchmarks.NAME
SUB_BENCHMARKS = ("dispatch", "train", "resplit", "wrap")


def run_sub_bench(name: str, argv: Sequence[str]) -> int:
    """``moebalance bench NAME ...``: hand the rest of the line to that benchmark's ``main``."""
    import importlib

    module = f"moebalance.benchmarks.{name}"
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
    from . import __version__
    from .benchmarks import planner

    parser = ArgumentParser(prog="moebalance", description=(
        "Keep the experts of a Mixture-of-Experts model evenly loaded. Without a command, "
        "runs the planner benchmark (bench)."))
    parser.add_argument("--version", action="version", version=f"moebalance {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{bench,plan,inspect}",
                                parser_class=ArgumentParser)

    bench = sub.add_parser("bench", help="planner benchmark against EPLB (default); "
                                         "'bench dispatch --help', 'bench train --help' and "
                                         "'bench resplit --help' for the dispatch, live-migration "
                                         "and per-step re-split benchmarks",
                           description=planner.DESCRIPTION
                           + " 'moebalance bench dispatch ...' runs the dispatch benchmark, "
                             "'moebalance bench train ...' the live-migration benchmark, "
                             "'moebalance bench resplit ...' the per-step re-split benchmark.")
    planner.add_arguments(bench)
    bench.set_defaults(func=cmd_bench)

    plan = sub.add_parser("plan", help="plan a placement for loads read from a file",
                          description="Plan expert placement for per-expert loads and save it "
                                      "(.npz, readable with moebalance.Placement.load).")
    plan.add_argument("loads", metavar="LOADS",
                      help="loads [layers, experts] (or [steps, layers, experts], averaged) in a "
                           ".npy, .npz or .pt file")
    plan.add_argument("--key", help="array name inside an .npz or a saved dict (default: loads)")
    add_topology_arguments(plan)
    plan.add_argument("--previous", metavar="FILE", help="current placement, to move few experts")
    plan.add_argument("--max-moves", type=nonneg_int_arg, metavar="N",
                      help="at most N expert copies in total (needs --previous)")
    plan.add_argument("--out", default="placement.npz", metavar="FILE",
                      help="where to save the placement (default: placement.npz)")
    plan.set_defaults(func=cmd_plan)

    inspect = sub.add_parser("inspect", help="summarise a saved placement",
                             description="Summarise a saved placement; with --loads, its balance.")
    inspect.add_argument("placement", metavar="PLACEMENT", help="a placement .npz (from plan)")
    inspect.add_argument("--loads", metavar="FILE", help="loads to evaluate it on (.npy/.npz/.pt)")
    inspect.add_argument("--key", help="array name inside an .npz or a saved dict (default: loads)")
    add_topology_arguments(inspect)
    inspect.set_defaults(func=cmd_inspect)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``moebalance`` command; ``argv`` excludes the program name."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version")):
        argv = ["bench", *argv]  # bench is the default command
    if argv[:1] == ["bench"] and argv[1:2] and argv[1] in SUB_BENCHMARKS:
        return run_sub_bench(argv[1], argv[2:])
    if argv[:2] == ["bench", "planner"]:
        argv = ["bench", *argv[2:]]
    args = build_parser().parse_args(argv)
    return run_guarded(lambda: args.func(args), prog=f"moebalance {args.command}")
