"""The ``moebalance`` command: ``bench`` (the default), ``plan`` and ``inspect``.

    moebalance bench [--quick] [--out DIR] ...        planner benchmark vs EPLB
    moebalance bench dispatch ...                     dispatch benchmark
    moebalance plan LOADS (--devices N --slots K | --topology FILE | --cluster NAME) [--out FILE]
    moebalance inspect PLACEMENT [--loads LOADS] [--topology FILE | ...]

Mistakes in what the user typed or pointed at (bad flags, unreadable files, loads that do not fit
the topology) print one line, ``moebalance <command>: error: ...``, and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable, NoReturn, Sequence

import numpy as np

COMMANDS = ("bench", "plan", "inspect")
LOAD_SUFFIXES = (".npy", ".npz", ".pt", ".pth")


class UsageError(Exception):
    """Bad user input: reported as one line and exit status 2, without a traceback."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line on stderr (plus exit status 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def run_guarded(fn: Callable[[], int], prog: str = "moebalance") -> int:
    """Run ``fn``; turn a UsageError into a one-line message and status 2."""
    try:
        return fn()
    except UsageError as exc:
        print(f"{prog}: error: {' '.join(str(exc).split())}", file=sys.stderr)  # one line
        return 2


# -- argument types (argparse names the flag in its message) --------------------------------------


def _int_at_least(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    return _int_at_least(text, 1)


def nonneg_int(text: str) -> int:
    return _int_at_least(text, 0)


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not np.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


# -- reading user files ---------------------------------------------------------------------------


def read_loads(path: str, key: str | None = None, flag: str = "LOADS") -> np.ndarray:
    """Per-expert loads [L, E] float64 from a .npy, .npz or .pt file.

    An .npz or a .pt holding a dict gives the array under ``key`` (default: ``loads``, or its only
    array). Per-step counts [steps, L, E] are averaged over the steps.
    """
    from ._arrays import as_loads

    p = Path(path)
    if p.suffix not in LOAD_SUFFIXES:
        raise UsageError(f"{flag} must be a {', '.join(LOAD_SUFFIXES)} file, got {path!r}")
    if not p.is_file():
        raise UsageError(f"{flag}: no such file {path!r}")
    try:
        if p.suffix == ".npy":
            arr = np.load(p, allow_pickle=False)
        elif p.suffix == ".npz":
            with np.load(p, allow_pickle=False) as data:
                arr = data[_pick_key(list(data.keys()), key, flag, path)]
        else:
            import torch

            obj = torch.load(p, map_location="cpu", weights_only=True)
            if isinstance(obj, dict):
                obj = obj[_pick_key(list(obj.keys()), key, flag, path)]
            if not isinstance(obj, torch.Tensor):
                raise UsageError(f"{flag}: {path!r} holds a {type(obj).__name__}, not a tensor of loads")
            arr = obj.detach().to(torch.float64).numpy()
    except UsageError:
        raise
    except Exception as exc:  # any unreadable file is the user's to fix; say which and why
        raise UsageError(f"{flag}: cannot read {path!r}: {exc}") from None
    arr = np.asarray(arr)
    if arr.ndim == 3:
        arr = arr.mean(axis=0)
    try:
        return as_loads(arr, flag)
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from None


def _pick_key(keys: list, key: str | None, flag: str, path: str) -> str:
    if key is not None:
        if key not in keys:
            raise UsageError(f"--key: {path!r} has no array {key!r}; it has {sorted(map(str, keys))}")
        return key
    if "loads" in keys:
        return "loads"
    if len(keys) == 1:
        return keys[0]
    raise UsageError(f"{flag}: {path!r} holds {sorted(map(str, keys))}; name the loads with --key")


def read_topology_file(path: str):
    """A Topology from JSON: ``{"speed": [...], "slots": [...], "node": [...]}`` (node optional)
    or ``{"devices": [{"speed": 1.0, "slots": 4, "node": 0}, ...]}``."""
    from .topology import Device, Topology

    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise UsageError(f"--topology: cannot read {path!r}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise UsageError(f"--topology: {path!r} is not valid JSON: {exc}") from None
    try:
        if isinstance(data, dict) and "devices" in data:
            return Topology([Device(**d) for d in data["devices"]])
        if isinstance(data, dict) and "speed" in data and "slots" in data:
            return Topology.from_dict(data)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"--topology: {path!r}: {exc}") from None
    raise UsageError(f"--topology: {path!r} must hold {{\"speed\": [...], \"slots\": [...], "
                     f"\"node\": [...]}} or {{\"devices\": [{{\"speed\": ..., \"slots\": ..., "
                     f"\"node\": ...}}, ...]}}")


def add_topology_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("topology (one of --devices, --topology, --cluster)")
    group.add_argument("--devices", type=positive_int, metavar="N", help="N identical devices")
    group.add_argument("--slots", type=positive_int, metavar="K", help="expert slots per device")
    group.add_argument("--devices-per-node", type=positive_int, metavar="M",
                       help="devices per node (default: all on one node)")
    group.add_argument("--speed", type=positive_float, default=1.0, metavar="F",
                       help="speed of every device (default 1.0; only ratios matter)")
    group.add_argument("--topology", metavar="FILE",
                       help='JSON: {"speed": [...], "slots": [...], "node": [...]}')
    group.add_argument("--cluster", metavar="NAME",
                       help="a built-in cluster: homogeneous-320, homogeneous-288, uneven-288, "
                            "heterogeneous")


def topology_from_args(args: argparse.Namespace, required: bool = True):
    """The Topology the flags describe, or None when none is given and ``required`` is False."""
    from . import workloads
    from .topology import Topology

    given = [flag for flag, value in (("--devices", args.devices), ("--topology", args.topology),
                                      ("--cluster", args.cluster)) if value is not None]
    if len(given) > 1:
        raise UsageError(f"give one of --devices, --topology or --cluster, not {' and '.join(given)}")
    if args.devices is None and (args.slots is not None or args.devices_per_node is not None):
        raise UsageError("--slots and --devices-per-node need --devices")
    if not given:
        if required:
            raise UsageError("describe the devices: --devices N --slots K, --topology FILE or "
                             "--cluster NAME")
        return None
    if args.topology is not None:
        return read_topology_file(args.topology)
    if args.cluster is not None:
        if args.cluster not in workloads.CLUSTERS:
            raise UsageError(f"--cluster must be one of {sorted(workloads.CLUSTERS)}, got {args.cluster!r}")
        return workloads.cluster(args.cluster).topology()
    if args.slots is None:
        raise UsageError("--devices needs --slots K (expert slots per device)")
    return Topology.uniform(args.devices, args.slots, args.devices_per_node, speed=args.speed)


def read_placement(path: str, flag: str = "PLACEMENT"):
    from .placement import Placement

    if not Path(path).is_file():
        raise UsageError(f"{flag}: no such file {path!r}")
    try:
        return Placement.load(path)
    except Exception as exc:  # a corrupt or foreign file: report it, don't trace it back
        raise UsageError(f"{flag}: {path!r} is not a saved moebalance placement ({exc})") from None


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


def run_dispatch_bench(argv: Sequence[str]) -> int:
    """``moebalance bench dispatch ...``: hand the rest of the line to the dispatch benchmark."""
    try:
        from .benchmarks import dispatch
    except ModuleNotFoundError as exc:
        if exc.name != "moebalance.benchmarks.dispatch":
            raise
        print("moebalance bench: error: the dispatch benchmark (moebalance.benchmarks.dispatch) "
              "is not part of this installation", file=sys.stderr)
        return 2
    return int(dispatch.main(list(argv)) or 0)


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
                                         "'bench dispatch --help' for the dispatch benchmark",
                           description=planner.DESCRIPTION
                           + " 'moebalance bench dispatch ...' runs the dispatch benchmark.")
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
    plan.add_argument("--max-moves", type=nonneg_int, metavar="N",
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
    if argv[:2] == ["bench", "dispatch"]:
        return run_dispatch_bench(argv[2:])
    if argv[:2] == ["bench", "planner"]:
        argv = ["bench", *argv[2:]]
    args = build_parser().parse_args(argv)
    return run_guarded(lambda: args.func(args), prog=f"moebalance {args.command}")
