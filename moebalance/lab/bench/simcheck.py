"""``moebalance bench simcheck``: the simulator's step model against measured training steps.

The step model (:mod:`moebalance.lab.sim.stepmodel`) turns each device's expert load into
seconds: expert GEMMs at the device's throughput, four all-to-alls a layer at the link's
bandwidth and latency, a constant for the rest of the layer, and the exposed part of each
migration. This benchmark checks it where both sides can be had: ``--ranks`` gloo ranks train a
stack of :class:`~moebalance.nn.moe.ExpertParallelMoE` layers whose routing replays the shipped
Mixtral router trace step by step (:class:`TraceRouter`), under the simulator's policies, and
the same trace goes through :func:`~moebalance.lab.sim.simulate` on a cluster file
calibrated on this machine.

1. **Calibration** (``--calibrate``, or first thing in a run without ``--calibration``): with
   every rank running, as in training, it times (a) one rank's SwiGLU expert GEMMs, forward
   and backward, on the rows a balanced step gives it (FLOP/s); (b) ``all_to_all_single`` at
   a few sizes, fitted as latency + bytes sent / bandwidth (one node: the intra-node link);
   (c) training steps on a perfectly balanced routing, whose time beyond the modelled GEMM
   and exchange terms is the rest of the layers (router, permutation, count exchange,
   gradient sync, optimizer), written as the model's ``non_moe_flops_per_token``. The result,
   ``calibration.json``, is a cluster file (:func:`~moebalance.lab.sim.cluster.load_cluster`
   reads it: one custom kind, one node, ``gemm_efficiency`` 1) with the model's fields beside.
2. **Measurement**: every policy trains the same layers from the same seeds on the same
   routed steps, new placements applied as the policy decides them (``blocking=True`` for
   EPLB's blocking migration, ``blocking=False`` for live ones); a step's time is the slowest
   rank's, ranks aligned by an untimed barrier. The policies' steps are interleaved a re-plan
   interval at a time, so a change in the machine's background load touches them alike.
3. **Comparison**: per policy the measured and the modelled mean step, their ratio, the
   measured and modelled load imbalance, and whether the policies rank alike.

**What one device is here.** The ranks share ``cores`` CPU cores (usually fewer than the
ranks). The step model's devices are independent: a device's expert GEMMs run at its
throughput whatever the others do. Ranks on shared cores are not: when all of them compute
each gets ``cores / ranks`` of a core, but one that computes while the others wait for it (the
hot rank of an imbalanced step) takes a whole core and runs up to ``ranks / cores`` times
faster, so a plain run shrinks exactly the imbalance the policies are compared on. Hence one
device is *a rank with its share of the cores*: the calibrated throughput is measured with
every rank running, and during training each rank holds to that share. After each expert
GEMM window (forward, and backward) a rank that used ``c`` seconds of CPU in ``w`` seconds of
wall time sleeps ``c / share - w`` if that is positive (:class:`CoreShare`). A rank that shared
its core the whole window sleeps nothing; one that ran alone waits as long as a device of the
calibrated speed would have computed. A backward window ends at the gradient of the experts'
input, so the stack's input requires grad, as a transformer's MoE layers' inputs do: without
it the first layer's backward ran unheld, and an imbalanced step cost a rank less than a
device. Nothing else in the step is held back (it is balanced over the ranks).
``--free-sharing`` turns this off, to measure what the plain run does.

Legend: T steps, L layers, E experts, K top-k, G ranks, N tokens per rank, D hidden size,
F expert hidden size, S slots.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from dataclasses import fields
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..._check import positive_int
from ...cli.args import UsageError, positive_int_arg, run_subcommand, writable_dir
from ..report import format_markdown, format_text, machine_info, markdown_header, phase, timed

PROG = "moebalance bench simcheck"  # the prefix of its progress lines

__all__ = ["pair_counts", "trace_topk_ids", "TraceRouter", "CoreShare", "calibration_cluster",
           "load_calibration", "main"]

DESCRIPTION = "The simulator's step model against measured training steps (4 gloo ranks)."

FULL = dict(hidden=128, ffn=1024, tokens=512, warmup=10, steps=40, every=10,
            gemm_reps=8, a2a_reps=8, rest_steps=8)
QUICK = dict(hidden=64, ffn=512, tokens=256, warmup=4, steps=16, every=4,
             gemm_reps=4, a2a_reps=4, rest_steps=4)
TRACE = "mixtral"
KIND = "cpu-rank"
# The simulator's target: every policy within this fraction of its measured mean step.
TOLERANCE = 0.20
# Bytes of an element on the wire and per parameter: fp32 rows; fp32 weight, gradient and two
# Adam moments resident, all but the gradient moved.
ACTIVATION_BYTES, RESIDENT_BYTES, MOVED_BYTES = 4.0, 16.0, 12.0


# -- the routing a trace prescribes ---------------------------------------------------------------


def pair_counts(counts_E: np.ndarray, pairs: int, cap: int) -> np.ndarray:
    """``counts_E`` scaled to exactly ``pairs`` integer (token, expert) pairs, none above ``cap``.

    Args:
        counts_E: [E] non-negative counts of one step and layer (any scale; all zero: uniform).
        pairs: the pairs to hand out (tokens x K).
        cap: most pairs one expert may take (the tokens: a token picks an expert once).

    Returns:
        [E] int64 summing to ``pairs``: shares capped at ``cap / pairs`` (the excess to the
        others in proportion), then rounded by largest remainder.
    """
    from ..workloads import cap_shares

    c = np.asarray(counts_E, dtype=np.float64)
    if c.ndim != 1 or c.size == 0 or not np.all(np.isfinite(c)) or np.any(c < 0):
        raise ValueError(f"counts_E must be a non-empty 1-D array of finite counts >= 0, got "
                         f"shape {c.shape}")
    if cap * c.size < pairs:
        raise ValueError(f"{pairs} pairs cannot go to {c.size} experts of at most {cap} each: "
                         f"give more experts or fewer pairs per token")
    share = c / c.sum() if c.sum() > 0 else np.full(c.size, 1.0 / c.size)
    share = cap_shares(share[None], cap / pairs)[0]
    exact = np.minimum(share * pairs, cap)
    out = np.floor(exact).astype(np.int64)
    short = int(pairs - out.sum())
    if short:
        order = np.argsort(-(exact - out) - (out < cap) * 1.0, kind="stable")
        out[order[:short]] += 1
    return out


def trace_topk_ids(counts_E: np.ndarray, tokens: int, top_k: int, world_size: int,
                   rng: np.random.Generator) -> np.ndarray:
    """Expert ids of every rank's tokens that route exactly ``counts_E`` over the group.

    Args:
        counts_E: [E] counts of one step and layer (scaled by :func:`pair_counts` to the
            group's ``world_size x tokens x top_k`` pairs).
        tokens: N, tokens per rank. top_k: K. world_size: G.
        rng: draws the order of each rank's tokens.

    Returns:
        [G, N, K] int64: K distinct experts per token; every rank routes about ``1 / G`` of
        each expert's pairs (the step model's uniform sources).

    The pairs, sorted by expert, are dealt to the ranks in turn, so a rank's run of one expert
    is at most ``ceil(count / G) <= N`` long; rank position q goes to token ``q mod N``, choice
    ``q // N``, so the pairs of a run land on distinct tokens.
    """
    G, N, K = world_size, tokens, top_k
    counts = pair_counts(counts_E, G * N * K, G * N)
    seq = np.repeat(np.arange(counts.size, dtype=np.int64), counts)
    per_rank = seq.reshape(N * K, G).T                          # [G, N*K], each sorted by expert
    ids = per_rank.reshape(G, K, N).transpose(0, 2, 1)          # [G, N, K]
    return np.stack([ids[g, rng.permutation(N)] for g in range(G)])


class TraceRouter(nn.Module):
    """A router whose choices replay a trace: step t routes the trace's counts of step t.

    Args:
        hidden_size: D.
        counts_TE: [T, E] counts of this layer at every step (any scale).
        top_k: K. tokens: N, tokens this rank routes per step.
        rank, world_size: this rank and G; every rank builds the same group-wide split and
            keeps its own row, so the group routes the step's counts exactly.
        seed: the gate's weights and the token orders.

    Set :attr:`step` before a forward. Forward: ``x [N, D]`` -> ``(router_logits [N, E],
    topk_weights [N, K], topk_ids [N, K] int64)``, the ids those of the step, the weights the
    softmax of the learnable gate ``x W^T`` at them, renormalised, so the gate trains (its
    gradient flows through the combine) while the routing stays the trace's.
    """

    def __init__(self, hidden_size: int, counts_TE: np.ndarray, top_k: int, tokens: int, *,
                 rank: int = 0, world_size: int = 1, seed: int = 0) -> None:
        super().__init__()
        counts_TE = np.asarray(counts_TE, dtype=np.float64)
        if counts_TE.ndim != 2 or counts_TE.shape[0] < 1:
            raise ValueError(f"counts_TE must have shape [steps, experts], got {counts_TE.shape}")
        for name, value in (("hidden_size", hidden_size), ("top_k", top_k), ("tokens", tokens),
                            ("world_size", world_size)):
            positive_int(value, name)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
        if top_k > counts_TE.shape[1]:
            raise ValueError(f"top_k={top_k} exceeds the trace's {counts_TE.shape[1]} experts")
        self.hidden_dim, self.num_experts, self.top_k = (int(hidden_size), counts_TE.shape[1],
                                                         int(top_k))
        self.tokens = int(tokens)
        ids = [trace_topk_ids(counts_TE[t], tokens, top_k, world_size,
                              np.random.default_rng([seed, t]))[rank]
               for t in range(counts_TE.shape[0])]
        self.register_buffer("topk_ids_TNK", torch.from_numpy(np.stack(ids)), persistent=False)
        self.weight = nn.Parameter(torch.empty(self.num_experts, self.hidden_dim))
        gen = torch.Generator().manual_seed(int(seed))
        with torch.no_grad():
            self.weight.uniform_(-self.hidden_dim ** -0.5, self.hidden_dim ** -0.5, generator=gen)
        self.step = 0

    def forward(self, hidden_states: torch.Tensor):
        x_ND = hidden_states.reshape(-1, self.hidden_dim)
        if x_ND.shape[0] != self.tokens:
            raise ValueError(f"TraceRouter routes {self.tokens} tokens per step, got "
                             f"{x_ND.shape[0]}")
        if not 0 <= self.step < self.topk_ids_TNK.shape[0]:
            raise ValueError(f"step must be in [0, {self.topk_ids_TNK.shape[0]}), got "
                             f"{self.step!r}")
        logits_NE = F.linear(x_ND, self.weight)
        probs_NE = F.softmax(logits_NE, dim=-1, dtype=torch.float32)
        ids_NK = self.topk_ids_TNK[self.step]
        weights_NK = probs_NE.gather(1, ids_NK)
        weights_NK = weights_NK / weights_NK.sum(dim=-1, keepdim=True)
        return logits_NE, weights_NK.to(logits_NE.dtype), ids_NK


# -- one device: a rank and its share of the cores ------------------------------------------------


# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
STEADY_HEAP_BYTES = 1 << 30


def steady_allocator() -> bool:
    """Keep this process's freed memory for its next allocation, so a rank's step costs the
    same whatever its allocation history (True if set; False where the C library is not glibc).

    glibc returns a freed heap top to the system once it passes a threshold that it raises as
    large blocks come and go, so one process re-faults its temporaries' pages on every forward
    while its twin reuses them: measured on 4 gloo ranks, the rank that faulted (90k-195k
    faults in 0.5 s of timed forwards, against 1-5k) ran 38-64% slower for a whole
    ``Topology.measure``. Fixed thresholds (1 GiB) end that; the ranks here hold small layers.
    """
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt     # the C library this process already runs on
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_TRIM_THRESHOLD, STEADY_HEAP_BYTES)
                and mallopt(M_MMAP_THRESHOLD, STEADY_HEAP_BYTES))


class CoreShare:
    """Holds a rank's expert GEMMs to ``share`` of a core (see the module docstring).

    :meth:`attach` hooks a :class:`~moebalance.nn.moe.SlotExperts`: a window opens when its forward
    starts and closes when it ends, and another runs from the gradient of its output to that of
    its input (its backward); at a window's close the rank sleeps ``cpu / share - wall`` seconds
    if positive (CPU time of this thread, which runs the GEMMs at one torch thread), less what
    earlier sleeps overshot.
    """

    def __init__(self, share: float) -> None:
        if not 0 < share <= 1:
            raise ValueError(f"share must be a fraction of a core in (0, 1], got {share!r}")
        self.share = float(share)
        self.slept = 0.0
        self._opened = (0.0, 0.0)
        # seconds slept beyond what the windows so far owed: time.sleep overshoots by a
        # scheduler tick, which on millisecond windows would hold the rank below its share
        self._ahead = 0.0

    def open(self) -> None:
        self._opened = (time.perf_counter(), time.thread_time())

    def close(self) -> None:
        wall0, cpu0 = self._opened
        rest = (time.thread_time() - cpu0) / self.share - (time.perf_counter() - wall0)
        if rest <= 0:
            return              # a window that waited (on a peer, for a core) earns no credit
        owed = rest - self._ahead
        if owed > 0:
            start = time.perf_counter()
            time.sleep(owed)
            slept = time.perf_counter() - start
            self._ahead = slept - owed
            self.slept += slept
        else:
            self._ahead = -owed

    def attach(self, experts: nn.Module) -> None:
        def before(module, args):
            if args[0].requires_grad:
                args[0].register_hook(lambda grad: self.close())
            self.open()

        def after(module, args, out):
            self.close()
            if out.requires_grad and not args[0].requires_grad:
                # The backward window closes on the input's gradient: without one it would run
                # unheld to the next forward, and a rank computing alone would outrun a device.
                raise ValueError("CoreShare holds an expert backward from its output's gradient "
                                 "to its input's, and this input needs no gradient: give the "
                                 "model an input that requires grad, as a transformer's MoE "
                                 "layers have")
            if out.requires_grad:
                out.register_hook(lambda grad: self.open())

        experts.register_forward_pre_hook(before)
        experts.register_forward_hook(after)


# -- calibration file -----------------------------------------------------------------------------


def calibration_cluster(figures: dict, cfg: dict) -> dict:
    """The calibration file: a cluster (one node of ``ranks`` devices of the measured kind) and
    the model's fields, from measured ``figures`` (flops, bandwidth, latency, non_moe)."""
    kind = {"flops": figures["flops"], "memory": 1e12, "intra_bandwidth": figures["bandwidth"],
            "inter_bandwidth": figures["bandwidth"], "intra_latency": figures["latency"],
            "inter_latency": figures["latency"], "gemm_efficiency": 1.0,
            "source": "measured by moebalance bench simcheck: one gloo rank with its share of "
                      "the cores, every rank running"}
    model = {"name": "simcheck", "num_layers": cfg["layers"], "num_experts": cfg["experts"],
             "top_k": cfg["top_k"], "hidden": cfg["hidden"], "ffn": cfg["ffn"],
             "tokens_per_device": cfg["tokens"], "activation_bytes": ACTIVATION_BYTES,
             "resident_bytes_per_param": RESIDENT_BYTES, "moved_bytes_per_param": MOVED_BYTES,
             "weight_bytes_per_param": ACTIVATION_BYTES,
             "non_moe_flops_per_token": figures["non_moe_flops_per_token"],
             "source": "the stack of ExpertParallelMoE layers moebalance bench simcheck trains "
                       "(fp32, fused AdamW)"}
    return {"name": f"simcheck-{cfg['ranks']}", "description": f"{cfg['ranks']} gloo ranks on "
            f"{cfg['cores']} cores, "
            f"{'each held to its share of the cores' if cfg['pace'] else 'free sharing'}",
            "kinds": {KIND: kind}, "nodes": [{"kind": KIND, "devices": cfg["ranks"]}],
            "model": model, "measured": figures}


def load_calibration(path: str | Path):
    """(cluster, model shape, file contents) of a calibration file."""
    from ..sim.cluster import ModelShape, load_cluster

    cluster = load_cluster(path)
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    spec = data.get("model")
    names = {f.name for f in fields(ModelShape)}
    if not isinstance(spec, dict) \
            or not {"name", "hidden", "ffn", "tokens_per_device"} <= set(spec) \
            or set(spec) - names:
        raise ValueError(f"calibration file {str(path)!r} needs a 'model' table of ModelShape "
                         f"fields ({sorted(names)}); write one with moebalance bench simcheck "
                         f"--calibrate")
    return cluster, ModelShape(**spec), data


# -- the ranks ------------------------------------------------------------------------------------


class _Stack(nn.Module):
    """L MoE layers with residual connections: ``x <- x + moe_l(x)``."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x_ND: torch.Tensor) -> torch.Tensor:
        for moe in self.layers:
            x_ND = x_ND + moe(x_ND)
        return x_ND


class _Trainer:
    """One policy's model, optimizer and data on this rank."""

    def __init__(self, rank: int, world: int, cfg: dict, counts_TLE: np.ndarray, placement,
                 resplit: bool, share: CoreShare | None, transient: int = 0,
                 transient_cost: float | None = None) -> None:
        from ...nn.moe import ExpertParallelMoE

        L = counts_TLE.shape[1]
        self.rows = []                       # [steps] rows this rank's slots got, per layer
        layers = []
        for layer in range(L):
            router = TraceRouter(cfg["hidden"], counts_TLE[:, layer], cfg["top_k"], cfg["tokens"],
                                 rank=rank, world_size=world, seed=cfg["seed"] * 131 + layer)
            moe = ExpertParallelMoE(cfg["hidden"], cfg["ffn"], cfg["experts"], cfg["top_k"],
                                    placement, layer=layer, router=router,
                                    seed=cfg["seed"] * 131 + layer, exchange="all_to_all",
                                    resplit=resplit, speeds=[1.0] * world if resplit else None,
                                    transient=transient, transient_cost=transient_cost)
            if share is not None:
                share.attach(moe.experts)
            moe.experts.register_forward_pre_hook(
                lambda module, args: self._seen.append(int(args[0].shape[0])))
            layers.append(moe)
        self.model = _Stack(layers)
        # Fused, as GPU trainers run it (the Trainer's default optimizer): torch's CPU default
        # loops over the tensors at 5-7x the time, a quarter of every rank's step here, where a
        # GPU's optimizer takes a few percent of it.
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3, fused=True)
        self.rank, self.cfg = rank, cfg
        self._seen: list[int] = []

    def step(self, t: int) -> None:
        gen = torch.Generator().manual_seed(self.cfg["seed"] * 1_000_003 + self.rank * 10_007 + t)
        # The input needs a gradient, as a transformer's MoE layers' inputs do (and CoreShare
        # ends each backward window at it).
        x = torch.randn(self.cfg["tokens"], self.cfg["hidden"], generator=gen).requires_grad_()
        target = torch.randn(self.cfg["tokens"], self.cfg["hidden"], generator=gen)
        for moe in self.model.layers:
            moe.router.step = t
        self._seen = []
        self.optimizer.zero_grad()
        F.mse_loss(self.model(x), target).backward()
        self.optimizer.step()
        self.rows.append(self._seen)


def _calibrate(rank: int, world: int, cfg: dict, share: CoreShare | None) -> dict:
    """Measured figures of this machine (see the module docstring), the same on every rank."""
    import torch.distributed as dist

    import moebalance as mb

    from ...nn.moe import SlotExperts
    from ..sim.cluster import ClusterSpec
    from ..sim.stepmodel import StepModel

    D, Fh, N, K, E, L = (cfg[k] for k in ("hidden", "ffn", "tokens", "top_k", "experts", "layers"))
    slots = cfg["slots"]
    # (a) expert GEMMs on the rows of a balanced step, every rank at once.
    rows = N * K
    experts = SlotExperts(slots, D, Fh)
    for s in range(slots):
        experts.init_slot(s, cfg["seed"], s)
    if share is not None:
        share.attach(experts)
    x = torch.randn(rows, D, requires_grad=True)
    split = [rows // slots + (s < rows % slots) for s in range(slots)]

    def gemm():
        experts(x, split).sum().backward()

    for _ in range(2):
        gemm()
    mine = []
    for _ in range(cfg["gemm_reps"]):
        dist.barrier()
        start = time.perf_counter()
        gemm()
        mine.append(time.perf_counter() - start)
    everyone = [None] * world
    dist.all_gather_object(everyone, statistics.median(mine))
    flops = 18.0 * D * Fh * rows / float(np.mean(everyone))
    # (b) all_to_all_single: latency + bytes sent to the others / bandwidth.
    per_peer = max(1, rows // world)
    sizes = [1, per_peer, 4 * per_peer, 16 * per_peer]
    points = []
    for r in sizes:
        send = torch.randn(world * r, D)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
        seconds = statistics.median(timed(lambda: dist.all_to_all_single(recv, send))
                                    for _ in range(cfg["a2a_reps"]))
        points.append(((world - 1) * r * D * ACTIVATION_BYTES, seconds))
    b, s = np.array(points).T
    slope, latency = np.polyfit(b, s, 1)
    bandwidth = 1.0 / max(slope, 1e-15)
    latency = max(float(latency), 0.0)
    # (c) the rest of a layer: balanced training steps beyond the modelled GEMMs and exchanges.
    topology = mb.Topology.from_arrays(speed=[1.0] * world, slots=[slots] * world)
    uniform = np.ones((cfg["rest_steps"] + 2, L, E))
    placement = mb.plan(uniform[0], topology)
    trainer = _Trainer(rank, world, cfg, uniform, placement, False, share)
    trainer.step(0)
    seconds = statistics.median(timed(lambda t=t: trainer.step(t))
                                for t in range(1, uniform.shape[0]))
    figures = {"flops": flops, "bandwidth": bandwidth, "latency": latency,
               "non_moe_flops_per_token": 0.0}
    spec = calibration_cluster(figures, cfg)
    cluster = ClusterSpec.from_dict(spec)
    from ..sim.cluster import ModelShape

    step_model = StepModel(cluster, ModelShape(**spec["model"]))
    pairs_LE = np.full((L, E), world * N * K / E)
    loads = np.stack([np.bincount(placement.slot_device,
                                  pairs_LE[l, placement.phy2log[l]] * placement.share[l],
                                  minlength=world) for l in range(L)])[None]       # [1, L, G]
    modelled = float(step_model.compute_seconds(loads).sum()
                     + step_model.all_to_all_seconds(loads).sum())
    rest_per_layer = max(seconds - modelled, 0.0) / L
    figures.update(non_moe_flops_per_token=rest_per_layer * flops / N,
                   gemm_seconds_per_rank=everyone, a2a_points=points,
                   balanced_step_s=seconds, balanced_modelled_gemm_a2a_s=modelled,
                   rest_per_layer_s=rest_per_layer)
    return figures


def _schedules(cluster, model, counts_TLE: np.ndarray, cfg: dict) -> list[dict]:
    """Every measured policy's placements: the simulator's protocol on the scaled trace."""
    from ..sim.run import scale_trace

    topology = cluster.topology(model)
    w = scale_trace(counts_TLE, model, cluster.num_devices)
    W, T = cfg["warmup"], counts_TLE.shape[0]
    out = []
    for policy in _policies(cluster, model, cfg)[:-1]:
        policy.bind(topology)
        start = current = policy.start(w[:W])
        changes = {}
        for t in range(W + 1, T):
            new = policy.step(t, w[:t], current)
            if new is not None:
                changes[t] = current = new
        out.append({"name": policy.name, "start": start, "changes": changes,
                    "resplit": policy.resplit, "migration": policy.migration,
                    "transient": policy.transient})
    return out


def _policies(cluster, model, cfg: dict) -> list:
    """The compared policies, built the same way for the measured and the modelled run (and
    as ``moebalance simulate`` builds them)."""
    from ..sim.policies import default_policies

    return default_policies(cfg["every"], None, None, transient=cfg["transient"],
                            guides=("current",))


def transient_cost(cluster, model) -> float:
    """The price of one transient copy in pairs of expert work, as the step model prices it:
    the weights there and the gradient back over the link, against one pair's GEMMs."""
    kind = cluster.catalogue[cluster.kinds[0]]
    return (2.0 * model.copy_bytes / kind.intra_bandwidth) / (model.flops_per_pair / kind.flops)


def _worker(rank: int, world: int, cfg: dict, calibration: dict | None, result_path: str) -> None:
    import torch.distributed as dist

    import moebalance as mb

    from ...migrate.transfer import Migrator
    from ..sim.cluster import ClusterSpec, ModelShape
    from ..workloads import trace_loads

    steady_allocator()
    share = CoreShare(cfg["share"]) if cfg["pace"] and cfg["share"] < 1 else None
    if calibration is None:
        if rank == 0:
            phase(PROG, "calibrating: expert GEMMs, all-to-all, the rest of a step", cfg["t0"])
        figures = _calibrate(rank, world, cfg, share)
        calibration = calibration_cluster(figures, cfg)
    if not cfg["measure"]:
        if rank == 0:
            Path(result_path).write_text(json.dumps({"calibration": calibration}), encoding="utf-8")
        return
    counts = trace_loads(TRACE)[0][:cfg["warmup"] + cfg["steps"]]
    cluster, model = ClusterSpec.from_dict(calibration), ModelShape(**calibration["model"])
    if rank == 0:
        phase(PROG, "planning each policy's placements along the trace", cfg["t0"])
    box = [_schedules(cluster, model, counts, cfg) if rank == 0 else None]
    dist.broadcast_object_list(box, group_src=0)
    schedules = box[0]
    topology = cluster.topology(model)
    trainers = [_Trainer(rank, world, cfg, counts, s["start"], s["resplit"], share,
                         s["transient"], transient_cost(cluster, model)) for s in schedules]
    Migrator(None).transfer_group()      # the migration connections, made once per job
    W, T, every = cfg["warmup"], counts.shape[0], cfg["every"]
    for trainer in trainers:
        for t in range(max(0, W - 2), W):
            trainer.step(t)
        trainer.rows.clear()
    bounds = [W] + [t for t in range(W + 1, T) if t % every == 0] + [T]
    steps_s = [dict() for _ in schedules]
    migrations = [[] for _ in schedules]
    for block, (begin, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        if rank == 0:
            phase(PROG, f"training steps {begin}..{end - 1} under each of {len(schedules)} "
                        f"policies (block {block + 1} of {len(bounds) - 1})", cfg["t0"])
        for i in np.roll(np.arange(len(schedules)), -block).tolist():
            trainer, schedule = trainers[i], schedules[i]
            for t in range(begin, end):
                new = schedule["changes"].get(t)

                def step(t=t, new=new):
                    if new is not None:
                        migration = mb.apply_placement(
                            trainer.model, new, trainer.optimizer, topology=topology,
                            blocking=schedule["migration"] == "blocking")
                        trainer.step(t)
                        migration.wait()
                        migrations[i].append({"step": t, **migration.report()})
                    else:
                        trainer.step(t)

                steps_s[i][t] = timed(step)
    rows = [None] * world
    dist.all_gather_object(rows, [tr.rows for tr in trainers])
    if rank == 0:
        result = {"calibration": calibration, "policies": [
            {"name": s["name"], "step_s": [steps_s[i][t] for t in range(W, T)],
             "rows_TLG": np.array([rows[g][i] for g in range(world)]).transpose(1, 2, 0).tolist(),
             "migrations": migrations[i]} for i, s in enumerate(schedules)],
            "slept_s": share.slept if share is not None else 0.0}
        Path(result_path).write_text(json.dumps(result, default=_plain), encoding="utf-8")


def _plain(value):
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"cannot write {type(value).__name__} to JSON")


# -- the command ----------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="smaller layers and fewer steps (well under a minute)")
    parser.add_argument("--calibrate", action="store_true",
                        help="only measure this machine and write calibration.json under --out")
    parser.add_argument("--calibration", metavar="FILE",
                        help="a calibration.json to use instead of measuring (its model shape "
                             "sets --hidden, --ffn, --tokens and --ranks)")
    parser.add_argument("--ranks", type=positive_int_arg, default=None,
                        help="gloo ranks (default 4)")
    parser.add_argument("--hidden", type=positive_int_arg, default=None,
                        help=f"model width D (default {FULL['hidden']}, quick {QUICK['hidden']})")
    parser.add_argument("--ffn", type=positive_int_arg, default=None,
                        help=f"expert hidden size F (default {FULL['ffn']}, quick {QUICK['ffn']})")
    parser.add_argument("--tokens", type=positive_int_arg, default=None,
                        help=f"tokens per rank and step (default {FULL['tokens']}, quick "
                             f"{QUICK['tokens']})")
    parser.add_argument("--steps", type=positive_int_arg, default=None,
                        help=f"measured steps per policy (default {FULL['steps']}, quick "
                             f"{QUICK['steps']})")
    parser.add_argument("--warmup", type=positive_int_arg, default=None,
                        help=f"trace steps given to the policies as history before the first "
                             f"measured one (default {FULL['warmup']}, quick {QUICK['warmup']})")
    parser.add_argument("--every", type=positive_int_arg, default=None,
                        help=f"steps between re-plans (default {FULL['every']}, quick "
                             f"{QUICK['every']})")
    parser.add_argument("--transient", type=int, default=0, metavar="K",
                        help="also train the moebalance + re-split policy with K transient slots "
                             "per rank (copies chosen on each step's counts; default 0: not)")
    parser.add_argument("--free-sharing", action="store_true",
                        help="let a rank that computes alone take a whole core (the plain run; "
                             "the step model's devices are then not independent)")
    parser.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    parser.add_argument("--out", default=os.path.join("bench-out", "simcheck"), metavar="DIR",
                        help="folder for calibration.json, results.json and summary.md "
                             "(default ./bench-out/simcheck)")


def _config(args: argparse.Namespace) -> tuple[dict, dict | None]:
    """The run's settings and the calibration file's contents (None: measure it)."""
    from ..workloads import trace_loads

    cfg = dict(QUICK if args.quick else FULL)
    counts = trace_loads(TRACE)[0]
    _, L, E = counts.shape
    cfg.update(layers=L, experts=E, top_k=2, seed=args.seed, pace=not args.free_sharing,
               measure=not args.calibrate, ranks=4, transient=args.transient)
    if args.transient < 0:
        raise UsageError(f"--transient must be >= 0 transient slots per rank, got "
                         f"{args.transient}")
    calibration = None
    if args.calibration is not None:
        if args.calibrate:
            raise UsageError("--calibrate measures a new calibration; do not give "
                             "--calibration too")
        try:
            cluster, model, calibration = load_calibration(args.calibration)
        except ValueError as exc:
            raise UsageError(f"--calibration: {exc}") from None
        if (model.num_layers, model.num_experts) != (L, E):
            raise UsageError(f"--calibration {args.calibration}: its model has {model.num_layers} "
                             f"x {model.num_experts} experts, the {TRACE} trace {L} x {E}")
        fixed = {"hidden": model.hidden, "ffn": model.ffn, "tokens": model.tokens_per_device,
                 "ranks": cluster.num_devices}
        for name, value in fixed.items():
            given = getattr(args, name)
            if given is not None and given != value:
                raise UsageError(f"--{name} {given} differs from the calibration file's {value}; "
                                 f"leave it out or calibrate again")
        cfg.update(fixed)
    for name in ("ranks", "hidden", "ffn", "tokens", "steps", "warmup", "every"):
        if getattr(args, name) is not None:
            cfg[name] = getattr(args, name)
    if cfg["warmup"] + cfg["steps"] > counts.shape[0]:
        raise UsageError(f"--warmup {cfg['warmup']} + --steps {cfg['steps']} exceed the {TRACE} "
                         f"trace's {counts.shape[0]} steps")
    slots = -(-E * 5 // (4 * cfg["ranks"]))        # the cluster's slots: ceil(E * 1.25 / G)
    if cfg["ranks"] < 2 or cfg["tokens"] * cfg["top_k"] < slots:
        raise UsageError(f"--ranks must be >= 2 and --tokens x {cfg['top_k']} at least the "
                         f"{slots} slots per rank, got --ranks {cfg['ranks']} --tokens "
                         f"{cfg['tokens']}")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cfg.update(slots=slots, cores=int(cores), share=min(1.0, cores / cfg["ranks"]))
    return cfg, calibration


COLUMNS = ["policy", "measured ms", "modelled ms", "modelled / measured", "imbalance meas / model",
           "model: expert / a2a / rest / migration ms"]


def _imbalance(rows_TLG: np.ndarray) -> np.ndarray:
    """[T] the step model's imbalance of measured rows: sum_l max_g / sum_l mean_g."""
    return (rows_TLG.max(axis=-1).sum(axis=-1)
            / np.maximum(rows_TLG.mean(axis=-1).sum(axis=-1), 1e-300))


def _ranking(values: Sequence[float]) -> list[int]:
    return [int(i) for i in np.argsort(values, kind="stable")]


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    cfg, calibration = _config(args)
    out = writable_dir(args.out, "--out")
    from ...launch import launch
    from ..sim.cluster import ClusterSpec, ModelShape
    from ..sim.run import simulate
    from ..workloads import trace_loads

    sharing = f"each held to {cfg['share']:.2f} of a core" if cfg["pace"] else "free sharing"
    print(f"moebalance simcheck: {cfg['ranks']} gloo ranks on {cfg['cores']} cores ({sharing}), "
          f"{cfg['layers']} MoE layers x {cfg['experts']} experts top-{cfg['top_k']}, "
          f"D={cfg['hidden']} F={cfg['ffn']}, {cfg['tokens']} tokens per rank; {TRACE} trace, "
          + (f"steps {cfg['warmup']}..{cfg['warmup'] + cfg['steps'] - 1}, re-plan every "
             f"{cfg['every']}"
             if cfg["measure"] else "calibration only")
          + (f"; calibration from {args.calibration}" if calibration is not None else ""),
          flush=True)
    started = time.perf_counter()
    cfg["t0"] = time.time()
    phase(PROG, f"spawning {cfg['ranks']} gloo ranks", cfg["t0"])
    with tempfile.TemporaryDirectory(prefix="moebalance-simcheck-") as tmp:
        path = os.path.join(tmp, "result.json")
        launch(_worker, cfg["ranks"], args=(cfg, calibration, path))
        result = json.loads(Path(path).read_text(encoding="utf-8"))
    elapsed = time.perf_counter() - started
    calibration = result["calibration"]
    (out / "calibration.json").write_text(json.dumps(calibration, indent=2) + "\n",
                                          encoding="utf-8")
    m = calibration["measured"]
    figures = [f"expert GEMM {m['flops'] / 1e9:.2f} GFLOP/s per rank",
               f"all-to-all {m['bandwidth'] / 1e9:.3f} GB/s + {m['latency'] * 1e6:.0f} us",
               f"rest {m['non_moe_flops_per_token'] / 1e6:.2f} MFLOP per token and layer"
               + (f" ({m['rest_per_layer_s'] * 1e3:.2f} ms per layer)" if "rest_per_layer_s" in m
                  else "")]
    print("calibration: " + "; ".join(figures))
    if not cfg["measure"]:
        print(f"\nwrote {out / 'calibration.json'} ({elapsed:.1f} s)")
        return 0

    cluster, model = ClusterSpec.from_dict(calibration), ModelShape(**calibration["model"])
    W, T = cfg["warmup"], cfg["warmup"] + cfg["steps"]
    phase(PROG, "modelling the same steps with the calibrated cluster", cfg["t0"])
    counts = trace_loads(TRACE)[0][:T]
    sim = simulate(counts, cluster, model, _policies(cluster, model, cfg), warmup=W,
                   trace=f"{TRACE} steps 0..{T - 1}")
    modelled = {s["policy"]: s for s in sim.summaries()}
    rows, compared, moves = [], [], []
    runs = {r.name: r for r in sim.runs}
    for p in result["policies"]:
        s = modelled[p["name"]]
        model_moves = [r["seconds"] for r in runs[p["name"]].replans]
        if p["migrations"] and p["name"].startswith("EPLB"):
            moves.append(f"{p['name']}: blocking migration "
                         f"{np.mean([x['seconds'] for x in p['migrations']]) * 1e3:.0f} ms "
                         f"measured, {np.mean(model_moves) * 1e3:.0f} ms modelled per re-plan "
                         f"({np.mean([x['bytes_total'] for x in p['migrations']]) / 1e6:.0f} MB)")
        measured = float(np.mean(p["step_s"]))
        ratio = s["mean_step_s"] / measured
        imbalance = float(_imbalance(np.asarray(p["rows_TLG"], dtype=np.float64)).mean())
        compared.append({"policy": p["name"], "measured_mean_step_s": measured,
                         "measured_median_step_s": float(np.median(p["step_s"])),
                         "modelled_mean_step_s": s["mean_step_s"], "ratio": ratio,
                         "within_tolerance": abs(ratio - 1) <= TOLERANCE,
                         "measured_imbalance": imbalance, "modelled_imbalance": s["mean_imbalance"],
                         "modelled": s, "modelled_transfer_s": model_moves,
                         "measured_step_s": p["step_s"],
                         "migrations": p["migrations"]})
        rows.append([p["name"], f"{measured * 1e3:.1f}", f"{s['mean_step_s'] * 1e3:.1f}",
                     f"{ratio:.3f}", f"{imbalance:.2f} / {s['mean_imbalance']:.2f}",
                     " / ".join(f"{s[f'mean_{k}_s'] * 1e3:.1f}"
                                for k in ("expert_compute", "all_to_all", "non_moe", "migration"))])
    oracle = modelled[sim.runs[-1].name]
    rows.append([oracle["policy"], "-", f"{oracle['mean_step_s'] * 1e3:.1f}", "-",
                 f"- / {oracle['mean_imbalance']:.2f}",
                 " / ".join(f"{oracle[f'mean_{k}_s'] * 1e3:.1f}"
                            for k in ("expert_compute", "all_to_all", "non_moe", "migration"))])
    rank_measured = _ranking([c["measured_mean_step_s"] for c in compared])
    rank_modelled = _ranking([c["modelled_mean_step_s"] for c in compared])
    same_ranking = rank_measured == rank_modelled
    within = all(c["within_tolerance"] for c in compared)
    names = [c["policy"] for c in compared]
    verdict = [f"ranking by mean step, measured: {' < '.join(names[i] for i in rank_measured)}",
               f"ranking by mean step, modelled: {' < '.join(names[i] for i in rank_modelled)}",
               f"same ranking: {'yes' if same_ranking else 'NO'}; every policy within "
               f"{TOLERANCE:.0%}: {'yes' if within else 'NO'}"] + moves
    info = machine_info(argv)
    table = format_text(COLUMNS, rows)
    print()
    print(table)
    print()
    print("\n".join(verdict))
    (out / "results.json").write_text(json.dumps(
        {"machine": info, "config": cfg, "calibration": calibration, "policies": compared,
         "oracle": oracle, "same_ranking": same_ranking, "all_within_tolerance": within,
         "tolerance": TOLERANCE, "slept_s_rank0": result["slept_s"], "wall_s": elapsed},
        indent=2, default=_plain) + "\n", encoding="utf-8")
    md = markdown_header("moebalance simcheck: step model against measurement", info) + [
        f"- {cfg['ranks']} gloo ranks on {cfg['cores']} cores, one torch thread each, "
        + (f"each held to {cfg['share']:.2f} of a core in its expert GEMMs" if cfg["pace"]
           else "free sharing of the cores"),
        f"- {cfg['layers']} ExpertParallelMoE layers x {cfg['experts']} experts, "
        f"top-{cfg['top_k']}, D={cfg['hidden']}, F={cfg['ffn']}, {cfg['tokens']} tokens per rank, "
        f"fp32, fused AdamW, all_to_all exchange; routing replays the {TRACE} trace, "
        f"steps {W}..{T - 1} measured (0..{W - 1} history), re-plan every {cfg['every']} steps",
        "- calibration: " + "; ".join(figures), "",
        format_markdown(COLUMNS, rows), "", *[f"- {v}" for v in verdict], "",
        "Measured: mean over the steps of the slowest rank's step, ranks aligned by an untimed "
        "barrier; a step that starts a migration includes it. Imbalance: sum over layers of the "
        "most rows a rank's experts got over the mean (measured), the same of the modelled "
        "device loads (modelled). Modelled: the simulator on the calibrated cluster file "
        "(calibration.json), split into its terms."]
    (out / "summary.md").write_text("\n".join(md) + "\n", encoding="utf-8")
    print(f"\nwrote {out / 'calibration.json'}, {out / 'results.json'}, {out / 'summary.md'} "
          f"({elapsed:.1f} s)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``moebalance bench simcheck`` as a function; ``argv`` excludes the program name."""
    return run_subcommand("simcheck", DESCRIPTION, add_arguments, run, argv)
