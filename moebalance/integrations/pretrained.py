"""``mb.from_pretrained(path, topology)``: a transformers MoE checkpoint loaded expert-parallel,
each rank reading only the experts its slots hold.

``mb.wrap`` needs the whole model on every rank first. Here the model is built on the meta
device (no memory), the parameters that are not experts are read from the checkpoint's
safetensors files and assigned in place, and each MoE block's experts module is replaced by
:class:`~moebalance.integrations.wrap.HFExpertSlots` holding rows read for this rank's slots
only (``safe_open(...).get_slice(name)[a:b]`` on a fused tensor, or the per-expert tensors of
the slots' experts), so no rank materialises an expert it does not serve. The result is what
``mb.wrap(model, topology, group, placement)`` returns for the same weights: the same
:func:`~moebalance.integrations.wrap._install` builds it.

Checkpoint layouts read (a local folder with ``config.json`` and ``model.safetensors`` or
``model.safetensors.index.json`` and its shards):

* transformers 5.x's ``save_pretrained`` (and :func:`moebalance.save_pretrained`, which calls
  it): by default the model family's original layout, one tensor per expert (Mixtral
  ``block_sparse_moe.experts.{e}.w1/w3/w2.weight``; Qwen2/3-MoE, OLMoE, DeepSeek-V3
  ``mlp.experts.{e}.gate_proj/up_proj/down_proj.weight``), or fused tensors for GPT-OSS and with
  ``save_original_format=False``: ``mlp.experts.gate_up_proj [E, 2I, H]``, ``down_proj
  [E, H, I]`` (GPT-OSS: ``[E, H, 2I]``, ``[E, I, H]`` and biases ``[E, 2I]``, ``[E, H]``).
* Key names go through transformers' own conversion mapping for the model (the renamings and
  the per-expert merges that its ``from_pretrained`` applies), so a key lands where transformers
  would put it; a mapping this loader cannot read row by row raises with the alternative.

Collective: every rank of ``group`` calls it with the same arguments; a failure on one rank
(a missing file, a bad argument) raises the same error on every rank.

Legend: L MoE layers, E experts, S global slots, Ls slots on this rank, H hidden size, I expert
hidden size.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..placement import Placement
from ..topology import Topology
from .wrap import GRAD_SCALES, _check_wrap, _install

__all__ = ["from_pretrained"]

_EXPERT_INDEX = re.compile(r"experts\.(\d+)\.")
_FIX = ("load it with transformers' from_pretrained and pass the model to mb.wrap")


def from_pretrained(path: str | os.PathLike, topology: Topology, placement: Placement | None = None,
                    group=None, *, model_class=None, dtype: torch.dtype | None = None,
                    attn_implementation: str | None = None, exchange: str = "auto", nodes=None,
                    grad_scale: str = "mean", resplit: bool = True, track: bool = True,
                    transient: int = 0, transient_cost: float | None = None,
                    torch_dtype: torch.dtype | None = None) -> nn.Module:
    """Load a transformers 5.x MoE checkpoint expert-parallel: this rank reads only its experts.

    Call on every rank of ``group`` with the same arguments, before creating the optimizer.

    Args:
        path: a local folder holding ``config.json`` and safetensors weights, as written by
            ``model.save_pretrained(path)`` or ``mb.save_pretrained(model, path)`` (a Hub model:
            download it first, e.g. ``huggingface_hub.snapshot_download(name)``).
        topology: the devices, one per rank of ``group``.
        placement: one row per MoE block, in module order; None plans one for uniform loads.
        group: the process group (None: the default group).
        model_class: the transformers class to build (default ``AutoModelForCausalLM``).
        dtype: parameter dtype (default: the config's ``dtype``, else float32); ``torch_dtype``,
            transformers' older name for it, is taken too.
        attn_implementation: as for transformers' ``from_pretrained`` ("eager", "sdpa",
            "flash_attention_2", ...; default: transformers' choice).
        exchange, nodes, grad_scale, resplit, track, transient, transient_cost: as for
            :func:`moebalance.wrap`.

    Returns:
        The model, in eval mode like transformers' ``from_pretrained``: every non-expert weight
        from the checkpoint, each MoE block's experts an
        :class:`~moebalance.integrations.wrap.HFExpertSlots` holding this rank's slots.

    Raises:
        ValueError / TypeError: naming the argument and the fix, on every rank of the group.
    """
    world, rank = _group_size(group)
    loaded, error = None, None
    try:
        if torch_dtype is not None:
            if dtype is not None:
                raise ValueError("give dtype= or torch_dtype= (its older name), not both")
            dtype = torch_dtype
        loaded = _load(path, topology, placement, world, rank, group, model_class, dtype,
                       grad_scale, attn_implementation)
    except Exception as exc:  # noqa: BLE001 - every rank raises it, below
        error = exc
    _agree(group, world, error, None if loaded is None else loaded[3])
    model, blocks, placement, _, rows = loaded
    return _install(model, blocks, placement, topology, group, exchange=exchange, nodes=nodes,
                    grad_scale=grad_scale, resplit=resplit, track=track,
                    rows=lambda layer: rows.pop(layer), transient=transient,
                    transient_cost=transient_cost)


def _group_size(group) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(group), dist.get_rank(group)
    return 1, 0


def _agree(group, world: int, error: Exception | None, digest: str | None) -> None:
    """Raise the same error on every rank if any rank failed or passed different arguments."""
    if world == 1:
        if error is not None:
            raise error
        return
    mine = None if error is None else (type(error).__name__, str(error).splitlines()[0][:800])
    everyone = [None] * world
    dist.all_gather_object(everyone, (mine, digest), group=group)
    failed = [(r, failure) for r, (failure, _) in enumerate(everyone) if failure is not None]
    if failed:
        first_rank, (kind, message) = failed[0]
        cls = {"TypeError": TypeError, "ValueError": ValueError}.get(kind, RuntimeError)
        if len(failed) < world:
            message = f"rank {first_rank}: {message}"
        raise cls(message) from error
    if len({d for _, d in everyone}) != 1:
        raise ValueError("the ranks passed different arguments (topology, placement, dtype or "
                         "checkpoint config); call mb.from_pretrained with the same ones on every "
                         "rank")


def _load(path, topology, placement, world: int, rank: int, group, model_class, dtype,
          grad_scale: str, attn_implementation: str | None = None):
    """(meta-built model, dense weights loaded; blocks; placement; digest; rows by layer)."""
    if grad_scale not in GRAD_SCALES:
        raise ValueError(f"grad_scale must be one of {list(GRAD_SCALES)}, got {grad_scale!r}")
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a folder path (str or os.PathLike), got "
                        f"{type(path).__name__}")
    folder = os.fspath(path)
    files = _safetensors_files(folder)
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype or None, got {type(dtype).__name__}")
    if attn_implementation is not None and not isinstance(attn_implementation, str):
        raise TypeError(f"attn_implementation must be a str (e.g. 'sdpa', 'eager') or None, got "
                        f"{type(attn_implementation).__name__}")
    model = _meta_model(folder, model_class, dtype, attn_implementation)
    blocks, placement = _check_wrap(model, topology, group, placement)
    digest = hashlib.sha256(b"".join([
        np.ascontiguousarray(topology.speed).tobytes(),
        np.ascontiguousarray(topology.slots).tobytes(),
        placement.phy2log.tobytes(), placement.share.tobytes(),
        str(next(model.parameters()).dtype).encode(), _config_text(model.config).encode(),
    ])).hexdigest()
    with contextlib.ExitStack() as stack:
        reader = _Checkpoint(model, files, stack)
        expert_prefixes = tuple(name + ".experts." for name, _, _ in blocks)
        _load_dense(model, reader, expert_prefixes)
        slots = np.flatnonzero(placement.slot_device == rank)
        rows = {}
        for layer, (name, block, _) in enumerate(blocks):
            experts = placement.phy2log[layer, slots]
            rows[layer] = {param: reader.expert_rows(f"{name}.experts.{param}", experts, like)
                           for param, like in block.experts.named_parameters(recurse=False)}
    return model, blocks, placement, digest, rows


def _config_text(config) -> str:
    """The config as text, without where it was read from (ranks may mount it apart)."""
    values = {k: v for k, v in config.to_dict().items() if k != "_name_or_path"}
    return json.dumps(values, sort_keys=True, default=str)


def _safetensors_files(folder: str) -> list[str]:
    if not os.path.isdir(folder):
        raise ValueError(f"path {folder!r} is not a folder; pass the folder a checkpoint was saved "
                         f"to (model.save_pretrained(path) or mb.save_pretrained(model, path)); "
                         f"download a Hub model first with huggingface_hub.snapshot_download")
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise ValueError(f"path {folder!r} has no config.json; save the model with "
                         f"model.save_pretrained(path) or mb.save_pretrained(model, path)")
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(folder, name) for name in shards]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise ValueError(f"path {folder!r}: the index names shards that are missing "
                             f"({', '.join(os.path.basename(m) for m in missing[:3])}); copy the "
                             f"whole checkpoint folder")
        return files
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    raise ValueError(f"path {folder!r} has no model.safetensors or model.safetensors.index.json; "
                     f"mb.from_pretrained reads safetensors checkpoints: save with "
                     f"model.save_pretrained(path) (safe_serialization, the default)")


def _meta_model(folder: str, model_class, dtype, attn_implementation: str | None = None
                ) -> nn.Module:
    """The model built from ``folder``'s config on the meta device (no weights allocated)."""
    import transformers as tf

    config = tf.AutoConfig.from_pretrained(folder)
    if dtype is None:
        dtype = getattr(config, "dtype", None)
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype, None)
        if not isinstance(dtype, torch.dtype):
            dtype = torch.float32
    cls = tf.AutoModelForCausalLM if model_class is None else model_class
    build = getattr(cls, "from_config", None) or getattr(cls, "_from_config", None)
    if build is None:
        raise TypeError(f"model_class must be a transformers model class or auto class, got "
                        f"{cls!r}")
    options = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    with torch.device("meta"):
        model = build(config, dtype=dtype, **options)
    generation = os.path.join(folder, "generation_config.json")
    if os.path.isfile(generation) and getattr(model, "generation_config", None) is not None:
        model.generation_config = tf.GenerationConfig.from_pretrained(folder)
    return model


class _Checkpoint:
    """Where each model tensor sits in the checkpoint's files, in the model's own names.

    File keys go through transformers' conversion mapping for ``model``: a renamed key is a
    model tensor (dense, or a fused expert tensor stored as such); a key that a per-expert merge
    would collect is one expert's part of a fused tensor (``parts[target][(expert, part)]``).
    """

    def __init__(self, model: nn.Module, files: list[str], stack: contextlib.ExitStack) -> None:
        from safetensors import safe_open
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            Concatenate,
            MergeModulelist,
            WeightConverter,
            WeightRenaming,
            rename_source_key,
        )

        transforms = get_model_conversion_mapping(model)
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        meta_state = model.state_dict()
        self.whole: dict[str, tuple] = {}        # model key -> (file handle, file key)
        self.parts: dict[str, dict] = {}         # fused model key -> {(e, part): (handle, key)}
        self.concat_dim: dict[str, int] = {}     # fused model key -> dim its parts join along
        for file in files:
            handle = stack.enter_context(safe_open(file, framework="pt"))
            for key in handle.keys():
                target, pattern = rename_source_key(key, renamings, converters,
                                                    model.base_model_prefix, meta_state)
                if pattern is None:
                    self.whole[target] = (handle, key)
                    continue
                converter = next(c for c in converters if pattern in c.source_patterns)
                ops = [type(op) for op in converter.operations]
                found = _EXPERT_INDEX.search(key)
                if found is None or ops not in ([MergeModulelist], [MergeModulelist, Concatenate]):
                    raise ValueError(f"checkpoint key {key!r} is converted by {converter!r}, which "
                                     f"mb.from_pretrained cannot read per expert; {_FIX}")
                if len(ops) == 2:
                    self.concat_dim[target] = converter.operations[1].dim - 1
                part = converter.source_patterns.index(pattern)
                self.parts.setdefault(target, {})[(int(found.group(1)), part)] = (handle, key)

    def tensor(self, name: str, like: torch.Tensor) -> torch.Tensor | None:
        """The whole tensor ``name`` as ``like``'s dtype, or None if the checkpoint lacks it."""
        entry = self.whole.get(name)
        if entry is None:
            return None
        handle, key = entry
        value = handle.get_tensor(key)
        if tuple(value.shape) != tuple(like.shape):
            raise ValueError(f"checkpoint tensor {key!r} has shape {tuple(value.shape)} but the "
                             f"model built from its config.json needs {tuple(like.shape)}; the "
                             f"config and the weights disagree: re-save the checkpoint")
        return value.to(like.dtype)

    def expert_rows(self, name: str, experts: np.ndarray, like: torch.Tensor) -> torch.Tensor:
        """[Ls, ...] rows ``experts`` (slot order) of fused expert tensor ``name`` [E, ...]."""
        row_shape = tuple(like.shape[1:])
        entry = self.whole.get(name)
        if entry is not None:
            handle, key = entry
            sliced = handle.get_slice(key)
            if tuple(sliced.get_shape()) != tuple(like.shape):
                raise ValueError(f"checkpoint tensor {key!r} has shape {tuple(sliced.get_shape())} "
                                 f"but the model built from its config.json needs "
                                 f"{tuple(like.shape)}; re-save the checkpoint")
            # Runs of consecutive experts: one read each, only these rows leave the file.
            chunks, start = [], 0
            for i in range(1, len(experts) + 1):
                if i == len(experts) or experts[i] != experts[i - 1] + 1:
                    chunks.append(sliced[int(experts[start]):int(experts[i - 1]) + 1])
                    start = i
            rows = torch.cat(chunks) if len(chunks) > 1 else chunks[0]
            return rows.to(like.dtype)
        parts = self.parts.get(name)
        if parts is None:
            raise ValueError(f"the checkpoint has no tensor for {name!r} (neither fused nor one "
                             f"per expert); it does not match the model its config.json builds")
        num_parts = 1 + max(part for _, part in parts)
        dim = self.concat_dim.get(name, 0)
        rows = torch.empty((len(experts), *row_shape), dtype=like.dtype)
        for slot, expert in enumerate(experts):
            pieces = []
            for part in range(num_parts):
                entry = parts.get((int(expert), part))
                if entry is None:
                    raise ValueError(f"the checkpoint lacks part {part} of expert {int(expert)} "
                                     f"of {name!r}; re-save the checkpoint")
                pieces.append(entry[0].get_tensor(entry[1]))
            joined = torch.cat(pieces, dim=dim) if num_parts > 1 else pieces[0]
            if tuple(joined.shape) != row_shape:
                raise ValueError(f"expert {int(expert)} of {name!r} has shape "
                                 f"{tuple(joined.shape)} in the checkpoint; the model built from "
                                 f"its config.json needs {row_shape}: re-save the checkpoint")
            rows[slot] = joined
        return rows


def _load_dense(model: nn.Module, reader: _Checkpoint, expert_prefixes: tuple[str, ...]) -> None:
    """Assign every parameter and buffer outside the experts from the checkpoint, in place."""
    state = {}
    for name, like in model.state_dict(keep_vars=True).items():
        if name.startswith(expert_prefixes):
            continue
        value = reader.tensor(name, like)
        if value is not None:
            state[name] = value
    model.load_state_dict(state, strict=False, assign=True)
    for value in state.values():
        value._is_hf_initialized = True
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    # What is still on meta: non-persistent buffers (rotary frequencies), which transformers
    # computes with its own initialiser after a meta-device build, as its from_pretrained does.
    for module_name, module in model.named_modules():
        if module_name.startswith(tuple(p.rstrip(".") for p in expert_prefixes)):
            continue
        missing = [n for n, p in module.named_parameters(recurse=False) if p.is_meta]
        if missing:
            names = ", ".join(f"{module_name}.{n}" for n in missing)
            raise ValueError(f"the checkpoint lacks {names}; it does not match the model its "
                             f"config.json builds (or model_class builds another head)")
        meta = [n for n, b in module.named_buffers(recurse=False) if b.is_meta]
        if not meta:
            continue
        for n in meta:   # NaN: an initialiser that skips a buffer is caught below
            like = module._buffers[n]
            module._buffers[n] = (torch.full_like(like, float("nan"), device="cpu")
                                  if like.is_floating_point()
                                  else torch.zeros_like(like, device="cpu"))
        init = getattr(model, "_init_weights", None)
        if init is not None:
            with torch.no_grad():
                init(module)
        unset = [n for n in meta if module._buffers[n].is_floating_point()
                 and torch.isnan(module._buffers[n]).any()]
        if unset:
            names = ", ".join(f"{module_name}.{n}" for n in unset)
            raise ValueError(f"buffers {names} are neither in the checkpoint nor set by the "
                             f"model's initialiser; {_FIX}")
    model.eval()
