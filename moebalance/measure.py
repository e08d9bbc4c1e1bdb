"""Measuring the devices of a running group: expert speed, memory for expert slots, node.

:func:`measure_devices` (behind ``mb.Topology.measure``) is a collective. Each rank

* times its own expert arithmetic: the forward of ``layer.experts`` (or of SwiGLU experts of a
  given shape) on ``tokens`` rows spread over the slots, ``warmup`` untimed calls then
  ``repeats`` timed ones (CUDA events on GPUs, synchronised once at the end; the wall clock on
  CPUs, each repeat over as many forwards as fill ``MIN_REPEAT_S``). On CPUs the ranks time
  *in turn* by default, one repeat each per round (rounds alternately in rank order and in
  reverse): ranks on one host share its cores, and timed together they would measure the
  sharing, not the device;
* reads the memory it can give to expert slots: ``memory`` bytes if given, else the free memory
  (``torch.cuda.mem_get_info`` on GPUs; ``MemAvailable`` over the ranks of the host on CPUs)
  less a ``reserve`` fraction for activations and the rest of the model; a slot costs its
  weights, their gradient and ``optimizer_bytes_per_param`` of optimizer state per parameter,
  in each of ``num_layers`` layers; slots are capped at ``num_experts`` (a device never holds
  two replicas of one expert in a layer);
* names its node: the launcher's node rank (``GROUP_RANK`` from torchrun, ``NODE_RANK``,
  ``SLURM_NODEID``), else the host name; nodes are numbered in order of first appearance.

Every rank gathers every rank's figures and returns the same arrays (``Topology.measure``
builds the same :class:`~moebalance.Topology` from them): speed
``g`` is the rows per second of rank ``g``'s lower-quartile timing over the fastest rank's, and
``speed_spread[g]`` the interquartile range of its timings over their median. A failure on one
rank (a bad argument, too little memory for one slot) raises the same error on every rank.
Legend: G ranks, D hidden size, F expert hidden size, Ls slots timed.
"""

from __future__ import annotations

import os
import socket
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ._check import positive_int

__all__ = ["measure_devices", "node_key", "free_memory"]

NODE_VARIABLES = ("GROUP_RANK", "NODE_RANK", "SLURM_NODEID")
TIMED_SLOTS = 4           # slots of the stand-in experts when no layer is given
MIN_REPEAT_S = 0.02       # CPU repeats time forwards for at least this long (seconds) ...
MAX_INNER = 64            # ... but no more than this many


def node_key() -> str:
    """This process's node: the launcher's node rank when set, else the host name."""
    for name in NODE_VARIABLES:
        value = os.environ.get(name)
        if value not in (None, ""):
            return f"{name}={value}"
    return f"host={socket.gethostname()}"


def free_memory(device: torch.device, ranks_on_node: int) -> int:
    """Bytes free for this rank: the GPU's free memory and the blocks torch's caching allocator
    holds unused (free to this process, not to the driver), or the host's available memory
    shared by its ``ranks_on_node`` ranks."""
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(torch.cuda.mem_get_info(device)[0]) + int(cached)
    available = None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(available) // max(1, ranks_on_node)


class _StandIn:
    """SwiGLU experts of a given shape (``gate_up [Ls, 2F, D]``, ``down [Ls, D, F]``), for
    timing without a layer; called like :class:`moebalance.nn.moe.SlotExperts`."""

    def __init__(self, hidden: int, ffn: int, dtype, device) -> None:
        gen = torch.Generator(device="cpu").manual_seed(0)
        self.gate_up = (torch.randn(TIMED_SLOTS, 2 * ffn, hidden, generator=gen, device="cpu")
                        * hidden ** -0.5).to(device=device, dtype=dtype)
        self.down = (torch.randn(TIMED_SLOTS, hidden, ffn, generator=gen, device="cpu")
                     * ffn ** -0.5).to(device=device, dtype=dtype)

    def __call__(self, x_MD: torch.Tensor, tokens_per_slot) -> torch.Tensor:
        outs = []
        for s, rows in enumerate(torch.split(x_MD, list(tokens_per_slot))):
            gate, up = F.linear(rows, self.gate_up[s]).chunk(2, dim=-1)
            outs.append(F.linear(F.silu(gate) * up, self.down[s]))
        return torch.cat(outs)


def _experts_of(layer, hidden_size, ffn_hidden_size, dtype, device):
    """(callable experts, D, F, dtype, device, number of slots, num_experts or None)."""
    if layer is not None:
        experts = getattr(layer, "experts", layer)
        gate_up = getattr(experts, "gate_up", None)
        if not isinstance(gate_up, torch.Tensor) or gate_up.dim() != 3 or not callable(experts):
            raise TypeError(f"layer must be an ExpertParallelMoE or SlotExperts (experts with a "
                            f"gate_up [slots, 2F, D] parameter), got {type(layer).__name__}")
        return (experts, gate_up.shape[2], gate_up.shape[1] // 2, gate_up.dtype, gate_up.device,
                gate_up.shape[0], getattr(layer, "num_experts", None))
    if hidden_size is None or ffn_hidden_size is None:
        raise ValueError("give layer= (an ExpertParallelMoE) or both hidden_size= and "
                         "ffn_hidden_size= for the experts to time")
    D, Fd = (positive_int(hidden_size, "hidden_size"),
             positive_int(ffn_hidden_size, "ffn_hidden_size"))
    dtype = torch.float32 if dtype is None else dtype
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
    device = torch.device(device)
    return _StandIn(D, Fd, dtype, device), D, Fd, dtype, device, TIMED_SLOTS, None


class _ExpertTimer:
    """Times forwards of ``experts`` on ``tokens`` rows spread over ``slots`` slots.

    On CPUs one repeat times as many forwards as fill ``MIN_REPEAT_S`` (at least one, chosen by
    :meth:`warm`) and reports their mean: the wall clock of a millisecond forward carries a
    scheduler tick of noise, and a device held to a share of a core (or throttled in bursts)
    only shows its rate over several forwards. On GPUs each repeat is one forward between CUDA
    events, read once at the end (:meth:`events`).
    """

    def __init__(self, experts, D: int, slots: int, dtype, device, tokens: int) -> None:
        self.experts, self.device = experts, device
        self.split = [tokens // slots + (1 if s < tokens % slots else 0) for s in range(slots)]
        gen = torch.Generator(device="cpu").manual_seed(1)
        self.x_MD = torch.randn(tokens, D, generator=gen, device="cpu").to(device=device,
                                                                        dtype=dtype)
        self.inner = 1

    def warm(self, warmup: int) -> None:
        """``warmup`` untimed forwards (on CPUs, they also size a repeat)."""
        with torch.no_grad():
            began = time.perf_counter()
            for _ in range(warmup):
                self.experts(self.x_MD, self.split)
            one = (time.perf_counter() - began) / warmup if warmup else 0.0
        if self.device.type != "cuda" and one > 0:
            self.inner = max(1, min(MAX_INNER, int(np.ceil(MIN_REPEAT_S / one))))

    def repeat(self) -> float:
        """Seconds of one forward: the mean over one repeat's ``inner`` forwards (wall clock)."""
        with torch.no_grad():
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            begin = time.perf_counter()
            for _ in range(self.inner):
                self.experts(self.x_MD, self.split)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            return (time.perf_counter() - begin) / self.inner

    def events(self, repeats: int) -> list[float]:
        """Seconds of each of ``repeats`` forwards, between CUDA events (one sync at the end)."""
        # on the experts' device, whichever is current: events record on the current device's
        # stream, and the experts run on theirs
        with torch.no_grad(), torch.cuda.device(self.device):
            pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                     for _ in range(repeats)]
            for start, end in pairs:
                start.record()
                self.experts(self.x_MD, self.split)
                end.record()
            torch.cuda.synchronize(self.device)
        return [start.elapsed_time(end) / 1e3 for start, end in pairs]


def _gather(value, group, world: int) -> list:
    if world == 1:
        return [value]
    everyone = [None] * world
    dist.all_gather_object(everyone, value, group=group)
    return everyone


def _raise_any(figures: list) -> None:
    for rank, f in enumerate(figures):
        if f.get("error"):
            kind = {"TypeError": TypeError}.get(f["kind"], ValueError)
            raise kind(f"Topology.measure on rank {rank}: {f['error']}")


def measure_devices(group=None, layer=None, *, hidden_size: int | None = None,
                     ffn_hidden_size: int | None = None, dtype=None, device=None,
                     tokens: int = 2048, warmup: int = 2, repeats: int = 10,
                     slots=None, num_experts: int | None = None, num_layers: int = 1,
                     memory: int | None = None, reserve: float = 0.2,
                     optimizer_bytes_per_param: float = 8.0, in_turn: bool | None = None
                     ) -> dict:
    """The devices of ``group``, measured (a collective; see the module docstring).

    Args:
        group: process group (None: the default group, or this process alone when
            torch.distributed is not initialised).
        layer: an :class:`~moebalance.nn.moe.ExpertParallelMoE` (or its ``experts``) whose experts
            are timed at their shape, dtype and device; None: ``hidden_size`` (D) and
            ``ffn_hidden_size`` (F) SwiGLU experts of ``dtype`` (float32) on ``device``.
        tokens: rows per timed forward. warmup, repeats: untimed and timed forwards.
        slots: expert slots per layer: one int for every rank, a list of one per rank, or None
            to derive them from memory (then ``num_experts`` or a layer that knows it is needed).
        num_experts: cap on slots (a device holds at most one replica of an expert per layer).
        num_layers: MoE layers whose slots share the memory.
        memory: bytes this rank gives to expert slots (None: free memory less ``reserve``).
        reserve: fraction of the free memory kept for everything else.
        optimizer_bytes_per_param: optimizer state per expert parameter (8: Adam's two fp32
            moments; add 4 for an fp32 master copy of bf16 weights).
        in_turn: time the ranks one after another (default: on CPUs) or all at once (GPUs).

    Returns:
        The same dict on every rank: ``speed`` [G] float64 (1.0 for the fastest), ``slots``
        [G] int64, ``node`` [G] int64, ``speed_spread`` [G] float64 and ``seconds`` [G, repeats]
        (every timing), ``wall_s`` (this rank's seconds from the first timing to the last).
    """
    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size(group) if distributed else 1
    rank = dist.get_rank(group) if distributed else 0
    keys = _gather(node_key(), group, world)
    local: dict = {"error": None}
    try:
        tokens, warmup, repeats = (positive_int(tokens, "tokens"), int(warmup),
                                   positive_int(repeats, "repeats"))
        if warmup < 0:
            raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")
        experts, D, Fd, dtype, dev, timed_slots, layer_experts = _experts_of(
            layer, hidden_size, ffn_hidden_size, dtype, device)
        cap = num_experts if num_experts is not None else layer_experts
        if isinstance(slots, (list, tuple, np.ndarray)):
            if len(slots) != world:
                raise ValueError(f"slots must be one int for every rank or a list of {world} "
                                 f"ints, got {len(slots)} entries")
            local["slots"] = positive_int(slots[rank], f"slots[{rank}]")
        elif slots is not None:
            local["slots"] = positive_int(slots, "slots")
        else:
            if cap is None:
                raise ValueError("give slots= or num_experts= (slots derived from memory are "
                                 "capped at the experts of a layer)")
            if not 0 <= reserve < 1:
                raise ValueError(f"reserve must be a fraction in [0, 1), got {reserve!r}")
            param_bytes = torch.tensor([], dtype=dtype).element_size()
            per_slot = 3 * D * Fd * (2 * param_bytes + float(optimizer_bytes_per_param))
            budget = (int(memory) if memory is not None
                      else int(free_memory(dev, keys.count(keys[rank])) * (1 - reserve)))
            fit = int(budget // (per_slot * positive_int(num_layers, "num_layers")))
            if fit < 1:
                raise ValueError(f"{budget} bytes for expert slots hold no slot of {num_layers} "
                                 f"layers x {per_slot:.0f} bytes; give memory= or slots=, or "
                                 f"lower reserve")
            local.update(slots=min(fit, positive_int(cap, "num_experts")), memory=budget)
        local["in_turn"] = dev.type == "cpu" if in_turn is None else bool(in_turn)
    except (TypeError, ValueError) as exc:
        local = {"error": str(exc), "kind": type(exc).__name__}
    settings = _gather(local, group, world)
    _raise_any(settings)
    if len({s["in_turn"] for s in settings}) > 1:
        raise ValueError("ranks disagree on in_turn (CPU and GPU ranks in one group); pass "
                         "in_turn= explicitly on every rank")
    started = time.perf_counter()
    timer = _ExpertTimer(experts, D, timed_slots, dtype, dev, tokens)
    if settings[0]["in_turn"]:
        # One repeat per round, the ranks in turn, in rank order and then in reverse: each rank's
        # repeats spread over the whole measurement, so a slow spell of the host (another job,
        # a clock change) lands on every rank alike, and no rank is always timed in the same
        # place (first after the start, next to the store's host). Each rank's figure is the
        # lower quartile of its repeats.
        seconds = []
        for r in range(repeats):
            for turn in (range(world) if r % 2 == 0 else range(world - 1, -1, -1)):
                if world > 1:
                    dist.barrier(group=group)
                if turn == rank:
                    if r == 0:
                        timer.warm(warmup)
                    seconds.append(timer.repeat())
        if world > 1:
            dist.barrier(group=group)
    else:
        timer.warm(warmup)
        seconds = (timer.events(repeats) if dev.type == "cuda"
                   else [timer.repeat() for _ in range(repeats)])
    local["seconds"] = seconds
    local["wall_s"] = time.perf_counter() - started
    figures = _gather(local, group, world)
    q25, q50, q75 = np.percentile(np.array([f["seconds"] for f in figures]), [25, 50, 75], axis=1)
    rate_G = tokens / q25
    nodes = {}
    node_G = [nodes.setdefault(k, len(nodes)) for k in keys]
    return {"speed": rate_G / rate_G.max(), "slots": np.array([f["slots"] for f in figures]),
            "node": np.array(node_G, dtype=np.int64), "speed_spread": (q75 - q25) / q50,
            "seconds": np.array([f["seconds"] for f in figures]), "wall_s": local["wall_s"]}
