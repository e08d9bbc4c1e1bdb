"""``mb.wrap(model, topology)``: a transformers 5.x MoE model, expert-parallel over a process group.

The plug point is a module swap of each MoE block's ``experts`` child. All six families
(Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3, GPT-OSS) run
``router(x) -> (logits, top_k_weights, top_k_index)`` and then
``self.experts(hidden [T, H], top_k_index, top_k_weights)``, with shared experts (Qwen2-MoE,
DeepSeek-V3) added outside it. Replacing that one child keeps the model's own router and its
exact choice (DeepSeek-V3's bias-corrected, group-limited top-k included), the shared experts and
every non-expert module as they are, and needs no registry. Many more families are built the
same way (PhiMoE, GLM-4-MoE, MiniMax, Qwen3-Next, Jamba, ...); :func:`check_family_arithmetic`
probes each kind of experts module once and refuses one that computes something else, and
:func:`~.routers.moe_blocks` one called on every token (Llama 4). transformers' own expert
parallelism (``DistributedConfig(ep_size=...)``) shards experts as contiguous DTensor blocks with
no replicas and no placement, and its ``EPImplementationInterface`` / ``ExpertsInterface`` plug
points pass through version-specific registries; a module swap works on every 5.x release that
calls ``self.experts(...)``.

:class:`HFExpertSlots` holds this rank's slots in the family's own layout (``gate_up_proj [Ls,
2I, H]``, ``down_proj [Ls, H, I]``; GPT-OSS: transposed ``[Ls, H, 2I]`` / ``[Ls, I, H]``,
gate and up interleaved, with biases and the clamped activation of the original module), so its
per-expert arithmetic is the original's, and checkpoints by logical expert come back in
transformers' layout (:func:`unwrap`, :func:`save_pretrained`).

Data parallelism for what is not an expert: every other parameter is replicated on all ranks;
its gradient is averaged over the group during backward (:class:`~moebalance.nn.grad_sync.
GradientSync`), and the expert gradients are scaled the same way, so with each rank computing
transformers' usual mean loss over its own tokens (equal counts per rank) the gradients equal
those of one process on the global batch. DDP is a partner: the wrapped model lists its expert
slots in ``_ddp_params_and_buffers_to_ignore``, so a DDP around it (the user's, Lightning's, the
Hugging Face Trainer's) averages the other parameters, this sync steps aside at each forward
under one, and the expert replicas are still reduced here; the losses are the same either way.

Every rank starts from rank 0's weights: :func:`wrap` broadcasts them (as DDP does) before it
copies out this rank's experts, so unseeded ranks need no common seed. ``model.save_pretrained``
of a wrapped model on several ranks raises before writing anything: use :func:`save_pretrained`
(collective), which writes every expert.

Legend: T tokens on this rank, H hidden size, I expert hidden size, E experts, Ls local slots.
"""

from __future__ import annotations

import os
import warnings
import weakref

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..dispatch.dispatcher import Dispatcher
from ..frameworks import broadcast_from_rank0, check_ddp, exclude_experts_from_ddp
from ..nn.grad_sync import GradientSync
from ..nn.moe import compile_disabled
from ..nn.slots import ExpertSlots, current_placement, moe_layers
from ..nn.transient import check_transient, transient_weights
from ..placement import Placement
from ..topology import Topology
from .routers import attach, moe_blocks

__all__ = ["wrap", "unwrap", "unwrap_state_dict", "save_pretrained", "HFExpertSlots"]

GRAD_SCALES = ("mean", "sum")


def family_expert(x_MH: torch.Tensor, p: dict, slot: int, transposed: bool, activation
                  ) -> torch.Tensor:
    """One expert of a transformers MoE block on rows ``x_MH``: row ``slot`` of the fused
    parameters ``p`` (``name -> [n, ...]``). SwiGLU on ``gate_up_proj [n, 2I, H]`` / ``down_proj
    [n, H, I]``, or GPT-OSS's transposed form with biases and its own gate (``activation``)."""
    if transposed:
        gate_up = x_MH @ p["gate_up_proj"][slot] + p["gate_up_proj_bias"][slot]
        return activation(gate_up) @ p["down_proj"][slot] + p["down_proj_bias"][slot]
    gate, up = nn.functional.linear(x_MH, p["gate_up_proj"][slot]).chunk(2, dim=-1)
    return nn.functional.linear(activation(gate) * up, p["down_proj"][slot])


def family_arithmetic_error(name: str, experts: nn.Module) -> str | None:
    """Why ``experts`` must be refused, or None: its forward does not compute
    :func:`family_expert` (a family built otherwise would train wrong without an error). One
    token per expert (a fixed random probe, the user's random state untouched) through the
    module's own forward and through :func:`family_expert` on its rows; modules on the meta
    device (a loader's), forwards that cannot run here (a kernel refusing the dtype) and
    weights that give no finite answer (never initialised) are not probed."""
    gate_up = experts.gate_up_proj
    if gate_up.is_meta:
        return None
    transposed = isinstance(getattr(experts, "gate_up_proj_bias", None), torch.Tensor)
    activation = (type(experts)._apply_gate.__get__(experts) if transposed
                  else getattr(experts, "act_fn", None))
    if activation is None:
        return (f"{name} ({type(experts).__name__}) has no act_fn; wrap() serves experts that "
                f"compute act_fn(gate) * up on fused gate_up_proj")
    E = gate_up.shape[0]
    hidden = gate_up.shape[1] if transposed else gate_up.shape[2]
    # device="cpu" beside the CPU generator: Lightning's configure_model runs under a default
    # device (torch.device("cuda")), which a CPU generator refuses
    probe = torch.randn(E, hidden, generator=torch.Generator().manual_seed(0), device="cpu")
    x_EH = probe.to(device=gate_up.device, dtype=gate_up.dtype)
    ids = torch.arange(E, device=gate_up.device)[:, None]
    weights = torch.ones(E, 1, device=gate_up.device, dtype=gate_up.dtype)
    rows = {n: getattr(experts, n) for n in ("gate_up_proj", "gate_up_proj_bias", "down_proj",
                                             "down_proj_bias")
            if isinstance(getattr(experts, n, None), torch.Tensor)}
    with torch.no_grad():
        try:
            theirs = experts(x_EH, ids, weights)
        except Exception:       # noqa: BLE001 -- a forward that cannot run here is not probed
            return None
        ours = torch.cat([family_expert(x_EH[e:e + 1], rows, e, transposed, activation)
                          for e in range(E)])
        if theirs.shape != ours.shape:
            gap = float("inf")
        else:
            gap = float((theirs.double() - ours.double()).norm()
                        / ours.double().norm().clamp_min(1e-300))
    # 16-bit weights: a few roundings of a fused kernel; another arithmetic is off by O(1)
    tolerance = max(1e-5, 8 * torch.finfo(gate_up.dtype).eps)
    if gap <= tolerance or (gap != gap and theirs.shape == ours.shape):
        return None     # the same arithmetic, or weights that say nothing (NaN)
    return (f"{name} ({type(experts).__name__}) computes something other than the SwiGLU "
            f"experts of Mixtral / Qwen / DeepSeek (or GPT-OSS's form) that moebalance's slots "
            f"compute (relative difference {gap:.2g} on a probe): wrapping it would train it "
            f"wrong. Track its loads with mb.attach(model) and plan with mb.plan(), without "
            f"wrap()")


def check_family_arithmetic(blocks: list, group, world: int) -> None:
    """Probe each kind of experts module of ``blocks`` once (:func:`family_arithmetic_error`)
    and refuse on every rank alike: the verdict is rank 0's, whose weights every rank trains
    (ranks built without a common seed could hold weights that probe differently)."""
    error, seen = None, set()
    for name, block, _ in blocks:      # one probe per experts class: its arithmetic is code
        if error is None and type(block.experts) not in seen:
            seen.add(type(block.experts))
            error = family_arithmetic_error(f"{name}.experts", block.experts)
    if world > 1:
        verdict = [error]
        dist.broadcast_object_list(verdict, group_src=0, group=group)
        error = verdict[0]
    if error is not None:
        raise ValueError(error)


class HFExpertSlots(ExpertSlots):
    """This rank's expert slots of one transformers MoE block, served through the dispatcher.

    Built by :func:`wrap` from the block's original ``experts`` module (its rows copied by
    logical expert), or from ``rows`` (``name -> [Ls, ...]``, this rank's slot rows in slot
    order) that a loader read, the original then serving only for shapes and activation.
    Forward: ``(hidden [T, H], top_k_index [T, K], top_k_weights [T, K]) ->
    [T, H]``, like the module it replaces.
    """

    def __init__(self, original: nn.Module, router: nn.Module, placement: Placement, layer: int,
                 group=None, *, exchange: str = "auto", nodes=None, grad_scale: float = 1.0,
                 resplit: bool = True, speeds=None, rows: dict | None = None,
                 transient: int = 0, transient_cost: float | None = None) -> None:
        super().__init__()
        names = [n for n in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
                 if isinstance(getattr(original, n, None), torch.Tensor)]
        if "gate_up_proj" not in names or "down_proj" not in names:
            raise ValueError(f"{type(original).__name__} has no fused gate_up_proj / down_proj "
                             f"parameters; wrap() takes transformers 5.x MoE experts")
        num_experts = original.gate_up_proj.shape[0]
        self._check_placement(placement, layer, num_experts)
        self.num_experts = num_experts
        self.dispatcher = Dispatcher(group, exchange=exchange, nodes=nodes, resplit=resplit,
                                     speeds=speeds, transient=transient,
                                     transient_cost=transient_cost)
        check_transient(self.dispatcher.transient, self.dispatcher.world_size, "backward",
                        len(names))
        local = self.dispatcher.local_slots(placement, layer)
        experts = torch.from_numpy(placement.phy2log[layer, local.start:local.stop].copy())
        self._names = names
        for name in names:
            if rows is None:
                full = getattr(original, name).detach()
                slot_rows = full.index_select(0, experts.to(full.device)).clone()
            else:   # read by a loader (moebalance.from_pretrained); ``original`` may be on meta
                slot_rows = rows[name]
                expected = (len(experts), *getattr(original, name).shape[1:])
                if tuple(slot_rows.shape) != expected:
                    raise ValueError(f"rows[{name!r}] has shape {tuple(slot_rows.shape)}; this "
                                     f"rank's slots of layer {layer} need {expected}")
            setattr(self, name, nn.Parameter(slot_rows))
        # GPT-OSS: transposed, interleaved gate/up with a clamped activation; the others SwiGLU.
        self.transposed = "gate_up_proj_bias" in names
        if self.transposed:
            self.alpha = float(original.alpha)
            self.limit = float(original.limit)
            self._apply_gate = type(original)._apply_gate.__get__(self)
        else:
            self.act_fn = original.act_fn
        self.__dict__["_router"] = router          # a reference: the block owns the router
        self._init_slots(placement, layer, grad_sync="backward", grad_scale=grad_scale)

    def named_slot_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(name, getattr(self, name)) for name in self._names]

    def router_module(self) -> nn.Module:
        return self.__dict__["_router"]

    def _expert(self, slot: int, x_MH: torch.Tensor, rows: dict | None = None) -> torch.Tensor:
        """The original module's arithmetic for the expert in local ``slot`` (of ``rows``,
        ``name -> [n, ...]``, when given: the step's lent transient rows)."""
        p = rows if rows is not None else {name: getattr(self, name) for name in self._names}
        activation = self._apply_gate if self.transposed else self.act_fn
        return family_expert(x_MH, p, slot, self.transposed, activation)

    # torch.compile runs the experts' exchange as it is (a graph break; see ExpertParallelMoE)
    @compile_disabled
    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        self._commit_pending()
        x_TH = hidden_states.reshape(-1, hidden_states.shape[-1])
        recv_MH, handle = self.dispatcher.dispatch(x_TH, top_k_index, top_k_weights.to(x_TH.dtype),
                                                   self.placement, self.layer)
        timer = self.expert_timer           # a SpeedTracker's, when one times this layer
        if timer is not None:
            recv_MH = timer.begin(recv_MH)
        # Every slot runs, on zero rows too, so every rank joins the backward exchanges.
        chunks = torch.split(recv_MH, list(handle.tokens_per_local_slot))
        own = self.gate_up_proj.shape[0]
        ys = [self._expert(s, rows) for s, rows in enumerate(chunks[:own])]
        if handle.transient is not None:      # this step's transient slots, lent weights
            lent = dict(zip(self._names, transient_weights(self, handle.transient)))
            ys += [self._expert(k, rows, lent) for k, rows in enumerate(chunks[own:])]
        y_MH = torch.cat(ys)
        if timer is not None:
            y_MH = timer.end(y_MH)
        return self.dispatcher.combine(y_MH, handle).reshape(hidden_states.shape)


def wrap(model: nn.Module, topology: Topology, group=None, placement: Placement | None = None, *,
         exchange: str = "auto", nodes=None, grad_scale: str = "mean", resplit: bool = True,
         track: bool = True, transient: int = 0, transient_cost: float | None = None
         ) -> nn.Module:
    """Make a transformers 5.x MoE model expert-parallel over ``group``, in place.

    Call on every rank of the group, before creating the optimizer. Every rank gets rank 0's
    weights (a broadcast, as DDP does), so ranks built without a common seed agree.

    Args:
        model: a Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3 or GPT-OSS model (or any
            transformers 5.x model whose MoE blocks call ``self.experts(hidden, ids, weights)``).
        topology: the devices, one per rank of ``group``.
        group: the process group (None: the default group).
        placement: one row per MoE block, in module order; None plans one for uniform loads.
        exchange, nodes, resplit: dispatch options (see :class:`~moebalance.dispatch.Dispatcher`);
            ``nodes`` defaults to the topology's nodes.
        grad_scale: "mean" (default): gradients of the mean of the ranks' losses, which for
            transformers' mean loss over equal token counts per rank equals one process on the
            global batch; "sum": of their sum.
        track: attach a :class:`~moebalance.LoadTracker` (``model.moebalance_tracker``).
        transient, transient_cost: transient slots per rank, where a hot expert's weights are
            lent for one step (see :class:`~moebalance.nn.moe.ExpertParallelMoE`); 0: none.

    Returns:
        ``model``, its experts replaced by :class:`HFExpertSlots` (this rank's slots only).
    """
    if grad_scale not in GRAD_SCALES:
        raise ValueError(f"grad_scale must be one of {list(GRAD_SCALES)}, got {grad_scale!r}")
    blocks, placement = _check_wrap(model, topology, group, placement)
    check_family_arithmetic(blocks, group, topology.num_devices)
    return _install(model, blocks, placement, topology, group, exchange=exchange, nodes=nodes,
                    grad_scale=grad_scale, resplit=resplit, track=track, transient=transient,
                    transient_cost=transient_cost)


def _check_wrap(model: nn.Module, topology: Topology, group, placement: Placement | None
                ) -> tuple[list, Placement]:
    """The MoE blocks of ``model`` and the placement to serve them (given, or planned for
    uniform loads), after checking that they fit ``topology`` and ``group``."""
    from ..planner import plan

    if not isinstance(model, nn.Module):
        raise TypeError("model must be a torch.nn.Module (a transformers model), got "
                        f"{type(model).__name__}")
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be a moebalance.Topology, got {type(topology).__name__}")
    outer = next((m for m in model.modules()
                  if isinstance(m, nn.parallel.DistributedDataParallel)
                  or any(c.__name__ in ("FullyShardedDataParallel", "FSDPModule")
                         for c in type(m).__mro__)), None)
    if outer is not None:
        raise ValueError(
            f"the model is inside a {type(outer).__name__}, built before wrap(): it holds the "
            f"experts that wrap() replaces and would wait for their gradients. Call "
            f"mb.wrap(model, topology) first, then DistributedDataParallel(model) (it leaves the "
            f"expert slots alone); sharded wrappers (FSDP) are not supported")
    blocks = moe_blocks(model)
    if not blocks:
        raise ValueError(
            f"{type(model).__name__} has no MoE layer wrap() can serve: it looks for blocks whose "
            f"router (`gate` / `router`) sits beside an `experts` module with fused gate_up_proj / "
            f"down_proj parameters (transformers 5.x Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, "
            f"DeepSeek-V3, GPT-OSS); a dense model needs no expert parallelism")
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    if topology.num_devices != world:
        raise ValueError(f"topology has {topology.num_devices} devices but the group has {world} "
                         f"ranks; describe one device per rank")
    num_experts = {block.experts.gate_up_proj.shape[0] for _, block, _ in blocks}
    if len(num_experts) != 1:
        raise ValueError(f"the MoE blocks have different expert counts {sorted(num_experts)}; one "
                         f"placement covers blocks of one expert count")
    E = num_experts.pop()
    if topology.num_slots < E:
        raise ValueError(f"topology has {topology.num_slots} expert slots per layer in all, fewer "
                         f"than the {E} experts of each MoE block; give the devices at least "
                         f"{-(-E // topology.num_devices)} slots each")
    if placement is None:
        placement = plan(np.ones((len(blocks), E)), topology)
    elif not isinstance(placement, Placement):
        raise TypeError("placement must be a moebalance.Placement or None, got "
                        f"{type(placement).__name__}")
    if placement.num_layers != len(blocks) or placement.num_experts != E:
        raise ValueError(f"placement has {placement.num_layers} layers of {placement.num_experts} "
                         f"experts; the model has {len(blocks)} MoE blocks of {E}: plan one row "
                         f"per MoE block, in module order")
    placement.validate(topology)
    return blocks, placement


def _install(model: nn.Module, blocks: list, placement: Placement, topology: Topology, group, *,
             exchange: str, nodes, grad_scale: str, resplit: bool, track: bool,
             rows=None, transient: int = 0, transient_cost: float | None = None) -> nn.Module:
    """Swap each block's ``experts`` for :class:`HFExpertSlots` and set up the dense gradient sync.

    Args:
        rows: None (copy the slot rows out of each block's experts), or ``rows(layer) -> {name:
            [Ls, ...]}`` giving this rank's slot rows of MoE layer ``layer`` (a loader's).
    """

    world = topology.num_devices
    scale = 1.0 / world if grad_scale == "mean" else 1.0
    if world > 1 and rows is None:
        # A loader's rows and dense weights come from the same files on every rank already.
        broadcast_from_rank0(model, group)
    if nodes is None:
        nodes = topology.node
    # The replaced experts' parameters: nothing should hold them once they are swapped out
    originals = [] if rows is not None else [
        weakref.ref(p) for _, block, _ in blocks for p in block.experts.parameters(recurse=False)]
    for layer, (_, block, router) in enumerate(blocks):
        original = block.experts
        block.experts = HFExpertSlots(original, router, placement, layer, group, exchange=exchange,
                                      nodes=nodes, grad_scale=scale, resplit=resplit,
                                      speeds=topology.speed if resplit else None,
                                      rows=None if rows is None else rows(layer),
                                      transient=transient, transient_cost=transient_cost)
        del original
    if any(ref() is not None for ref in originals):
        warnings.warn("mb.wrap: the experts' original parameters are still held elsewhere, most "
                      "likely by an optimizer built before mb.wrap: it would update tensors the "
                      "wrapped model no longer uses, and the experts would not train. Build the "
                      "optimizer after mb.wrap", stacklevel=3)
    if world > 1:
        slot_ids = {id(p) for layer in moe_layers(model) for p in layer.slot_parameters()}
        dense = [p for p in model.parameters() if id(p) not in slot_ids]
        model.moebalance_sync = GradientSync(group, None, (), dense, scale=scale)
        model.register_forward_pre_hook(_DDPFollower(model, grad_scale, group))
    # The model's own save_pretrained would write slots, not experts: write the plain model on
    # one rank, refuse before writing anything on several.
    model.save_pretrained = _SavePretrained(model, world)
    if world > 1 and callable(getattr(model, "generate", None)):
        # Every rank's MoE layers join each step's exchange: a rank whose sequences end first
        # must keep stepping, or the others wait on it until the group's timeout.
        model.generate = _SyncedGenerate(model)
    exclude_experts_from_ddp(model)
    model.moebalance_topology = topology
    if track:
        model.moebalance_tracker = attach(model)
    return model


class _DDPFollower:
    """Forward pre-hook: under a DDP that leaves the slots alone, DDP averages the dense
    gradients and the model's own dense sync steps aside; without one, it runs."""

    def __init__(self, model: nn.Module, grad_scale: str, group) -> None:
        self.model = weakref.ref(model)
        self.grad_scale = grad_scale
        self.group = group

    def __call__(self, module, args):
        ddp = check_ddp(module, self.group)
        if ddp is not None and self.grad_scale == "sum":
            raise ValueError("wrap(grad_scale='sum') sums gradients over the ranks but the "
                             "DistributedDataParallel around this model averages them: wrap "
                             "with grad_scale='mean' (the default) under DDP")
        module.moebalance_sync.group_enabled = ddp is None


class _SavePretrained:
    """``model.save_pretrained`` of a wrapped model: on one rank it writes the plain model; on
    several it raises at once (it would write only this rank's experts), unless a framework
    callback redirected the save to :func:`save_pretrained` on every rank."""

    def __init__(self, model: nn.Module, world: int) -> None:
        self.model = weakref.ref(model)
        self.world = world
        self.redirected = False      # set by RebalanceTrainerCallback while the Trainer trains

    def __call__(self, save_directory, *args, **kwargs):
        model = self.model()
        if self.world == 1:
            kwargs.pop("state_dict", None)      # the slots' dict; the plain model's is written
            return save_pretrained(model, save_directory, *args, **kwargs)
        if self.redirected:
            return None              # the callback's on_save writes it, on every rank
        raise RuntimeError(
            f"{type(model).__name__}.save_pretrained on a model that moebalance.wrap spread over "
            f"{model.moebalance_topology.num_devices} ranks would write only this rank's experts; "
            f"call moebalance.save_pretrained(model, path) on every rank instead")

    def __reduce__(self):
        return (_SavePretrained, (self.model(), self.world))


class _SyncedGenerate:
    """``model.generate`` of a model spread over several ranks: transformers' ``generate`` with
    ``synced_gpus=True`` unless the caller says otherwise, so that ranks whose sequences end at
    different steps (their own ``eos_token_id``, stopping criteria, lengths) all run the same
    number of forward passes, as under DeepSpeed ZeRO-3 or FSDP."""

    def __init__(self, model: nn.Module) -> None:
        self.model = weakref.ref(model)

    def __call__(self, *args, **kwargs):
        model = self.model()
        kwargs.setdefault("synced_gpus", True)
        return type(model).generate(model, *args, **kwargs)

    def __reduce__(self):
        return (_SyncedGenerate, (self.model(),))


def unwrap_state_dict(model: nn.Module) -> dict:
    """The wrapped model's state dict in transformers' layout (every expert, by id). Collective."""
    from ..nn.checkpoint import expert_state_dict

    return expert_state_dict(model)["model"]


def unwrap(model: nn.Module) -> nn.Module:
    """A plain transformers model (a new one, same config) holding the wrapped model's weights.

    Collective: every rank of the group calls it; each gets the whole model. Its logits equal the
    wrapped model's. Needs ``type(model)(model.config)`` to build the model, as every
    transformers ``PreTrainedModel`` does.
    """
    return _plain_model(model, unwrap_state_dict(model))


def _plain_model(model: nn.Module, state: dict) -> nn.Module:
    """The plain transformers model of ``model``'s class holding ``state`` (transformers'
    layout, every expert by id)."""
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"{type(model).__name__} has no transformers config; use "
                         f"unwrap_state_dict(model) and load it into the plain model yourself")
    plain = type(model)(config)
    plain.to(next(model.parameters()).dtype)
    plain.load_state_dict(state, strict=True)
    return plain


def save_pretrained(model: nn.Module, path: str | os.PathLike, **kwargs) -> None:
    """Write the wrapped model as a plain transformers checkpoint (``from_pretrained`` loads it),
    with the placement beside it (``moebalance_placement.npz``). Collective; rank 0 writes."""
    write_pretrained(model, path, unwrap_state_dict(model), **kwargs)


def write_pretrained(model: nn.Module, path: str | os.PathLike, state: dict, **kwargs) -> None:
    """:func:`save_pretrained` of a state already gathered (``unwrap_state_dict(model)``, or the
    ``"model"`` entry of :func:`moebalance.nn.checkpoint.expert_state_dict`). Collective."""
    plain = _plain_model(model, state)
    placement = current_placement(model)
    kwargs.pop("state_dict", None)      # a framework's dict of the slots: the plain one is written
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if rank == 0:
        plain.save_pretrained(path, **kwargs)
        placement.save(os.path.join(os.fspath(path), "moebalance_placement.npz"))
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
