"""Argument checks shared by every dispatch kernel backend (reference, Numba, CUDA).

Each ``check_<kernel>`` raises TypeError/ValueError naming the argument, what it must be and
what was received; the ``check_*_values`` functions read index ranges and run for CPU tensors
only: on an accelerator reading a minimum and maximum on the host would stall every step (the
Dispatcher checks expert ids through its counts exchange, and the other indices come from the
kernels themselves).

Legend: T tokens, K top-k, D hidden size, E logical experts, X most replicas of an expert,
S global slots, N = T*K routed pairs, M rows of a gathered source.
"""

from __future__ import annotations

import torch

from .._check import positive_int

FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _tensor(x, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def _int64(x, name: str, ndim: int, shape_doc: str) -> torch.Tensor:
    x = _tensor(x, name)
    if x.dtype != torch.int64:
        raise TypeError(f"{name} must be an int64 tensor {shape_doc}, got dtype {x.dtype}; "
                        f"convert with .long()")
    if x.dim() != ndim:
        raise ValueError(f"{name} must have shape {shape_doc}, got shape {tuple(x.shape)}")
    return x


def _floats(x, name: str, ndim: int, shape_doc: str) -> torch.Tensor:
    x = _tensor(x, name)
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a float32/float64/bfloat16/float16 tensor {shape_doc}, "
                        f"got dtype {x.dtype}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must have shape {shape_doc}, got shape {tuple(x.shape)}")
    return x


def _same_device(name: str, x: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if x.device != ref.device:
        raise ValueError(f"{name} is on {x.device} but {ref_name} is on {ref.device}; "
                         f"move both to one device")


def check_route(topk_ids_TK, rank_TK, slots_EX, bounds_EX) -> None:
    """Raise TypeError/ValueError unless the arguments of :func:`route` are well formed."""
    _int64(topk_ids_TK, "topk_ids_TK", 2, "[T, K]")
    _int64(rank_TK, "rank_TK", 2, "[T, K]")
    _int64(slots_EX, "slots_EX", 2, "[E, X]")
    _int64(bounds_EX, "bounds_EX", 2, "[E, X]")
    if rank_TK.shape != topk_ids_TK.shape:
        raise ValueError(f"rank_TK must have the shape of topk_ids_TK {tuple(topk_ids_TK.shape)}, "
                         f"got {tuple(rank_TK.shape)}")
    if bounds_EX.shape != slots_EX.shape:
        raise ValueError(f"bounds_EX must have the shape of slots_EX {tuple(slots_EX.shape)}, "
                         f"got {tuple(bounds_EX.shape)}; build both from one RouteTable")
    if slots_EX.shape[0] < 1 or slots_EX.shape[1] < 1:
        raise ValueError(f"slots_EX must have at least one expert and one replica column, "
                         f"got shape {tuple(slots_EX.shape)}")
    _same_device("rank_TK", rank_TK, "topk_ids_TK", topk_ids_TK)
    _same_device("slots_EX", slots_EX, "topk_ids_TK", topk_ids_TK)
    _same_device("bounds_EX", bounds_EX, "topk_ids_TK", topk_ids_TK)


def _outside(values: torch.Tensor, upper: int) -> int | None:
    """A value of ``values`` outside [0, upper), or None; CPU tensors only: on an accelerator
    reading the range on the host would stall the step (see the module docstring)."""
    if values.numel() == 0 or values.device.type != "cpu":
        return None
    lo, hi = int(values.min()), int(values.max())
    if lo < 0:
        return lo
    return hi if hi >= upper else None


def check_expert_ids(topk_ids_TK: torch.Tensor, num_experts: int) -> None:
    """Raise ValueError if an expert id lies outside [0, num_experts) (CPU tensors only)."""
    bad = _outside(topk_ids_TK, num_experts)
    if bad is not None:
        raise ValueError(f"topk_ids_TK holds expert id {bad}, outside [0, {num_experts}) of "
                         f"slots_EX; route with the replica table of this layer")


def check_sort_by_slot(slot_TK, num_slots) -> None:
    """Raise TypeError/ValueError unless the arguments of :func:`sort_by_slot` are well formed."""
    _int64(slot_TK, "slot_TK", 2, "[T, K]")
    positive_int(num_slots, "num_slots")


def check_slot_values(slot_TK: torch.Tensor, num_slots: int) -> None:
    """Raise ValueError if a slot id lies outside [0, num_slots) (CPU tensors only)."""
    bad = _outside(slot_TK, num_slots)
    if bad is not None:
        raise ValueError(f"slot_TK holds slot {bad}, outside [0, num_slots={num_slots})")


def check_gather_rows(x_MD, index_N, scale_N) -> None:
    """Raise TypeError/ValueError unless the arguments of :func:`gather_rows` are well formed."""
    _floats(x_MD, "x_MD", 2, "[M, D]")
    _int64(index_N, "index_N", 1, "[N]")
    _same_device("index_N", index_N, "x_MD", x_MD)
    if scale_N is not None:
        _floats(scale_N, "scale_N", 1, "[N]")
        if scale_N.shape[0] != index_N.shape[0]:
            raise ValueError(f"scale_N must have shape [N]=({index_N.shape[0]},) like index_N, "
                             f"got {tuple(scale_N.shape)}")
        _same_device("scale_N", scale_N, "x_MD", x_MD)


def check_out(out, name_shape: tuple, dtype: torch.dtype, device: torch.device) -> None:
    """Raise TypeError/ValueError unless ``out`` is a contiguous tensor of the given shape/dtype."""
    _tensor(out, "out")
    shape = tuple(name_shape)
    if tuple(out.shape) != shape or out.dtype != dtype or out.device != device:
        raise ValueError(f"out must be a {dtype} tensor of shape {shape} on {device}, got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}")
    if not out.is_contiguous():
        raise ValueError("out must be contiguous; allocate it with torch.empty")


def check_index_values(index_N: torch.Tensor, num_rows: int, name: str = "index_N") -> None:
    """Raise ValueError if a row index lies outside [0, num_rows) (CPU tensors only)."""
    bad = _outside(index_N, num_rows)
    if bad is not None:
        raise ValueError(f"{name} holds row {bad}, outside [0, {num_rows})")


def check_combine(y_ND, pos_TK, weights_TK) -> None:
    """Raise TypeError/ValueError unless the arguments of :func:`combine` are well formed."""
    _floats(y_ND, "y_ND", 2, "[N, D]")
    _int64(pos_TK, "pos_TK", 2, "[T, K]")
    _same_device("pos_TK", pos_TK, "y_ND", y_ND)
    if weights_TK is not None:
        _floats(weights_TK, "weights_TK", 2, "[T, K]")
        if weights_TK.shape != pos_TK.shape:
            raise ValueError(f"weights_TK must have the shape of pos_TK {tuple(pos_TK.shape)}, "
                             f"got {tuple(weights_TK.shape)}")
        _same_device("weights_TK", weights_TK, "y_ND", y_ND)


def check_combine_weight_grad(grad_TD, y_ND, pos_TK) -> None:
    """Raise TypeError/ValueError unless :func:`combine_weight_grad`'s arguments are well formed."""
    _floats(grad_TD, "grad_TD", 2, "[T, D]")
    _floats(y_ND, "y_ND", 2, "[N, D]")
    _int64(pos_TK, "pos_TK", 2, "[T, K]")
    if grad_TD.dtype != y_ND.dtype:
        raise TypeError(f"grad_TD ({grad_TD.dtype}) and y_ND ({y_ND.dtype}) must share a dtype")
    if grad_TD.shape[0] != pos_TK.shape[0] or grad_TD.shape[1] != y_ND.shape[1]:
        raise ValueError(f"grad_TD must have shape [T, D]=({pos_TK.shape[0]}, {y_ND.shape[1]}), "
                         f"got {tuple(grad_TD.shape)}")
    _same_device("y_ND", y_ND, "grad_TD", grad_TD)
    _same_device("pos_TK", pos_TK, "grad_TD", grad_TD)
