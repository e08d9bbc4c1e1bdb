"""Expert-parallel layers inside DDP and the training frameworks: slots kept out, rank 0's weights.

Whoever wraps a moebalance model in ``DistributedDataParallel`` (the user, Lightning's DDP
strategy, accelerate inside the Hugging Face Trainer) must leave the expert slots alone: each
rank holds *other* experts in the same slot rows, so DDP's start-up broadcast would copy rank 0's
experts over every rank's (same shapes: nothing fails) and its gradient averaging would mix
unrelated experts. Every DDP reads the list ``module._ddp_params_and_buffers_to_ignore`` of the
module it wraps when it is built; :func:`exclude_experts_from_ddp` sets it to an
:class:`ExpertSlotNames`, which names the slot tensors under that module *when DDP reads it*, so
it may be set before the model is wrapped or its layers exist (Lightning's ``configure_model``).
:func:`moebalance.wrap` and :class:`~moebalance.ExpertParallelMoE` set it on themselves.

At each forward the layers look for the DDP that runs them (:func:`active_ddp`): under one, DDP
averages every other parameter's gradient and moebalance reduces only the expert replicas; a DDP
that holds the slots raises at once, naming the fix, instead of training silently wrong.

Also here: :func:`broadcast_from_rank0` (every rank starts from rank 0's weights, as DDP does),
:func:`check_optimizer` (an optimizer built before ``mb.wrap`` holds none of the slot
tensors) and a one-time warning when ``torch.nn.utils.clip_grad_norm_`` clips the gradients of
expert slots per rank (:func:`moebalance.clip_grad_norm_` clips by the global norm).
"""

from __future__ import annotations

import functools
import math
import warnings
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .collective_errors import backends

__all__ = ["ExpertSlotNames", "slot_names", "exclude_experts_from_ddp", "active_ddp",
           "check_ddp", "broadcast_from_rank0", "check_optimizer", "warn_on_per_rank_clipping"]

IGNORE_ATTR = "_ddp_params_and_buffers_to_ignore"
SLOT_MARK = "_moebalance_slot"      # set on every slot parameter (read by the clip warning)
BROADCAST_BUCKET_BYTES = 64 << 20


def _slot_layers(module: nn.Module):
    """(name, layer) of every expert-parallel layer under ``module``: the modules with slot
    parameters (ExpertSlots, recognised by its interface: this module sits below it)."""
    return [(name, m) for name, m in module.named_modules()
            if callable(getattr(m, "named_slot_parameters", None))]


def slot_names(module: nn.Module) -> list[str]:
    """Names, relative to ``module``, of every expert slot parameter and per-rank buffer under it.

    A tensor directly on ``module`` is named twice (``"x"`` and ``".x"``): DDP's reducer spells
    the names of the wrapped module's own tensors with a leading dot.
    """
    names = []
    for prefix, layer in _slot_layers(module):
        router = layer.router_module()
        router_buffers = {id(b) for b in router.buffers()} if router is not None else set()
        local = [name for name, _ in layer.named_slot_parameters()]
        local += [name for name, b in layer.named_buffers() if id(b) not in router_buffers]
        for name in local:
            full = f"{prefix}.{name}" if prefix else name
            names.append(full)
            if "." not in full:
                names.append("." + full)
    return names


class ExpertSlotNames:
    """The slot tensor names under a module, computed each time they are read (see the module doc).

    Args:
        module: the module DDP will wrap (held by weak reference).
        extra: names the module already asked DDP to ignore, kept.
    """

    def __init__(self, module: nn.Module, extra=()) -> None:
        self._module = weakref.ref(module)
        self.extra = [str(name) for name in extra]

    def names(self) -> list[str]:
        module = self._module()
        return self.extra + (slot_names(module) if module is not None else [])

    def __iter__(self):
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def __contains__(self, name) -> bool:
        return name in self.names()

    def __repr__(self) -> str:
        return f"ExpertSlotNames({self.names()!r})"

    def __reduce__(self):
        # Copies and pickles of the module name the copy's tensors (the module is in the memo).
        module = self._module()
        if module is None:
            return (list, (self.extra,))
        return (ExpertSlotNames, (module, self.extra))


def exclude_experts_from_ddp(module: nn.Module) -> nn.Module:
    """Keep the expert slots under ``module`` out of any DDP that wraps ``module``; returns it.

    Call it on the module you (or your framework) hand to ``DistributedDataParallel``, before
    DDP is built, if that module is not the one :func:`moebalance.wrap` returned or an
    :class:`~moebalance.ExpertParallelMoE` (those do it themselves). The names are computed when
    DDP reads them, so a model whose layers are wrapped later is covered too. Names the module
    already asked DDP to ignore are kept.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    current = getattr(module, IGNORE_ATTR, None)
    if isinstance(current, ExpertSlotNames):
        return module
    extra = list(current) if current is not None else []
    # Assigned through __dict__ like DDP's own setter does, past nn.Module.__setattr__.
    module.__dict__[IGNORE_ATTR] = ExpertSlotNames(module, extra)
    return module


def active_ddp(module: nn.Module):
    """The ``DistributedDataParallel`` whose forward is running ``module`` now, or None."""
    ddp = nn.parallel.DistributedDataParallel._get_active_ddp_module()
    if ddp is None:
        return None
    inner = ddp.module
    if inner is module or any(m is module for m in inner.modules()):
        return ddp
    return None


_checked: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def check_ddp(module: nn.Module, group=None):
    """At a forward of ``module``: the DDP running it (or None), once it is known to leave the
    expert slots alone and to average over the ranks of ``group``, the process group the
    module's expert-parallel layers span (None: the default group). Raises RuntimeError (on
    every rank alike) otherwise."""
    ddp = active_ddp(module)
    if ddp is None or _checked.get(ddp) is True:
        return ddp
    ddp_ranks = dist.get_process_group_ranks(ddp.process_group)
    layer_ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    if ddp_ranks != layer_ranks:
        # Megatron's layout (expert-parallel groups, data parallel across them): DDP leaves the
        # slots alone, so the experts of one group would never meet those of the others.
        raise RuntimeError(
            f"DistributedDataParallel averages over {len(ddp_ranks)} ranks but the "
            f"expert-parallel layers span {len(layer_ranks)} (their group): moebalance keeps the "
            "experts of a layer once over its group, and nothing would keep another group's "
            "copies equal. Build the layers over the DDP's ranks (mb.wrap(model, topology) with "
            "one device per rank of the job); the topology's slots give busy experts their "
            "replicas")
    ignored = set(ddp.parameters_to_ignore)
    held = [name for name in slot_names(ddp.module)
            if not name.startswith(".") and name not in ignored]
    if held:
        raise RuntimeError(
            "DistributedDataParallel holds the expert slots "
            f"{held[:3]}{' ...' if len(held) > 3 else ''}: its start-up broadcast has already "
            "copied rank 0's experts over the other ranks'. Call "
            "moebalance.exclude_experts_from_ddp(module) on the module you give DDP, before "
            "building it (moebalance.wrap and ExpertParallelMoE do it for themselves)")
    _checked[ddp] = True
    return ddp


def broadcast_from_rank0(module: nn.Module, group=None) -> None:
    """Copy rank 0's parameters and buffers onto every rank of ``group`` (as DDP does at start).

    Collective. Tensors travel in flat buckets of one dtype and device, in module order.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return
    tensors = [t for t in list(module.parameters()) + list(module.buffers())
               if t.device.type != "meta"]
    seen, unique = set(), []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            unique.append(t)
    buckets: dict = {}
    for t in unique:
        buckets.setdefault((t.dtype, t.device), []).append(t)
    served = backends(group)
    with torch.no_grad():
        for bucket_tensors in buckets.values():
            chunk, size = [], 0
            for t in bucket_tensors + [None]:
                if t is not None and (not chunk or size + t.numel() * t.element_size()
                                      <= BROADCAST_BUCKET_BYTES):
                    chunk.append(t)
                    size += t.numel() * t.element_size()
                    continue
                flat = _flatten_dense_tensors([c.detach() for c in chunk])
                if flat.device.type not in served:
                    # e.g. a model still on the CPU in an NCCL-only group: through the GPU
                    flat = flat.to(torch.device("cuda", torch.cuda.current_device()))
                dist.broadcast(flat, group_src=0, group=group)
                flat = flat.to(chunk[0].device)
                for c, value in zip(chunk, _unflatten_dense_tensors(flat, chunk)):
                    c.copy_(value)
                chunk, size = ([t], t.numel() * t.element_size()) if t is not None else ([], 0)


def check_optimizer(model: nn.Module, optimizer) -> None:
    """Raise ValueError unless ``optimizer`` updates every expert slot parameter of ``model``."""
    if optimizer is None:
        return
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if type(optimizer).__name__ == "ZeroRedundancyOptimizer" and any(
            id(p) in held for _, layer in _slot_layers(model) for p in layer.slot_parameters()):
        # It broadcasts every parameter from the one rank that updates it: one rank's expert
        # slots would overwrite every other rank's (same shapes, nothing fails).
        raise ValueError(
            "optimizer is a ZeroRedundancyOptimizer over the expert slots: it broadcasts each "
            "parameter from the rank that owns it, which would copy one rank's experts over "
            "every other rank's. Give the slots a per-rank optimizer, e.g. "
            "torch.optim.AdamW(model.parameters())")
    missing = [f"{prefix}.{name}" if prefix else name
               for prefix, layer in _slot_layers(model)
               for name, p in layer.named_slot_parameters()
               if p.requires_grad and id(p) not in held]
    if missing:
        raise ValueError(
            f"optimizer does not update the expert slot parameters {missing[:3]}"
            f"{' ...' if len(missing) > 3 else ''} of this model (an optimizer built before "
            f"moebalance.wrap holds the replaced experts): create the optimizer after mb.wrap")


def mark_slot_parameters(params) -> None:
    """Tag slot parameters for the per-rank clipping warning and install it (once)."""
    for p in params:
        setattr(p, SLOT_MARK, True)
    warn_on_per_rank_clipping()


_warned = False
_checks_left = 20          # reads of a GPU norm (each a host sync) before the check gives up
CLIPPED_MARK = "_moebalance_globally_clipped"   # set on gradients mb.clip_grad_norm_ scaled


def warn_on_per_rank_clipping() -> None:
    """Make ``torch.nn.utils.clip_grad_norm_`` warn once when it clips expert slot gradients per
    rank in a group of several ranks (ranks, and replicas of one expert, would scale apart).

    Reading a GPU norm is a host sync: the check skips gradients ``mb.clip_grad_norm_`` has
    just clipped (a framework's own clip after it is a no-op), an infinite ``max_norm``, and
    gives up on GPU norms after :data:`_checks_left` calls."""
    original = torch.nn.utils.clip_grad_norm_
    if getattr(original, "_moebalance_checked", False):
        return

    @functools.wraps(original)
    def clip_grad_norm_(parameters, max_norm, *args, **kwargs):
        global _warned, _checks_left
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        parameters = list(parameters)
        norm = original(parameters, max_norm, *args, **kwargs)
        if (_warned or not dist.is_available() or not dist.is_initialized()
                or dist.get_world_size() == 1 or not math.isfinite(float(max_norm))):
            return norm
        slots = [p for p in parameters if getattr(p, SLOT_MARK, False) and p.grad is not None]
        # Not after mb.clip_grad_norm_ (Lightning clips again to the same value: a no-op).
        if not slots or getattr(slots[0].grad, CLIPPED_MARK, False):
            return norm
        if norm.device.type != "cpu":
            if _checks_left <= 0:
                return norm
            _checks_left -= 1
        if bool(norm > max_norm):
            _warned = True
            warnings.warn(
                "torch.nn.utils.clip_grad_norm_ clipped expert slot gradients by this rank's own "
                "norm: ranks (and the replicas of one expert) scale apart. Clip with "
                "moebalance.clip_grad_norm_(model, max_norm), the global norm, instead",
                RuntimeWarning, stacklevel=2)
        return norm

    clip_grad_norm_._moebalance_checked = True
    torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
