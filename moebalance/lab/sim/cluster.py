"""What the simulator needs to know about a cluster and a model: device kinds, links, expert shapes.

A :class:`GPUKind` gives a device's dense bf16 throughput, memory and links; a :class:`ClusterSpec`
lists devices (kind and node, in rank order); a :class:`ModelShape` gives the expert shape, the
tokens each device routes per step and the bytes an expert occupies and moves. From these,
:func:`ClusterSpec.topology` derives what the planner sees: ``speed`` (tokens per second of expert
work, relative to the fastest kind) and ``slots`` (expert replicas per layer that fit in the
memory set aside for experts, capped at what the model needs, see :meth:`ClusterSpec.slots`).

Preset figures (:data:`GPU_KINDS`) are the vendors' datasheet numbers, named in ``source``:
dense (not sparse) bf16 tensor throughput, memory, the intra-node link per direction and the
network per GPU of the usual server build. ``gemm_efficiency`` (the fraction of peak an expert's
grouped GEMM reaches) is not a datasheet figure: 0.6 is an assumption, the same for every
kind, and a cluster file may set its own.

Files: :func:`load_cluster` reads JSON or TOML of the form written by :meth:`ClusterSpec.to_dict`::

    {"name": "mine", "kinds": {"H100": {...GPUKind fields...}},       # optional: presets
     "nodes": [{"kind": "H100", "devices": 8}, {"kind": "A100", "devices": 8}],
     "speed_changes": [{"step": 300, "device": 5, "factor": 0.5}]}    # optional: stragglers

**Speeds that change.** ``speed_changes`` lists (step, device, factor): from trace step ``step``
on, device ``device`` runs at ``factor`` times its kind's throughput (0.5: a straggler at half
speed; 1 restores it; a later change of the same device replaces an earlier one). The factor
scales the whole device (its expert GEMMs and the rest of its layers); what the planner is told
stays the nominal :meth:`ClusterSpec.topology` unless a policy measures the speeds
(:class:`~.policies.MoebalancePeriodic` with ``speeds=``).

Legend: G devices, L MoE layers, E experts.
"""

from __future__ import annotations

import json
import math
import tomllib
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import numpy as np

from ..._check import integer, positive_int
from ...topology import Device, Topology

__all__ = ["GPUKind", "GPU_KINDS", "ModelShape", "MODELS", "ClusterSpec", "CLUSTER_PRESETS",
           "cluster_preset", "load_cluster", "load_model"]

GB = 1e9


@dataclass(frozen=True)
class GPUKind:
    """One kind of accelerator.

    Attributes:
        name: short name.
        flops: peak dense bf16 tensor throughput, FLOP/s.
        memory: bytes of device memory.
        intra_bandwidth: bytes/s per direction to another device of the same node.
        inter_bandwidth: bytes/s per direction to devices of other nodes (the GPU's NIC share).
        intra_latency, inter_latency: seconds of one all-to-all's fixed cost on each link class.
        gemm_efficiency: fraction of ``flops`` an expert's grouped GEMM reaches.
        source: where the figures come from.
    """

    name: str
    flops: float
    memory: float
    intra_bandwidth: float
    inter_bandwidth: float
    intra_latency: float = 10e-6
    inter_latency: float = 25e-6
    gemm_efficiency: float = 0.6
    source: str = ""

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name in ("name", "source"):
                continue
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value < 0 \
                    or (value == 0 and "latency" not in f.name):
                raise ValueError(f"GPUKind {self.name!r}: {f.name} must be a finite number > 0 "
                                 f"(>= 0 for latencies), got {value!r}")
        if self.gemm_efficiency > 1:
            raise ValueError(f"GPUKind {self.name!r}: gemm_efficiency is a fraction of peak in "
                             f"(0, 1], got {self.gemm_efficiency!r}")

    @property
    def expert_flops(self) -> float:
        """FLOP/s an expert GEMM reaches."""
        return self.flops * self.gemm_efficiency


_NDR = "400 Gb/s NDR InfiniBand per GPU (ConnectX-7, one per GPU in DGX/HGX builds)"
GPU_KINDS: dict[str, GPUKind] = {k.name: k for k in (
    GPUKind("H100", flops=989e12, memory=80 * GB, intra_bandwidth=450 * GB, inter_bandwidth=50 * GB,
            source="NVIDIA H100 SXM5 datasheet: 989 TFLOPS dense BF16, 80 GB HBM3, NVLink 900 GB/s "
                   f"(450 per direction); {_NDR}"),
    GPUKind("H200", flops=989e12, memory=141 * GB, intra_bandwidth=450 * GB,
            inter_bandwidth=50 * GB,
            source="NVIDIA H200 SXM datasheet: 989 TFLOPS dense BF16, 141 GB HBM3e, NVLink 900 "
                   f"GB/s (450 per direction); {_NDR}"),
    GPUKind("A100", flops=312e12, memory=80 * GB, intra_bandwidth=300 * GB, inter_bandwidth=25 * GB,
            source="NVIDIA A100 SXM4 80GB datasheet: 312 TFLOPS dense BF16, 80 GB HBM2e, NVLink "
                   "600 GB/s (300 per direction); 200 Gb/s HDR InfiniBand per GPU (DGX A100)"),
    GPUKind("L40S", flops=362e12, memory=48 * GB, intra_bandwidth=32 * GB,
            inter_bandwidth=12.5 * GB,
            inter_latency=40e-6,
            source="NVIDIA L40S datasheet: 362 TFLOPS dense BF16 (733 with sparsity), 48 GB GDDR6, "
                   "no NVLink: PCIe Gen4 x16, 32 GB/s per direction; 100 Gb/s Ethernet per GPU "
                   "assumed (a 2x200 GbE server of 4 GPUs)"),
)}


@dataclass(frozen=True)
class ModelShape:
    """The MoE part of a model, as the step model sees it.

    Attributes:
        name: short name.
        num_layers, num_experts, top_k, num_groups: L, E, K and expert groups (for EPLB).
        hidden, ffn: D and F of one SwiGLU expert (3 D F parameters).
        tokens_per_device: tokens each device routes through a layer per step.
        activation_bytes: bytes of one hidden-state element on the wire (2: bf16).
        resident_bytes_per_param: bytes an expert parameter occupies (weights, gradient and the
            optimizer state this device keeps; 16 = bf16 weight and gradient, fp32 master and
            two Adam moments).
        moved_bytes_per_param: bytes a move transfers per parameter (14: all but the gradient).
        weight_bytes_per_param: bytes of one weight as the experts compute with it (2: bf16);
            a transient copy moves and holds the weights and a gradient of the same size.
        layers_per_device: MoE layers whose experts one device holds (layers / pipeline stages).
        expert_memory_fraction: share of device memory set aside for expert slots.
        remote_copies_per_pair: bytes that cross nodes per (token, expert) pair sent off-node,
            as a fraction of one row (1: every pair travels; < 1: tokens go once per node and
            fan out there).
        non_moe_flops_per_token: FLOPs of the rest of one layer (attention, shared experts)
            per token, forward and backward.
        redundancy: spare slots beyond one per expert, as a fraction of E, that the cluster
            provides when memory allows (EPLB's redundant experts).
        sequence_length: tokens per training sequence (sets how many independent sequences a
            step holds, see :func:`~.traces.generate_trace`).
        source: where the figures come from.
    """

    name: str
    num_layers: int
    num_experts: int
    top_k: int
    hidden: int
    ffn: int
    tokens_per_device: int
    num_groups: int = 1
    activation_bytes: float = 2.0
    resident_bytes_per_param: float = 16.0
    moved_bytes_per_param: float = 14.0
    weight_bytes_per_param: float = 2.0
    layers_per_device: int | None = None
    expert_memory_fraction: float = 0.35
    remote_copies_per_pair: float = 1.0
    non_moe_flops_per_token: float = 0.0
    redundancy: float = 0.25
    sequence_length: int = 4096
    source: str = ""

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_experts", "top_k", "hidden", "ffn", "tokens_per_device",
                     "num_groups", "sequence_length"):
            value = getattr(self, name)
            positive_int(value, f"ModelShape {self.name!r}: {name}")
        if self.layers_per_device is not None and (
                isinstance(self.layers_per_device, bool) or self.layers_per_device < 1):
            raise ValueError(f"ModelShape {self.name!r}: layers_per_device must be an integer "
                             f">= 1 or None (every layer), got {self.layers_per_device!r}")
        if self.top_k > self.num_experts or self.num_experts % self.num_groups:
            raise ValueError(f"ModelShape {self.name!r}: needs top_k <= num_experts and "
                             f"num_groups dividing num_experts, got top_k {self.top_k}, "
                             f"{self.num_experts} experts in {self.num_groups} groups")
        for name in ("activation_bytes", "resident_bytes_per_param", "moved_bytes_per_param",
                     "weight_bytes_per_param",
                     "expert_memory_fraction", "remote_copies_per_pair",
                     "non_moe_flops_per_token", "redundancy"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value < 0:
                raise ValueError(f"ModelShape {self.name!r}: {name} must be a finite number "
                                 f">= 0, got {value!r}")
        if not 0 < self.expert_memory_fraction <= 1:
            raise ValueError(f"ModelShape {self.name!r}: expert_memory_fraction is a share of "
                             f"device memory in (0, 1], got {self.expert_memory_fraction!r}")

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.ffn

    @property
    def flops_per_pair(self) -> float:
        """FLOPs of one (token, expert) pair, forward (2 * 3 D F) and backward (twice that)."""
        return 18.0 * self.hidden * self.ffn

    @property
    def row_bytes(self) -> float:
        """Bytes of one token's hidden state on the wire."""
        return self.hidden * self.activation_bytes

    @property
    def bytes_per_move(self) -> float:
        return self.expert_params * self.moved_bytes_per_param

    @property
    def copy_bytes(self) -> float:
        """Bytes of one expert's weights: what a transient copy moves (and its gradient back)."""
        return self.expert_params * self.weight_bytes_per_param

    def with_trace_shape(self, num_layers: int, num_experts: int) -> "ModelShape":
        """This shape for a trace of ``num_layers`` x ``num_experts`` (groups kept if they
        divide the experts, else one group)."""
        groups = self.num_groups if num_experts % self.num_groups == 0 else 1
        return replace(self, num_layers=int(num_layers), num_experts=int(num_experts),
                       num_groups=groups)


MODELS: dict[str, ModelShape] = {m.name: m for m in (
    ModelShape("deepseek-v3", num_layers=58, num_experts=256, top_k=8, hidden=7168, ffn=2048,
               tokens_per_device=8192, num_groups=8, layers_per_device=4,
               remote_copies_per_pair=0.5, non_moe_flops_per_token=6 * 0.23e9,
               source="DeepSeek-V3 technical report: 58 MoE layers of 256 routed experts, top-8 "
                      "in 8 groups, D 7168, expert F 2048, 16 pipeline stages (4 MoE layers per "
                      "device), tokens sent to at most 4 nodes and fanned out there (taken as half "
                      "a row per pair off-node); about 0.23 B non-expert parameters per layer "
                      "(attention and the shared expert)"),
    ModelShape("mixtral-8x7b", num_layers=32, num_experts=8, top_k=2, hidden=4096, ffn=14336,
               tokens_per_device=8192, layers_per_device=8, non_moe_flops_per_token=6 * 0.21e9,
               redundancy=1.0,
               source="Mixtral 8x7B: 32 layers of 8 experts, top-2, D 4096, F 14336; about 0.21 B "
                      "attention parameters per layer; 4 pipeline stages assumed"),
)}


@dataclass(frozen=True)
class ClusterSpec:
    """Devices in rank order: each one's kind and node.

    Attributes:
        name: short name. description: one line for people.
        kinds: [G] kind of each device. nodes: [G] node of each device (non-decreasing).
        catalogue: the :class:`GPUKind` of every name in ``kinds``.
        speed_changes: (step, device, factor) triples, sorted by step: from ``step`` on,
            ``device`` runs at ``factor`` times its kind's throughput (see the module docstring).
    """

    name: str
    description: str
    kinds: tuple[str, ...]
    nodes: tuple[int, ...]
    catalogue: dict
    speed_changes: tuple[tuple[int, int, float], ...] = ()

    def __post_init__(self) -> None:
        if not self.kinds or len(self.kinds) != len(self.nodes):
            raise ValueError(f"cluster {self.name!r}: needs one kind and one node per device, got "
                             f"{len(self.kinds)} kinds and {len(self.nodes)} nodes")
        changes = []
        for n, change in enumerate(self.speed_changes):
            changes.append(_speed_change(change, len(self.kinds), f"cluster {self.name!r}: "
                                         f"speed_changes[{n}]"))
        # stable: changes of one step keep their order (the later one wins)
        object.__setattr__(self, "speed_changes", tuple(sorted(changes, key=lambda c: c[0])))
        missing = sorted(set(self.kinds) - set(self.catalogue))
        if missing:
            raise ValueError(f"cluster {self.name!r}: unknown device kind(s) {missing}; use one of "
                             f"{sorted(self.catalogue)} or describe it under 'kinds'")

    @property
    def num_devices(self) -> int:
        return len(self.kinds)

    def with_speed_changes(self, changes) -> "ClusterSpec":
        """This cluster with ``changes`` ((step, device, factor) triples) added to its own."""
        return replace(self, speed_changes=self.speed_changes + tuple(tuple(c) for c in changes))

    def speed_factors(self, num_steps: int) -> np.ndarray:
        """[T, G] float64: every device's throughput over its kind's at each of ``num_steps``
        steps (1 where no change applies)."""
        factors = np.ones((int(num_steps), self.num_devices))
        for step, device, factor in self.speed_changes:
            factors[step:, device] = factor
        return factors

    def kind_array(self, attribute: str) -> np.ndarray:
        """[G] float64: ``attribute`` of every device's kind (e.g. "expert_flops")."""
        return np.array([getattr(self.catalogue[k], attribute) for k in self.kinds],
                        dtype=np.float64)

    def slots(self, model: ModelShape) -> np.ndarray:
        """[G] int64 expert slots per layer on every device.

        What fits (memory for experts / bytes of one expert over the layers the device holds),
        capped at ``ceil(E * (1 + redundancy) / G)``, the slots an even spread with the model's
        redundancy needs: memory beyond that is not spent on more replicas.
        """
        layers = model.layers_per_device or model.num_layers
        per_slot = model.expert_params * model.resident_bytes_per_param * layers
        fit = np.floor(self.kind_array("memory") * model.expert_memory_fraction / per_slot)
        cap = math.ceil(model.num_experts * (1 + model.redundancy) / self.num_devices)
        slots = np.minimum(fit, cap).astype(np.int64)
        if slots.min() < 1 or slots.sum() < model.num_experts:
            raise ValueError(
                f"cluster {self.name!r}: {model.name} experts do not fit ({int(slots.sum())} slots "
                f"for {model.num_experts} experts; an expert takes {per_slot / GB:.2f} GB over "
                f"{layers} layers): add devices, raise expert_memory_fraction or lower "
                f"resident_bytes_per_param (optimizer state sharded elsewhere)")
        return slots

    def transient_slots(self, model: ModelShape) -> np.ndarray:
        """[G] int64 transient slots per layer that fit beside the expert slots on every device.

        A transient slot holds one expert's weights and their gradient for one step
        (``2 x weight_bytes_per_param`` per parameter) in each of the layers the device holds;
        it takes what the expert slots (:meth:`slots`) leave of the memory set aside for
        experts."""
        layers = model.layers_per_device or model.num_layers
        per_slot = model.expert_params * model.resident_bytes_per_param * layers
        free = (self.kind_array("memory") * model.expert_memory_fraction
                - self.slots(model) * per_slot)
        per_copy = 2.0 * model.copy_bytes * layers
        return np.floor(np.maximum(free, 0.0) / per_copy).astype(np.int64)

    def check_transient(self, model: ModelShape, transient: int) -> None:
        """ValueError unless every device has ``transient`` transient slots free."""
        fit = self.transient_slots(model)
        if transient > fit.min():
            g = int(fit.argmin())
            raise ValueError(
                f"cluster {self.name!r}: transient={transient} slots per device do not fit: "
                f"device {g} ({self.kinds[g]}) has room for {int(fit[g])} beside its "
                f"{int(self.slots(model)[g])} expert slots ({2 * model.copy_bytes / GB:.2f} GB "
                f"per layer each): lower transient or raise expert_memory_fraction")

    def topology(self, model: ModelShape) -> Topology:
        """The planner's view: relative expert speed, slots and node of every device."""
        speed = self.kind_array("expert_flops")
        speed = speed / speed.max()
        return Topology([Device(speed=float(s), slots=int(k), node=int(n))
                         for s, k, n in zip(speed, self.slots(model), self.nodes)])

    def to_dict(self) -> dict:
        nodes = []
        for n in sorted(set(self.nodes)):
            members = [k for k, m in zip(self.kinds, self.nodes) if m == n]
            for kind in dict.fromkeys(members):
                nodes.append({"kind": kind, "devices": members.count(kind)})
        used = {k: asdict(self.catalogue[k]) for k in dict.fromkeys(self.kinds)}
        out = {"name": self.name, "description": self.description, "kinds": used, "nodes": nodes}
        if self.speed_changes:
            out["speed_changes"] = [{"step": s, "device": d, "factor": f}
                                    for s, d, f in self.speed_changes]
        return out

    @classmethod
    def from_dict(cls, data: dict, name: str = "cluster") -> "ClusterSpec":
        if not isinstance(data, dict) or not isinstance(data.get("nodes"), list) \
                or not data["nodes"]:
            raise ValueError(f"cluster {name!r}: needs a non-empty list 'nodes' of "
                             f"{{'kind': ..., 'devices': N}} entries")
        catalogue = dict(GPU_KINDS)
        for kind_name, spec in (data.get("kinds") or {}).items():
            if not isinstance(spec, dict):
                raise ValueError(f"cluster {name!r}: kinds.{kind_name} must be a table of GPUKind "
                                 f"fields, got {spec!r}")
            base = asdict(catalogue[kind_name]) if kind_name in catalogue else {}
            unknown = set(spec) - {f.name for f in fields(GPUKind)}
            if unknown:
                raise ValueError(f"cluster {name!r}: kinds.{kind_name} has unknown field(s) "
                                 f"{sorted(unknown)}; GPUKind fields are "
                                 f"{[f.name for f in fields(GPUKind)]}")
            try:
                catalogue[kind_name] = GPUKind(**{**base, **spec, "name": kind_name})
            except TypeError as err:
                raise ValueError(f"cluster {name!r}: kinds.{kind_name} is incomplete ({err}); "
                                 "give flops, memory, intra_bandwidth "
                                 "and inter_bandwidth") from None
        kinds, nodes = [], []
        for n, entry in enumerate(data["nodes"]):
            count = entry.get("devices") if isinstance(entry, dict) else None
            if not isinstance(count, int) or isinstance(count, bool) or count < 1 \
                    or not isinstance(entry.get("kind"), str):
                raise ValueError(f"cluster {name!r}: nodes[{n}] must be {{'kind': NAME, 'devices': "
                                 f"N >= 1}}, got {entry!r}")
            kinds += [entry["kind"]] * count
            nodes += [n] * count
        changes = data.get("speed_changes") or []
        if not isinstance(changes, list):
            raise ValueError(f"cluster {name!r}: speed_changes must be a list of {{'step': S, "
                             f"'device': G, 'factor': F}} entries, got {changes!r}")
        triples = []
        for n, entry in enumerate(changes):
            if isinstance(entry, dict):
                unknown = set(entry) - {"step", "device", "factor"}
                if unknown or len(entry) != 3:
                    raise ValueError(f"cluster {name!r}: speed_changes[{n}] must have exactly the "
                                     f"keys step, device and factor, got {sorted(entry)}")
                entry = (entry["step"], entry["device"], entry["factor"])
            triples.append(entry)
        return cls(name=str(data.get("name", name)), description=str(data.get("description", "")),
                   kinds=tuple(kinds), nodes=tuple(nodes), catalogue=catalogue,
                   speed_changes=tuple(triples))


def _speed_change(change, num_devices: int, where: str) -> tuple[int, int, float]:
    """``change`` checked as (step >= 0, device in [0, G), finite factor > 0)."""
    if not isinstance(change, (tuple, list)) or len(change) != 3:
        raise ValueError(f"{where} must be (step, device, factor), got {change!r}")
    step, device, factor = change
    for value, what in ((step, "step"), (device, "device")):
        integer(value, f"{where}: {what}", 0)
    if device >= num_devices:
        raise ValueError(f"{where}: device {device} is not in the cluster's {num_devices} "
                         f"devices (0..{num_devices - 1})")
    if isinstance(factor, bool) or not isinstance(factor, (int, float, np.floating)) \
            or not math.isfinite(factor) or factor <= 0:
        raise ValueError(f"{where}: factor must be a finite number > 0 (the device's throughput "
                         f"over its kind's, e.g. 0.5), got {factor!r}")
    return int(step), int(device), float(factor)


def _build(name: str, description: str, layout: list[tuple[str, int]],
           per_node: int = 8) -> ClusterSpec:
    """A cluster of nodes of ``per_node`` devices: ``layout`` = [(kind, devices), ...]."""
    kinds = [k for kind, count in layout for k in [kind] * count]
    return ClusterSpec(name=name, description=description, kinds=tuple(kinds),
                   nodes=tuple(g // per_node for g in range(len(kinds))), catalogue=dict(GPU_KINDS))


def _presets() -> dict[str, ClusterSpec]:
    out = {}
    for g in (8, 64, 256, 1024):
        out[f"h100-{g}"] = _build(f"h100-{g}", f"{g} H100 SXM, 8 per node", [("H100", g)])
        if g >= 16:
            out[f"h100-a100-{g}"] = _build(f"h100-a100-{g}", f"{g // 2} H100 and {g // 2} A100 "
                                           f"(80 GB), 8 per node, each node one kind",
                                           [("H100", g // 2), ("A100", g // 2)])
            out[f"h200-h100-{g}"] = _build(f"h200-h100-{g}", f"{g // 2} H200 and {g // 2} H100, "
                                           f"8 per node", [("H200", g // 2), ("H100", g // 2)])
    out["h100-l40s-64"] = _build("h100-l40s-64", "32 H100 and 32 L40S, 8 per node",
                                 [("H100", 32), ("L40S", 32)])
    return out


CLUSTER_PRESETS: dict[str, ClusterSpec] = _presets()


def cluster_preset(name: str) -> ClusterSpec:
    if name not in CLUSTER_PRESETS:
        raise ValueError(f"cluster must be a preset name ({', '.join(sorted(CLUSTER_PRESETS))}) or "
                         f"a .json/.toml file, got {name!r}")
    return CLUSTER_PRESETS[name]


def load_cluster(path: str | Path) -> ClusterSpec:
    """A cluster from a JSON or TOML file (see the module docstring)."""
    path = Path(path)
    data = _read_table(path, "cluster")
    return ClusterSpec.from_dict(data, name=path.stem)


def _read_table(path: Path, what: str) -> dict:
    try:
        text = path.read_bytes()
    except OSError as err:
        raise ValueError(f"cannot read {what} file {str(path)!r}: {err.strerror}") from None
    try:
        data = tomllib.loads(text.decode()) if path.suffix == ".toml" else json.loads(text)
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{what} file {str(path)!r} is not valid "
                         f"{'TOML' if path.suffix == '.toml' else 'JSON'}: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what} file {str(path)!r} must hold a table/object at the top")
    return data


def load_model(spec: str | Path) -> ModelShape:
    """A :class:`ModelShape` from a name in :data:`MODELS` or a JSON/TOML file of its fields;
    a file may start from a preset with ``"base": NAME`` and override some fields."""
    if str(spec) in MODELS:
        return MODELS[str(spec)]
    path = Path(spec)
    if path.suffix not in (".json", ".toml"):
        raise ValueError(f"model must be one of {sorted(MODELS)} or a .json/.toml file of "
                         f"ModelShape fields, got {str(spec)!r}")
    data = _read_table(path, "model")
    base = data.pop("base", None)
    if base is not None and base not in MODELS:
        raise ValueError(f"model file {str(path)!r}: base must be one of {sorted(MODELS)}, got "
                         f"{base!r}")
    known = {f.name for f in fields(ModelShape)}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"model file {str(path)!r}: unknown field(s) {sorted(unknown)}; "
                         f"ModelShape fields are {sorted(known)}")
    merged = {**(asdict(MODELS[base]) if base else {}), "name": path.stem, **data}
    try:
        return ModelShape(**merged)
    except TypeError as err:
        raise ValueError(f"model file {str(path)!r} is incomplete ({err}); give num_layers, "
                         "num_experts, top_k, hidden, ffn and tokens_per_device, or "
                         "a base") from None
