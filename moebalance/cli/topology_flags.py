"""The topology flags of ``moebalance plan`` and ``inspect``: ``--devices``/``--slots``, a
``--topology`` JSON file, or a built-in ``--cluster`` slot layout of the lab's workloads."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..lab import workloads
from ..topology import Device, Topology
from .args import UsageError, positive_float_arg, positive_int_arg


def read_topology_file(path: str):
    """A Topology from JSON: ``{"speed": [...], "slots": [...], "node": [...]}`` (node optional)
    or ``{"devices": [{"speed": 1.0, "slots": 4, "node": 0}, ...]}``."""
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
    group.add_argument("--devices", type=positive_int_arg, metavar="N", help="N identical devices")
    group.add_argument("--slots", type=positive_int_arg, metavar="K",
                       help="expert slots per device")
    group.add_argument("--devices-per-node", type=positive_int_arg, metavar="M",
                       help="devices per node (default: all on one node)")
    group.add_argument("--speed", type=positive_float_arg, default=1.0, metavar="F",
                       help="speed of every device (default 1.0; only ratios matter)")
    group.add_argument("--topology", metavar="FILE",
                       help='JSON: {"speed": [...], "slots": [...], "node": [...]}')
    group.add_argument("--cluster", metavar="NAME",
                       help="a built-in slot layout: homogeneous-320, homogeneous-288, "
                            "uneven-288, heterogeneous (not the hardware presets of 'moebalance "
                            "simulate --cluster')")


def topology_from_args(args: argparse.Namespace, required: bool = True):
    """The Topology the flags describe, or None when none is given and ``required`` is False."""
    given = [flag for flag, value in (("--devices", args.devices), ("--topology", args.topology),
                                      ("--cluster", args.cluster)) if value is not None]
    if len(given) > 1:
        raise UsageError("give one of --devices, --topology or --cluster, not "
                         f"{' and '.join(given)}")
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
            from ..lab.sim.cluster import CLUSTER_PRESETS

            if args.cluster in CLUSTER_PRESETS:
                raise UsageError(f"--cluster {args.cluster!r} is a hardware preset of 'moebalance "
                                 f"simulate' (it describes GPUs, not expert slots); here --cluster "
                                 f"takes a slot layout: {sorted(workloads.CLUSTERS)}, or use "
                                 f"--devices N --slots K")
            raise UsageError(f"--cluster must be one of {sorted(workloads.CLUSTERS)}, got "
                             f"{args.cluster!r}")
        return workloads.cluster(args.cluster).topology()
    if args.slots is None:
        raise UsageError("--devices needs --slots K (expert slots per device)")
    return Topology.uniform(args.devices, args.slots, args.devices_per_node, speed=args.speed)
