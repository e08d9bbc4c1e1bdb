"""Checkpoints by logical expert: save under one placement, load under any placement and world size.

A slot row is storage, not identity: after a migration row 3 of rank 1 may hold a different
expert than it did. A per-rank ``state_dict()`` resumes only the same placement on the same
ranks. The functions here instead store every expert once, by logical id, in the layout of
:class:`~moebalance.nn.moe.DenseMoE` (``experts.gate_up [E, 2F, D]``, ``experts.down [E, D, F]``),
with the placement beside it, so that the result loads

* into a model of expert-parallel layers under any other placement and any world size
  (:func:`load_expert_state_dict` picks each rank's rows by its slots' experts), and
* into the same model built from DenseMoE layers (``model.load_state_dict(state["model"])``).

Optimizer state goes the same way: every state tensor shaped like an expert slot tensor is
stored per logical expert (rows of an expert's replicas are identical, so its first holder
speaks for all), other state (``step``, the router's moments) as it is.

A migration in flight is finished before the save (the layers' staged rows commit; no
optimizer step has passed since they were read, so that is exact).
"""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist
from torch import nn

from ..placement import Placement
from .slots import ExpertSlots, current_placement, first_holder_rows, moe_layers

__all__ = ["expert_state_dict", "load_expert_state_dict", "save", "load"]

def _drain(layers) -> None:
    for layer in layers:
        if layer.pending_migration is not None:
            layer.pending_migration.wait()


def _layer_prefixes(module: nn.Module) -> dict[int, str]:
    return {id(m): (name + "." if name else "") for name, m in module.named_modules()
            if isinstance(m, ExpertSlots)}


# Bytes of a layer's gathered rows in flight at once on an accelerator: a whole layer's (every
# expert of a DeepSeek-V3 layer's gate_up is ~15 GB in bf16, its Adam moments twice that in fp32)
# would not fit on a GPU beside the model.
GATHER_CHUNK_BYTES = 256 << 20


def _gather_rows(rows_L: torch.Tensor, layer: ExpertSlots) -> torch.Tensor:
    """[E, ...] on the CPU by logical expert from every rank's [Ls, ...] slot rows (collective
    SUM, each expert from its first holder alone: exact), in chunks of experts of at most
    ``GATHER_CHUNK_BYTES``."""
    E, device = layer.placement.num_experts, rows_L.device
    out = torch.zeros((E, *rows_L.shape[1:]), dtype=rows_L.dtype)
    mine = first_holder_rows(layer)
    # a copy: a planned placement's arrays are read-only, and torch warns on viewing them
    experts = torch.tensor(layer.local_experts, dtype=torch.int64)[mine]
    rows = rows_L.detach().index_select(0, mine.to(device))
    if layer.dispatcher.world_size == 1:
        return out.index_copy_(0, experts, rows.cpu())
    row_bytes = max(1, math.prod(rows_L.shape[1:]) * rows_L.element_size())
    step = max(1, GATHER_CHUNK_BYTES // row_bytes)
    for start in range(0, E, step):
        stop = min(E, start + step)
        # On the CPU the result's own rows are reduced in place; elsewhere a chunk on the device.
        chunk = out[start:stop] if device.type == "cpu" else rows.new_zeros(out[start:stop].shape)
        inside = torch.nonzero((experts >= start) & (experts < stop)).squeeze(1)
        chunk.index_copy_(0, (experts[inside] - start).to(device),
                          rows.index_select(0, inside.to(device)))
        dist.all_reduce(chunk, op=dist.ReduceOp.SUM, group=layer.dispatcher.group)
        if chunk.device.type != "cpu":
            out[start:stop].copy_(chunk)
    return out


def expert_state_dict(module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """The model (and optimizer) state with every expert stored once, by logical id. Collective.

    Args:
        module: a model holding expert-parallel layers (or one such layer).
        optimizer: its optimizer, or None.

    Returns:
        ``{"model": state dict in DenseMoE layout, "optimizer": {...} or None,
        "placement": {"phy2log", "share", "slot_device", "num_experts"}}``, the same on every rank,
        every tensor on the CPU (the whole model's experts gathered would not fit beside it on
        a GPU).
    """
    layers = moe_layers(module)
    if not layers:
        raise ValueError(f"{type(module).__name__} holds no expert-parallel layer")
    _drain(layers)
    prefixes = _layer_prefixes(module)
    state = {k: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v
             for k, v in module.state_dict().items()}
    slot_owner = {}
    for layer in layers:
        pre = prefixes[id(layer)]
        state.pop(pre + "_extra_state", None)
        for name, param in layer.named_slot_parameters():
            state[pre + name] = _gather_rows(param, layer)
            slot_owner[id(param)] = layer
    placement = current_placement(module)
    out = {"model": state, "optimizer": None,
           "placement": {"phy2log": torch.from_numpy(placement.phy2log.copy()),
                         "share": torch.from_numpy(placement.share.copy()),
                         "slot_device": torch.from_numpy(placement.slot_device.copy()),
                         "num_experts": placement.num_experts}}
    if optimizer is not None:
        names = {id(p): fqn for fqn, p in module.named_parameters()}
        per_param, groups = {}, []
        for group in optimizer.param_groups:
            groups.append({**{k: v for k, v in group.items() if k != "params"},
                           "params": [names[id(p)] for p in group["params"] if id(p) in names]})
            for p in group["params"]:
                if id(p) not in names:
                    continue
                logical, other = {}, {}
                for key, value in optimizer.state.get(p, {}).items():
                    if id(p) in slot_owner and isinstance(value, torch.Tensor) \
                            and value.shape == p.shape:
                        logical[key] = _gather_rows(value, slot_owner[id(p)])
                    else:
                        other[key] = (value.detach().to("cpu", copy=True)
                                      if isinstance(value, torch.Tensor) else value)
                per_param[names[id(p)]] = {"logical": logical, "other": other}
        out["optimizer"] = {"state": per_param, "param_groups": groups}
    return out


def load_expert_state_dict(module: nn.Module, state: dict,
                           optimizer: torch.optim.Optimizer | None = None) -> None:
    """Load :func:`expert_state_dict` output into ``module``'s current placement, any world size.

    Each expert-parallel layer takes the rows of the experts its slots hold now; every other
    parameter loads as saved. With ``optimizer`` (built over ``module``'s parameters) its state
    is restored the same way and its hyperparameters set to the saved ones.
    """
    if not isinstance(state, dict) or "model" not in state:
        raise ValueError("state must be the dict returned by "
                         "moebalance.nn.checkpoint.expert_state_dict (or loaded "
                         "by moebalance.nn.checkpoint.load)")
    layers = moe_layers(module)
    _drain(layers)
    prefixes = _layer_prefixes(module)
    model_state = dict(state["model"])
    slot_rows = {}
    for layer in layers:
        pre = prefixes[id(layer)]
        local = torch.from_numpy(layer.local_experts.copy())
        num_experts = layer.placement.num_experts
        for name, param in layer.named_slot_parameters():
            key = pre + name
            full = model_state.get(key)
            if full is None or full.shape[0] != num_experts:
                raise ValueError(f"{key} in state must hold all {num_experts} experts by logical "
                                 f"id, got {None if full is None else tuple(full.shape)}")
            model_state[key] = full.index_select(0, local.to(full.device))
            slot_rows[id(param)] = local
        model_state[pre + "_extra_state"] = layer.get_extra_state()
    module.load_state_dict(model_state, strict=True)
    if optimizer is None:
        return
    saved = state.get("optimizer")
    if saved is None:
        raise ValueError("state holds no optimizer state; save it with "
                         "expert_state_dict(model, optimizer)")
    params = dict(module.named_parameters())
    for group, saved_group in zip(optimizer.param_groups, saved["param_groups"]):
        group.update({k: v for k, v in saved_group.items() if k != "params"})
    group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    for fqn, entry in saved["state"].items():
        p = params.get(fqn)
        if p is None:
            raise ValueError(f"optimizer state for {fqn!r} has no parameter in this model")
        restored = {k: _placed(v, k, p, group_of.get(id(p), {}))
                    for k, v in entry["other"].items()}
        for k, full in entry["logical"].items():
            # index_select makes a new tensor: moved, it is copied no further
            restored[k] = full.index_select(0, slot_rows[id(p)].to(full.device)).to(p.device)
        if restored:
            optimizer.state[p] = restored


def _placed(value, key: str, param: torch.Tensor, group: dict):
    """A saved optimizer state value where ``torch.optim.Optimizer.load_state_dict`` would put it
    (the checkpoint is read onto the CPU): beside its parameter, in its dtype if floating; but
    Adam's ``step`` stays on the CPU unless the group is fused or capturable."""
    if not isinstance(value, torch.Tensor):
        return value
    if key == "step":
        if group.get("fused") or group.get("capturable"):
            return value.to(dtype=torch.float32, device=param.device, copy=True)
        return value.clone()
    if param.is_floating_point() and value.is_floating_point():
        return value.to(dtype=param.dtype, device=param.device, copy=True)
    return value.to(device=param.device, copy=True)


def save(path: str | os.PathLike, module: nn.Module, optimizer=None) -> None:
    """Write :func:`expert_state_dict` to ``path`` from rank 0 of the default group. Collective."""
    state = expert_state_dict(module, optimizer)
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if rank == 0:
        tmp = os.fspath(path) + ".tmp"
        torch.save(state, tmp)
        os.replace(tmp, path)     # a reader never sees half a checkpoint
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def load(path: str | os.PathLike, module: nn.Module, optimizer=None) -> Placement:
    """Load a :func:`save` file into ``module`` (any placement, any world size).

    Returns:
        The :class:`~moebalance.Placement` the checkpoint was saved under (for a re-plan).
    """
    state = torch.load(path, map_location="cpu", weights_only=True)
    load_expert_state_dict(module, state, optimizer)
    p = state["placement"]
    return Placement(p["phy2log"].numpy(), p["share"].numpy(), p["slot_device"].numpy(),
                     int(p["num_experts"]))
