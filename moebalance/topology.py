"""Devices and the cluster they form: speed, expert slots and node of every device.

By hand, from a preset, or measured on the running job (:meth:`Topology.measure`, see
:mod:`moebalance.measure`); saved and loaded as JSON. G devices, S = sum of their slots. Slots are
numbered device by device in device order, so device ``g`` owns slots
``slot_offsets[g] : slot_offsets[g + 1]``.
"""

from __future__ import annotations

import json
import numbers
import os
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ._check import as_loads, positive_int


def _is_whole(x) -> bool:
    """True for an integer value (int, numpy integer, or a float such as 4.0); False for bools,
    NaN, inf, fractions and non-numbers."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Real):
        return False
    return bool(np.isfinite(x)) and float(x).is_integer()


@dataclass(frozen=True)
class Device:
    """One accelerator as the planner sees it.

    Args:
        speed: relative tokens per second its experts push through (> 0; only ratios matter).
        slots: expert replicas of one MoE layer that fit in its memory (>= 1).
        node: the host it sits on; replicas on one node talk over the fast local links.
    """

    speed: float = 1.0
    slots: int = 1
    node: int = 0

    def __post_init__(self) -> None:
        speed = float(self.speed)
        if not np.isfinite(speed) or speed <= 0:
            raise ValueError(f"Device(speed=...) must be a finite number > 0, got {self.speed!r}")
        if not _is_whole(self.slots) or self.slots < 1:
            raise ValueError(f"Device(slots=...) must be an integer >= 1, got {self.slots!r}")
        if not _is_whole(self.node) or self.node < 0:
            raise ValueError(f"Device(node=...) must be an integer >= 0, got {self.node!r}")
        object.__setattr__(self, "speed", speed)
        object.__setattr__(self, "slots", int(self.slots))
        object.__setattr__(self, "node", int(self.node))


@dataclass(frozen=True)
class Topology:
    """The devices of one expert-parallel group, in rank order.

    Array views (read-only numpy):
        speed [G] float64, slots [G] int64, node [G] int64,
        slot_device [S] int64 (device of each slot), slot_offsets [G+1] int64.
        speed_spread [G] float64 or None: for measured speeds, each one's relative spread
        (interquartile range of the repeated timings over their median); not compared by ``==``.
    """

    devices: tuple[Device, ...]
    speed: np.ndarray = field(init=False, repr=False, compare=False)
    slots: np.ndarray = field(init=False, repr=False, compare=False)
    node: np.ndarray = field(init=False, repr=False, compare=False)
    slot_device: np.ndarray = field(init=False, repr=False, compare=False)
    slot_offsets: np.ndarray = field(init=False, repr=False, compare=False)
    speed_spread: np.ndarray | None = field(init=False, repr=False, compare=False)

    def __init__(self, devices: Sequence[Device], speed_spread=None) -> None:
        devices = tuple(devices)
        if len(devices) == 0:
            raise ValueError("Topology(devices=...) needs at least one Device")
        for i, d in enumerate(devices):
            if not isinstance(d, Device):
                raise TypeError(
                    f"Topology(devices=...)[{i}] must be a moebalance.Device, got "
                    f"{type(d).__name__}"
                )
        object.__setattr__(self, "devices", devices)
        speed = np.array([d.speed for d in devices], dtype=np.float64)
        slots = np.array([d.slots for d in devices], dtype=np.int64)
        node = np.array([d.node for d in devices], dtype=np.int64)
        offsets = np.zeros(len(devices) + 1, dtype=np.int64)
        np.cumsum(slots, out=offsets[1:])
        slot_device = np.repeat(np.arange(len(devices), dtype=np.int64), slots)
        for name, arr in (("speed", speed), ("slots", slots), ("node", node),
                          ("slot_offsets", offsets), ("slot_device", slot_device)):
            arr.setflags(write=False)
            object.__setattr__(self, name, arr)
        if speed_spread is not None:
            speed_spread = np.array(speed_spread, dtype=np.float64).reshape(-1)
            if speed_spread.shape != speed.shape or not np.all(np.isfinite(speed_spread)) \
                    or np.any(speed_spread < 0):
                raise ValueError(f"Topology(speed_spread=...) must give a finite spread >= 0 for "
                                 f"each of the {len(devices)} devices, or be None; got "
                                 f"{speed_spread.tolist()!r}")
            speed_spread.setflags(write=False)
        object.__setattr__(self, "speed_spread", speed_spread)

    # -- constructors -------------------------------------------------------------------------

    @classmethod
    def uniform(cls, num_devices: int, slots_per_device: int, devices_per_node: int | None = None,
                speed: float = 1.0) -> "Topology":
        """``num_devices`` identical devices, ``devices_per_node`` to a node (default: one node)."""
        num_devices = positive_int(num_devices, "num_devices")
        if devices_per_node is None:
            devices_per_node = int(num_devices)
        devices_per_node = positive_int(devices_per_node, "devices_per_node")
        return cls([Device(speed=speed, slots=slots_per_device, node=g // int(devices_per_node))
                    for g in range(int(num_devices))])

    @classmethod
    def measure(cls, group=None, layer=None, **options) -> "Topology":
        """Measure the devices of ``group`` (a collective: call it on every rank).

        Each rank times its expert arithmetic (``layer``'s experts, or SwiGLU experts of the
        given ``hidden_size`` / ``ffn_hidden_size``), reads the memory it can give to expert
        slots and its node; every rank returns the same Topology, its speeds relative to the
        fastest device, with ``speed_spread``. See :func:`moebalance.measure.measure_devices`
        for ``options``.
        """
        from .measure import measure_devices

        m = measure_devices(group, layer, **options)
        return cls.from_arrays(m["speed"], m["slots"], m["node"], m["speed_spread"])

    @classmethod
    def from_arrays(cls, speed, slots, node=None, speed_spread=None) -> "Topology":
        """Build from per-device arrays ``speed [G]``, ``slots [G]``, optional ``node [G]`` and
        ``speed_spread [G]``."""
        speed = np.asarray(speed, dtype=np.float64).reshape(-1)
        slots = np.asarray(slots).reshape(-1)
        node = (np.zeros(len(speed), dtype=np.int64) if node is None
                else np.asarray(node).reshape(-1))
        if not (len(speed) == len(slots) == len(node)):
            raise ValueError(
                f"speed, slots and node must have one entry per device; got lengths "
                f"{len(speed)}, {len(slots)}, {len(node)}"
            )
        return cls([Device(speed=float(s), slots=k.item(), node=n.item())
                    for s, k, n in zip(speed, slots, node)], speed_spread=speed_spread)

    @classmethod
    def from_dict(cls, data: dict) -> "Topology":
        if not isinstance(data, dict) or not {"speed", "slots"} <= set(data):
            raise ValueError("a topology's dict needs 'speed' and 'slots' lists (optional 'node', "
                             "'speed_spread'), as Topology.to_dict writes it")
        return cls.from_arrays(data["speed"], data["slots"], data.get("node"),
                               data.get("speed_spread"))

    def to_dict(self) -> dict:
        out = {"speed": self.speed.tolist(), "slots": self.slots.tolist(),
               "node": self.node.tolist()}
        if self.speed_spread is not None:
            out["speed_spread"] = self.speed_spread.tolist()
        return out

    def save(self, path: str | os.PathLike) -> None:
        """Write to ``path`` as JSON (:meth:`load` reads it back, spreads included)."""
        text = json.dumps({"kind": "moebalance.Topology", "version": 1, **self.to_dict()}, indent=1)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Topology":
        """The topology :meth:`save` wrote to ``path``."""
        with open(path, encoding="utf-8") as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{os.fspath(path)} is not a saved moebalance Topology (not JSON: "
                                 f"{exc})") from None
        if not isinstance(data, dict) or data.get("kind") != "moebalance.Topology":
            raise ValueError(f"{os.fspath(path)} is not a saved moebalance Topology (the JSON file "
                             f"Topology.save writes)")
        return cls.from_dict(data)

    # -- sizes --------------------------------------------------------------------------------

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    @property
    def num_slots(self) -> int:
        return int(self.slot_offsets[-1])

    @property
    def num_nodes(self) -> int:
        return int(np.unique(self.node).size)

    @property
    def is_homogeneous(self) -> bool:
        return bool(np.all(self.speed == self.speed[0]) and np.all(self.slots == self.slots[0]))

    def device_slots(self, device: int) -> range:
        """The slot indices owned by ``device``."""
        return range(int(self.slot_offsets[device]), int(self.slot_offsets[device + 1]))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Topology) and self.devices == other.devices

    def __hash__(self) -> int:
        return hash(self.devices)

    def __repr__(self) -> str:
        return (f"Topology(num_devices={self.num_devices}, num_slots={self.num_slots}, "
                f"num_nodes={self.num_nodes}, speed={_runs(self.speed)}, "
                f"slots={_runs(self.slots)}, node={_runs(self.node)})")


def _runs(values: np.ndarray) -> str:
    """Per-device values in rank order, runs of equal values written ``value x count``, so the
    text reads as a list of ``num_devices`` entries: ``[1.0 x 32, 0.5 x 32]``."""
    items, start = [], 0
    for end in range(1, len(values) + 1):
        if end == len(values) or values[end] != values[start]:
            value, count = values[start].item(), end - start
            items.append(f"{value} x {count}" if count > 1 else f"{value}")
            start = end
    if len(items) > _REPR_RUNS:  # keep a repr one readable line on large clusters
        items = items[:_REPR_RUNS] + [f"... {len(items) - _REPR_RUNS} more runs"]
    return "[" + ", ".join(items) + "]"


_REPR_RUNS = 8


def planning_loads(loads, topology) -> np.ndarray:
    """Check ``topology`` and ``loads`` [L, E] together for planning; return loads as float64.

    Raises TypeError for a topology that is not a moebalance.Topology, ValueError when the
    topology has fewer slots than experts or a device with more slots than there are experts.
    """
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be a moebalance.Topology, got {type(topology).__name__}")
    w = as_loads(loads, "loads")
    E, S = w.shape[1], topology.num_slots
    if S < E:
        raise ValueError(
            f"topology has {S} slots for {E} experts: every expert needs at least one slot; add "
            f"devices or slots per device (slots >= num_experts)"
        )
    if int(topology.slots.max()) > E:
        g = int(np.argmax(topology.slots))
        raise ValueError(
            f"device {g} has {int(topology.slots[g])} slots but there are only {E} experts and a "
            f"device holds at most one replica of each; give it at most {E} slots"
        )
    return w
