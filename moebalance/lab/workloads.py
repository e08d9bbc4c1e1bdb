"""Built-in workloads: per-expert token loads and the clusters the benchmarks plan them onto.

Shapes: L layers, E experts, S slots, G devices.

Synthetic loads (:func:`synthetic_loads`) imitate a DeepSeek-V3-sized model by default: 58 MoE
layers of 256 routed experts in 8 groups, each token choosing 8 experts, 8192 tokens per step,
so every layer routes 8192 * 8 = 65,536 (token, expert) pairs per step. For each layer:

1. Popularity by rank follows Zipf's law, ``p(rank) ~ (1 + rank) ** -s``. The exponent ``s``
   sets the skew (:data:`SKEWS`):

   - ``"moderate"``, s = 0.3: the hottest expert of a layer gets about 4x the mean load and
     its hottest group about 1.3x the mean group. This is the spread of a model trained with
     a balancing loss or bias, seen one step at a time.
   - ``"heavy"``, s = 0.6: the hottest expert gets about 12x the mean and the hottest group
     about 1.5x. This is narrow-domain serving traffic (one language, code only), where a
     few experts take much of the traffic.

2. Which expert holds which rank is a fresh random permutation per layer, so hot experts are
   not the same ones in every layer (they are not, in trained models).
3. Experts of one group share a lognormal group "heat" (sigma 0.15 moderate, 0.25 heavy):
   DeepSeek-V3 routes each token to a few groups first, so the experts of a hot group run hot
   together. Hierarchical EPLB places whole groups on nodes, so this is what stresses it.
4. Every expert gets independent lognormal noise (sigma 0.25), so loads are not an exact
   power law.
5. No expert can take more than one pair per token, so its share is capped at ``1 / top_k``
   (the excess goes to the others in proportion). Counts are then drawn from a multinomial
   over the ``tokens * top_k`` pairs, so every layer sums exactly to that number.

:func:`drift` jitters loads between two re-plans; :func:`trace_loads` reads a recorded router
trace shipped with the package, by name (:func:`trace_names`: a tiny Mixtral and a tiny
Qwen3-MoE, both trained without a balancing loss). The clusters (:data:`CLUSTERS`,
:func:`cluster`) are the device layouts the benchmark compares planners on.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from .._check import as_loads, integer, positive_int
from ..topology import Device, Topology

__all__ = [
    "SKEWS", "Skew", "synthetic_loads", "cap_shares", "drift", "trace_names", "trace_path",
    "trace_loads",
    "Cluster", "CLUSTERS", "cluster", "trace_clusters",
]


# -- loads -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Skew:
    """How unevenly a synthetic workload loads its experts.

    Args:
        zipf_exponent: s in ``p(rank) ~ (1 + rank) ** -s``; 0 is uniform.
        group_sigma: sigma of the lognormal heat shared by the experts of one group.
        noise_sigma: sigma of the independent lognormal noise on every expert.
    """

    zipf_exponent: float
    group_sigma: float
    noise_sigma: float = 0.25


SKEWS: dict[str, Skew] = {
    "moderate": Skew(zipf_exponent=0.3, group_sigma=0.15),
    "heavy": Skew(zipf_exponent=0.6, group_sigma=0.25),
}


def cap_shares(p_LE: np.ndarray, cap: float) -> np.ndarray:
    """Clip each row of ``p_LE [L, E]`` (rows sum to 1) at ``cap`` and hand the excess to the
    unclipped entries in proportion, repeating until none exceeds it. Needs ``cap * E >= 1``."""
    p = p_LE.copy()
    for _ in range(p.shape[1]):  # each pass clips at least one more entry per offending row
        over = p > cap * (1 + 1e-12)
        if not over.any():
            break
        clipped = p >= cap * (1 - 1e-12)
        free = np.where(clipped, 0.0, p)
        excess = 1.0 - np.where(clipped, cap, 0.0).sum(axis=1, keepdims=True)
        scale = excess / np.maximum(free.sum(axis=1, keepdims=True), 1e-300)
        p = np.where(clipped, cap, free * scale)
    return p


def synthetic_loads(skew: str | Skew = "moderate", seed: int = 0, *, num_layers: int = 58,
                    num_experts: int = 256, num_groups: int = 8, top_k: int = 8,
                    tokens: int = 8192) -> np.ndarray:
    """Seeded per-expert token counts of one training step, DeepSeek-V3-like by default.

    See the module docstring for the model behind the numbers.

    Args:
        skew: a name from :data:`SKEWS` ("moderate", "heavy") or a :class:`Skew`.
        seed: the same seed gives the same loads.
        num_layers: L, MoE layers.
        num_experts: E, routed experts per layer; a multiple of ``num_groups``.
        num_groups: expert groups sharing a heat (DeepSeek-V3: 8); 1 disables the correlation.
        top_k: experts each token chooses; at most ``num_experts``.
        tokens: tokens per step.

    Returns:
        loads_LE: [L, E] float64 whole-number counts; each row sums to ``tokens * top_k``.
    """
    if isinstance(skew, str):
        if skew not in SKEWS:
            raise ValueError(f"skew must be one of {sorted(SKEWS)} or a Skew, got {skew!r}")
        skew = SKEWS[skew]
    elif not isinstance(skew, Skew):
        raise TypeError(f"skew must be a name from {sorted(SKEWS)} or a Skew, got "
                        f"{type(skew).__name__}")
    integer(seed, "seed", 0)
    L = positive_int(num_layers, "num_layers")
    E = positive_int(num_experts, "num_experts")
    groups = positive_int(num_groups, "num_groups")
    K = positive_int(top_k, "top_k")
    T = positive_int(tokens, "tokens")
    if E % groups:
        raise ValueError(f"num_experts ({E}) must be a multiple of num_groups ({groups})")
    if K > E:
        raise ValueError(f"top_k ({K}) cannot exceed num_experts ({E})")

    rng = np.random.default_rng(seed)
    by_rank = (1.0 + np.arange(E)) ** -skew.zipf_exponent
    ranks_LE = np.argsort(rng.random((L, E)), axis=1)  # a random permutation per layer
    heat_LE = np.repeat(rng.lognormal(0.0, skew.group_sigma, (L, groups)), E // groups, axis=1)
    noise_LE = rng.lognormal(0.0, skew.noise_sigma, (L, E))
    w = by_rank[ranks_LE] * heat_LE * noise_LE
    p = cap_shares(w / w.sum(axis=1, keepdims=True), 1.0 / K)
    return rng.multinomial(T * K, p).astype(np.float64)


def drift(loads, rel: float, seed: int = 0) -> np.ndarray:
    """Loads after one re-plan interval: each expert's load times lognormal noise of relative size
    ``rel``, rescaled so every layer keeps its total.

    Args:
        loads: [L, E] (or [E]) non-negative loads.
        rel: relative size of the change, e.g. 0.05 or 0.2 (the noise has standard deviation
            about ``rel``); 0 returns a copy.
        seed: the same seed gives the same jitter.

    Returns:
        loads_LE: [L, E] float64 with the row sums of ``loads``.
    """
    w = as_loads(loads, "loads")
    rel = float(rel)
    if not math.isfinite(rel) or rel < 0 or rel > 2:
        raise ValueError(f"rel must be a relative change in [0, 2], e.g. 0.05, got {rel!r}")
    integer(seed, "seed", 0)
    # sigma chosen so the noise has mean 1 and standard deviation exactly rel
    sigma = math.sqrt(math.log1p(rel * rel))
    factor = np.random.default_rng(seed).lognormal(-0.5 * sigma * sigma, sigma, w.shape)
    out = w * factor
    total, new_total = w.sum(axis=1, keepdims=True), out.sum(axis=1, keepdims=True)
    return np.where(new_total > 0, out * (total / np.where(new_total > 0, new_total, 1.0)), w)


def trace_names() -> list[str]:
    """Names of the router traces shipped with the package, sorted: each ``<name>`` has a
    ``moebalance/lab/data/<name>_trace.npz`` that :func:`trace_loads` reads (``"mixtral"``,
    ``"qwen3_moe"``; ``scripts/record_trace.py --family`` records them)."""
    folder = trace_path("mixtral").parent
    return sorted(p.name[:-len("_trace.npz")] for p in folder.glob("*_trace.npz"))


def trace_path(name: str = "mixtral") -> Path:
    """Where the shipped router trace ``name`` lives (``moebalance/lab/data/<name>_trace.npz``)."""
    if not isinstance(name, str) or not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"name must be a trace name of letters, digits, '-' or '_', got {name!r}")
    return Path(str(resources.files("moebalance.lab"))) / "data" / f"{name}_trace.npz"


def trace_loads(name: str = "mixtral") -> tuple[np.ndarray, dict]:
    """Per-step router counts of a recorded run shipped with the package.

    The file ``moebalance/lab/data/<name>_trace.npz`` holds ``counts``, an integer array
    [steps, L, E] of tokens routed to each expert at each step, and ``meta``, a JSON string
    (model, tokens per step, top-k, ...).

    Returns:
        counts_TLE: [steps, L, E] float64 (T here counts steps).
        meta: the decoded JSON object.

    Raises:
        FileNotFoundError: no trace of that name ships with this installation.
    """
    path = trace_path(name)
    if not path.is_file():
        raise FileNotFoundError(
            f"no router trace named {name!r} ships with this installation (looked for {path.name} "
            f"in the package's data folder); use the synthetic workload instead"
        )
    with np.load(path, allow_pickle=False) as data:
        if "counts" not in data:
            raise ValueError(f"{path.name} has no 'counts' array; it is not a moebalance trace")
        counts = np.asarray(data["counts"])
        meta = json.loads(str(data["meta"])) if "meta" in data else {}
    if counts.ndim != 3 or counts.shape[0] < 1:
        raise ValueError(f"{path.name}: counts must have shape [steps, layers, experts], got "
                         f"{counts.shape}")
    if not np.issubdtype(counts.dtype, np.number) or np.any(counts < 0):
        raise ValueError(f"{path.name}: counts must be non-negative numbers")
    return counts.astype(np.float64), meta


# -- clusters --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cluster:
    """A named device layout: per-device speed, slots and node, in rank order.

    Attributes:
        name: short identifier used in benchmark tables.
        description: one line for people.
        speed, slots, node: one entry per device (G of each).
    """

    name: str
    description: str
    speed: tuple[float, ...]
    slots: tuple[int, ...]
    node: tuple[int, ...]

    def topology(self) -> Topology:
        return Topology([Device(speed=s, slots=k, node=n)
                         for s, k, n in zip(self.speed, self.slots, self.node)])

    @property
    def num_devices(self) -> int:
        return len(self.speed)

    @property
    def num_slots(self) -> int:
        return sum(self.slots)

    @property
    def num_nodes(self) -> int:
        return len(set(self.node))


def _layout(name: str, description: str, num_devices: int, devices_per_node: int,
            device_kind) -> Cluster:
    """Build a Cluster where ``device_kind(g) -> (speed, slots)``."""
    kinds = [device_kind(g) for g in range(num_devices)]
    return Cluster(name=name, description=description,
                   speed=tuple(float(s) for s, _ in kinds), slots=tuple(int(k) for _, k in kinds),
                   node=tuple(g // devices_per_node for g in range(num_devices)))


CLUSTERS: dict[str, Cluster] = {c.name: c for c in (
    _layout("homogeneous-320", "320 slots on 64 identical devices (5 each), 8 nodes of 8",
            64, 8, lambda g: (1.0, 5)),
    _layout("homogeneous-288", "288 slots on 32 identical devices (9 each), 4 nodes of 8",
            32, 8, lambda g: (1.0, 9)),
    # Alternating inside each node, so every node holds 36 slots: the usual cause is ranks that
    # also hold something else (embeddings, the output head), not whole nodes of smaller GPUs.
    _layout("uneven-288", "288 slots on 64 equal-speed devices, even ranks 5 slots, odd ranks 4; "
            "8 nodes of 8", 64, 8, lambda g: (1.0, 5 if g % 2 == 0 else 4)),
    # By node, as clusters are built: nodes 0-3 of fast devices, nodes 4-7 of a slower
    # generation with more free memory per layer.
    _layout("heterogeneous", "64 devices, 8 nodes of 8: nodes 0-3 speed 1.0 with 4 slots, "
            "nodes 4-7 speed 0.5 with 6 slots (320 slots)",
            64, 8, lambda g: (1.0, 4) if g < 32 else (0.5, 6)),
)}


def cluster(name: str) -> Cluster:
    """The built-in cluster called ``name`` (a key of :data:`CLUSTERS`)."""
    if name not in CLUSTERS:
        raise ValueError(f"cluster name must be one of {sorted(CLUSTERS)}, got {name!r}")
    return CLUSTERS[name]


def trace_clusters(num_experts: int) -> tuple[Cluster, Cluster]:
    """A homogeneous and a heterogeneous cluster sized for ``num_experts`` experts per layer.

    About 1.25 slots per expert (as 320 slots for 256 experts) and at least 2 per device, on
    ``max(4, E // 4)`` devices, 8 to a node (Mixtral's 8 experts: 12 slots on 4 devices). The
    heterogeneous one runs its second half of devices at speed 0.5, with the same slots.
    """
    E = positive_int(num_experts, "num_experts")
    G = max(4, E // 4)
    k = max(2, math.ceil(1.25 * E / G))
    per_node = min(G, 8)
    homo = _layout(f"trace-homogeneous-{G * k}", f"{G * k} slots on {G} identical devices "
                   f"({k} each), {per_node} to a node", G, per_node, lambda g: (1.0, k))
    hetero = _layout(f"trace-heterogeneous-{G * k}", f"{G * k} slots on {G} devices ({k} each), "
                     f"the second half at speed 0.5", G, per_node,
                     lambda g: (1.0, k) if g < G - G // 2 else (0.5, k))
    return homo, hetero
