"""Dispatcher: send every routed token to one replica of its expert and bring the results back.

One :class:`Dispatcher` owns the communication of an expert-parallel group. ``dispatch`` returns
the rows this rank's expert slots must process and a :class:`DispatchHandle`; ``combine`` takes
the slots' outputs and that handle and returns the weighted sum per token::

    recv_x_MD, handle = dispatcher.dispatch(x_TD, topk_ids_TK, topk_weights_TK, placement, layer)
    y_MD = experts(recv_x_MD, handle.tokens_per_local_slot)     # rows grouped by local slot
    out_TD = dispatcher.combine(y_MD, handle)

Steps of ``dispatch`` (kernels from :func:`moebalance.dispatch.kernels.kernels_for`):

1. route: each pair (t, k) picks a physical slot of expert ``topk_ids[t, k]`` by the routing
   table of (placement, layer, this rank) -- the placement's token shares, local replicas first.
2. permute: rows ``x[t]`` are gathered into (destination rank, local slot) order.
3. exchange: per-slot counts go to their owners (``all_to_all_single`` of int64), then the rows
   (``all_to_all_single`` with autograd: its backward is the reverse exchange).
4. reorder: received rows go from (source rank, local slot) to (local slot, source rank) order,
   so that each local slot's rows are contiguous.

``combine`` runs these backwards and ends with ``out[t] = sum_k w[t, k] * y[pair (t, k)]``.

Host syncs: the counts exchange is followed by the single ``.tolist()`` of the per-step path
(split sizes and rows per local slot must be host ints for the row exchange and the expert
GEMMs). Expert ids outside ``[0, E)`` are detected on the device and reported through that same
exchange, so every rank of the group raises the ValueError together instead of leaving the
others waiting in a collective.

Autograd: gradients flow to ``x`` (permute's backward is combine with unit weights), through both
exchanges, and to ``topk_weights`` (:func:`combine_weight_grad`). Every rank must run backward
through the same exchanges: ``x.requires_grad`` must agree across the ranks of the group (it does
when all ranks run the same model).

Legend: T tokens on this rank, K top-k, D hidden size, E logical experts, S global slots, G ranks
of the group, N = T*K routed pairs, M rows received by this rank (pairs routed to its slots).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ..placement import Placement
from .kernels import kernels_for
from .routing import RoutingTable, routing_table

__all__ = ["Dispatcher", "DispatchHandle", "RANK_PAIR_STRIDE"]

# Rank r hashes pair p as pair_offset + p with pair_offset = r * RANK_PAIR_STRIDE: ranks use
# disjoint stretches of one Weyl sequence (for calls of up to 2**24 pairs), so the same pair index
# on two ranks draws different replicas. The offset does not depend on the step: routing is a pure
# function of (inputs, placement, layer, rank), and a recomputed forward (activation
# checkpointing) routes exactly as the first one did.
RANK_PAIR_STRIDE = 1 << 24

# Placements whose routing tables are kept (the current one, the one being migrated to, spares).
_CACHED_PLACEMENTS = 4


@dataclass(frozen=True, eq=False)
class DispatchHandle:
    """What :meth:`Dispatcher.combine` needs to undo one :meth:`Dispatcher.dispatch`.

    Attributes:
        tokens_per_local_slot: rows of ``recv_x`` for each local slot, in local slot order
            (host ints; the rows of local slot i are contiguous and follow those of slot i-1).
        order_N: [N] int64, pair index p = t*K + k at each sorted (sent) position.
        pos_TK: [T, K] int64, sorted position of each pair.
        topk_weights_TK: [T, K] float, the weights ``combine`` applies (autograd-tracked).
        send_splits: rows sent to each rank [G] (None in a single process).
        recv_splits: rows received from each rank [G] (None in a single process).
        recv_index_M: [M] int64, received row (source-rank order) of each slot-ordered row, or
            None when the orders coincide (single process).
        recv_inverse_M: [M] int64, the inverse permutation of ``recv_index_M``.
        placement, layer, rank: what the rows were routed by.
    """

    tokens_per_local_slot: list
    order_N: torch.Tensor
    pos_TK: torch.Tensor
    topk_weights_TK: torch.Tensor
    send_splits: list | None
    recv_splits: list | None
    recv_index_M: torch.Tensor | None
    recv_inverse_M: torch.Tensor | None
    placement: Placement
    layer: int
    rank: int

    @property
    def num_recv_rows(self) -> int:
        """M, the rows ``dispatch`` returned."""
        return sum(self.tokens_per_local_slot)

    @property
    def num_tokens(self) -> int:
        """T, the tokens ``combine`` returns."""
        return self.pos_TK.shape[0]


# -- autograd pieces ------------------------------------------------------------------------------


class _Permute(torch.autograd.Function):
    """Rows of x in sorted pair order; backward sums each token's K pair gradients."""

    @staticmethod
    def forward(ctx, x_TD, token_N, pos_TK, kernels):
        ctx.save_for_backward(pos_TK)
        ctx.kernels = kernels
        return kernels.gather_rows(x_TD, token_N)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_ND):
        (pos_TK,) = ctx.saved_tensors
        return ctx.kernels.combine(grad_ND.contiguous(), pos_TK, None), None, None, None


class _Reorder(torch.autograd.Function):
    """out = x[index]; ``index`` is a permutation whose inverse gives the backward."""

    @staticmethod
    def forward(ctx, x_MD, index_M, inverse_M, kernels):
        ctx.save_for_backward(inverse_M)
        ctx.kernels = kernels
        return kernels.gather_rows(x_MD, index_M)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_MD):
        (inverse_M,) = ctx.saved_tensors
        return ctx.kernels.gather_rows(grad_MD.contiguous(), inverse_M), None, None, None


class _Exchange(torch.autograd.Function):
    """all_to_all_single of rows with uneven splits; backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x_ND, send_splits, recv_splits, group):
        ctx.splits = (send_splits, recv_splits)
        ctx.group = group
        return _all_to_all_rows(x_ND, send_splits, recv_splits, group)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_MD):
        send_splits, recv_splits = ctx.splits
        return _all_to_all_rows(grad_MD, recv_splits, send_splits, ctx.group), None, None, None


class _Combine(torch.autograd.Function):
    """out[t] = sum_k w[t, k] * y[pos[t, k]]; gradients for y and w."""

    @staticmethod
    def forward(ctx, y_ND, weights_TK, pos_TK, token_N, order_N, kernels):
        ctx.save_for_backward(y_ND, weights_TK, pos_TK, token_N, order_N)
        ctx.kernels = kernels
        return kernels.combine(y_ND, pos_TK, weights_TK)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_TD):
        y_ND, weights_TK, pos_TK, token_N, order_N = ctx.saved_tensors
        kernels = ctx.kernels
        grad_TD = grad_TD.contiguous()
        grad_y = grad_w = None
        if ctx.needs_input_grad[0]:
            # Row i of y is pair order[i]: its gradient is w[pair] * grad[token of pair].
            scale_N = weights_TK.reshape(-1).index_select(0, order_N)
            grad_y = kernels.gather_rows(grad_TD, token_N, scale_N)
        if ctx.needs_input_grad[1]:
            grad_w = kernels.combine_weight_grad(grad_TD, y_ND, pos_TK).to(weights_TK.dtype)
        return grad_y, grad_w, None, None, None, None


def _all_to_all_rows(x_ND: torch.Tensor, send_splits: list, recv_splits: list, group) -> torch.Tensor:
    out = x_ND.new_empty((sum(recv_splits), x_ND.shape[1]))
    dist.all_to_all_single(out, x_ND.contiguous(), output_split_sizes=recv_splits,
                           input_split_sizes=send_splits, group=group)
    return out


# -- per-placement state --------------------------------------------------------------------------


class _PlacementState:
    """Host facts about one placement, checked once, and its routing tables per (layer, device)."""

    def __init__(self, placement: Placement, rank: int, world_size: int) -> None:
        placement.validate()
        self.placement = placement  # strong reference: the cache key id() cannot be reused
        self.rank = rank
        self.world_size = world_size
        slots_per_rank = np.bincount(placement.slot_device, minlength=world_size)
        self.slot_offsets = np.concatenate([[0], np.cumsum(slots_per_rank)]).astype(np.int64)
        self.slots_per_rank = slots_per_rank.tolist()
        self.num_local_slots = int(slots_per_rank[rank])
        self._tables: dict = {}
        self._count_index: dict = {}
        self._offsets: dict = {}

    def table(self, layer: int, device: torch.device) -> RoutingTable:
        key = (layer, device)
        table = self._tables.get(key)
        if table is None:
            table = routing_table(self.placement, layer, self.rank, self.world_size, device=device)
            self._tables[key] = table
        return table

    def offsets(self, device: torch.device) -> torch.Tensor:
        """[G + 1] int64 on ``device``: rank g owns slots offsets[g]:offsets[g + 1]."""
        offsets = self._offsets.get(device)
        if offsets is None:
            offsets = self._offsets[device] = torch.from_numpy(self.slot_offsets).to(device)
        return offsets

    def count_index(self, device: torch.device) -> torch.Tensor:
        """[S + G] int64 into cat([counts_S, flag]): each rank's slot counts, then the flag."""
        index = self._count_index.get(device)
        if index is None:
            S = self.placement.num_slots
            parts = [np.append(np.arange(self.slot_offsets[g], self.slot_offsets[g + 1]), S)
                     for g in range(self.world_size)]
            index = torch.from_numpy(np.concatenate(parts).astype(np.int64)).to(device)
            self._count_index[device] = index
        return index


# -- the dispatcher -------------------------------------------------------------------------------


class Dispatcher:
    """Route, permute, exchange and combine the tokens of one expert-parallel group.

    Args:
        group: the torch.distributed process group whose ranks are the placement's devices
            (rank r of the group serves device r). None: the default group if torch.distributed
            is initialised, else a single process (no communication).
        debug: also check, with host syncs, that ``x`` and ``topk_weights`` are finite and that
            every expert id is in range before any communication (the id check always runs, for
            free, through the counts exchange).

    The routing tables of a placement are built on first use and cached by placement identity
    and layer; pass the same :class:`~moebalance.Placement` object every step (a new object
    means new tables).
    """

    def __init__(self, group=None, *, debug: bool = False) -> None:
        if dist.is_available() and dist.is_initialized():
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
            if self.rank < 0:
                raise ValueError("this process is not a member of group; build the Dispatcher "
                                 "only on the ranks of its expert-parallel group")
        elif group is not None:
            raise ValueError("group was given but torch.distributed is not initialised; call "
                             "torch.distributed.init_process_group first, or pass group=None")
        else:
            self.rank, self.world_size = 0, 1
        self.group = group
        self.debug = bool(debug)
        self._states: OrderedDict[int, _PlacementState] = OrderedDict()

    def __repr__(self) -> str:
        return f"Dispatcher(rank={self.rank}, world_size={self.world_size}, debug={self.debug})"

    # -- placement state ---------------------------------------------------------------------

    def _state(self, placement, layer) -> _PlacementState:
        if not isinstance(placement, Placement):
            raise TypeError(f"placement must be a moebalance.Placement, got {type(placement).__name__}")
        state = self._states.get(id(placement))
        if state is None or state.placement is not placement:
            if placement.num_devices != self.world_size:
                raise ValueError(
                    f"placement spans {placement.num_devices} devices but the process group has "
                    f"{self.world_size} ranks; plan for a topology of {self.world_size} devices "
                    f"(one per rank)")
            state = _PlacementState(placement, self.rank, self.world_size)
            self._states[id(placement)] = state
            while len(self._states) > _CACHED_PLACEMENTS:
                self._states.popitem(last=False)
        else:
            self._states.move_to_end(id(placement))
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
            raise TypeError(f"layer must be an int, got {type(layer).__name__}")
        if not 0 <= layer < placement.num_layers:
            raise ValueError(f"layer must be in [0, {placement.num_layers}) for this placement of "
                             f"{placement.num_layers} layers, got {layer}")
        return state

    def local_slots(self, placement: Placement, layer: int = 0) -> range:
        """The global slot ids this rank owns under ``placement`` (checks it and ``layer``)."""
        state = self._state(placement, layer)
        return range(int(state.slot_offsets[self.rank]), int(state.slot_offsets[self.rank + 1]))

    # -- dispatch ------------------------------------------------------------------------------

    def _check_inputs(self, x_TD, topk_ids_TK, topk_weights_TK) -> None:
        for name, value in (("x_TD", x_TD), ("topk_ids_TK", topk_ids_TK),
                            ("topk_weights_TK", topk_weights_TK)):
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
        if x_TD.dim() != 2 or not x_TD.is_floating_point():
            raise ValueError(f"x_TD must be a float tensor of shape [T, D], got shape "
                             f"{tuple(x_TD.shape)} and dtype {x_TD.dtype}; flatten leading dims "
                             f"with x.reshape(-1, D)")
        if (topk_ids_TK.dim() != 2 or topk_ids_TK.is_floating_point() or topk_ids_TK.is_complex()
                or topk_ids_TK.dtype == torch.bool):
            raise ValueError(f"topk_ids_TK must be an integer tensor of shape [T, K], got shape "
                             f"{tuple(topk_ids_TK.shape)} and dtype {topk_ids_TK.dtype}")
        if topk_ids_TK.shape[0] != x_TD.shape[0] or topk_ids_TK.shape[1] < 1:
            raise ValueError(f"topk_ids_TK must have shape [T, K] with T={x_TD.shape[0]} (rows of "
                             f"x_TD) and K >= 1, got {tuple(topk_ids_TK.shape)}")
        if topk_weights_TK.shape != topk_ids_TK.shape or not topk_weights_TK.is_floating_point():
            raise ValueError(f"topk_weights_TK must be a float tensor of the shape of topk_ids_TK "
                             f"{tuple(topk_ids_TK.shape)}, got shape {tuple(topk_weights_TK.shape)} "
                             f"and dtype {topk_weights_TK.dtype}")
        for name, value in (("topk_ids_TK", topk_ids_TK), ("topk_weights_TK", topk_weights_TK)):
            if value.device != x_TD.device:
                raise ValueError(f"{name} is on {value.device} but x_TD is on {x_TD.device}; "
                                 f"move them to one device")

    def _debug_checks(self, x_TD, topk_ids_TK, topk_weights_TK, num_experts) -> None:
        if not bool(torch.isfinite(x_TD).all()):
            raise ValueError("x_TD holds NaN or inf values")
        if not bool(torch.isfinite(topk_weights_TK).all()):
            raise ValueError("topk_weights_TK holds NaN or inf values")
        if topk_ids_TK.numel() and not (0 <= int(topk_ids_TK.min()) and int(topk_ids_TK.max()) < num_experts):
            raise ValueError(f"topk_ids_TK holds expert ids outside [0, {num_experts})")

    def dispatch(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                 placement: Placement, layer: int, *, pair_offset: int | None = None):
        """Send each routed pair's token row to one replica of its expert.

        Args:
            x_TD: [T, D] float, this rank's tokens (T may be 0).
            topk_ids_TK: [T, K] integer, logical expert of each pair, in [0, E).
            topk_weights_TK: [T, K] float, weight of each pair (kept for :meth:`combine`).
            placement: the current placement; ``placement.num_devices`` must equal the group size.
            layer: index of this MoE layer in the placement.
            pair_offset: hash offset of this rank's pairs (default ``rank * RANK_PAIR_STRIDE``);
                give micro-batches different offsets to draw replicas independently.

        Returns:
            recv_x_MD: [M, D], the rows this rank's slots process, grouped by local slot.
            handle: :class:`DispatchHandle` for :meth:`combine`.
        """
        self._check_inputs(x_TD, topk_ids_TK, topk_weights_TK)
        state = self._state(placement, layer)
        E = placement.num_experts
        if self.debug:
            self._debug_checks(x_TD, topk_ids_TK, topk_weights_TK, E)
        if pair_offset is None:
            pair_offset = self.rank * RANK_PAIR_STRIDE
        elif isinstance(pair_offset, bool) or not isinstance(pair_offset, int) or pair_offset < 0:
            raise ValueError(f"pair_offset must be an int >= 0 or None, got {pair_offset!r}")

        device = x_TD.device
        kernels = kernels_for(device.type)
        K = topk_ids_TK.shape[1]
        ids_TK = topk_ids_TK.to(torch.int64)
        # Out-of-range ids are clamped for routing and reported after the counts exchange, so
        # that every rank raises together (no host sync here, no rank left in a collective).
        bad = ((ids_TK < 0) | (ids_TK >= E)).sum().view(1)
        ids_TK = ids_TK.clamp(0, E - 1).contiguous()

        table = state.table(layer, device)
        slot_TK = kernels.route(ids_TK, table.slots_EX, table.thresholds_EX, pair_offset)
        order_N, pos_TK, counts_S = kernels.sort_by_slot(slot_TK, placement.num_slots)
        token_N = order_N // K
        x_TD = x_TD.contiguous()
        send_x_ND = _Permute.apply(x_TD, token_N, pos_TK, kernels)
        common = dict(order_N=order_N, pos_TK=pos_TK, topk_weights_TK=topk_weights_TK.contiguous(),
                      placement=placement, layer=int(layer), rank=self.rank)

        if self.world_size == 1:
            host = torch.cat([counts_S, bad]).tolist()
            self._raise_bad_ids([host[-1]], E)
            handle = DispatchHandle(tokens_per_local_slot=host[:-1], send_splits=None,
                                    recv_splits=None, recv_index_M=None, recv_inverse_M=None,
                                    **common)
            return send_x_ND, handle

        G, Ls = self.world_size, state.num_local_slots
        send_counts = torch.cat([counts_S, bad]).index_select(0, state.count_index(device))
        recv_counts = counts_S.new_empty(G * (Ls + 1))
        dist.all_to_all_single(recv_counts, send_counts, output_split_sizes=[Ls + 1] * G,
                               input_split_sizes=[s + 1 for s in state.slots_per_rank],
                               group=self.group)
        offsets = state.offsets(device)
        sent_cum = torch.cat([counts_S.new_zeros(1), counts_S.cumsum(0)])
        send_rows_G = sent_cum.index_select(0, offsets[1:]) - sent_cum.index_select(0, offsets[:-1])
        # The one host sync of the per-step path.
        host = torch.cat([recv_counts, send_rows_G]).tolist()
        recv_GL1 = np.asarray(host[:G * (Ls + 1)], dtype=np.int64).reshape(G, Ls + 1)
        self._raise_bad_ids(recv_GL1[:, Ls].tolist(), E)
        recv_GL = recv_GL1[:, :Ls]
        send_splits = host[G * (Ls + 1):]
        recv_splits = recv_GL.sum(axis=1).tolist()
        tokens_per_local_slot = recv_GL.sum(axis=0).tolist()

        recv_src_MD = _Exchange.apply(send_x_ND, send_splits, recv_splits, self.group)
        index_M, inverse_M = _slot_major_index(
            recv_counts.view(G, Ls + 1)[:, :Ls], sum(recv_splits))
        recv_x_MD = _Reorder.apply(recv_src_MD, index_M, inverse_M, kernels)
        handle = DispatchHandle(tokens_per_local_slot=tokens_per_local_slot,
                                send_splits=send_splits, recv_splits=recv_splits,
                                recv_index_M=index_M, recv_inverse_M=inverse_M, **common)
        return recv_x_MD, handle

    def _raise_bad_ids(self, bad_per_rank: list, num_experts: int) -> None:
        """Raise on every rank if any rank's ids were out of range (``bad_per_rank`` [G])."""
        if not any(bad_per_rank):
            return
        mine = bad_per_rank[self.rank]
        if mine:
            raise ValueError(f"topk_ids_TK holds {mine} expert ids outside [0, {num_experts}); the "
                             f"router and the placement must agree on the number of experts")
        bad_ranks = [g for g, n in enumerate(bad_per_rank) if n]
        raise ValueError(f"rank(s) {bad_ranks} passed topk_ids_TK with expert ids outside "
                         f"[0, {num_experts}); every rank of the group stops this dispatch")

    # -- combine -------------------------------------------------------------------------------

    def combine(self, y_MD: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Bring the slots' outputs back and sum each token's K results with its weights.

        Args:
            y_MD: [M, D'] float, one output row per row of the ``recv_x`` that ``dispatch``
                returned, in the same order (D' may differ from D).
            handle: the :class:`DispatchHandle` of that dispatch.

        Returns:
            out_TD': [T, D'] in y's dtype: ``out[t] = sum_k topk_weights[t, k] * y[row of (t, k)]``.
        """
        if not isinstance(handle, DispatchHandle):
            raise TypeError(f"handle must be the DispatchHandle returned by dispatch(), got "
                            f"{type(handle).__name__}")
        if not isinstance(y_MD, torch.Tensor):
            raise TypeError(f"y_MD must be a torch.Tensor, got {type(y_MD).__name__}")
        M = handle.num_recv_rows
        if y_MD.dim() != 2 or y_MD.shape[0] != M or not y_MD.is_floating_point():
            raise ValueError(f"y_MD must be a float tensor of shape [M, D] with M={M} (rows returned "
                             f"by dispatch), got shape {tuple(y_MD.shape)} and dtype {y_MD.dtype}")
        if y_MD.device != handle.pos_TK.device:
            raise ValueError(f"y_MD is on {y_MD.device} but the dispatch ran on "
                             f"{handle.pos_TK.device}")
        kernels = kernels_for(y_MD.device.type)
        y_MD = y_MD.contiguous()
        if handle.recv_index_M is None:
            back_ND = y_MD
        else:
            y_src = _Reorder.apply(y_MD, handle.recv_inverse_M, handle.recv_index_M, kernels)
            back_ND = _Exchange.apply(y_src, handle.recv_splits, handle.send_splits, self.group)
        K = handle.pos_TK.shape[1]
        return _Combine.apply(back_ND, handle.topk_weights_TK, handle.pos_TK,
                              handle.order_N // K, handle.order_N, kernels)


def _slot_major_index(recv_GL: torch.Tensor, num_rows: int):
    """Gather index from (source rank, local slot) row order to (local slot, source rank) order.

    Args:
        recv_GL: [G, Ls] int64 (device), rows received from each rank for each local slot.
        num_rows: M = recv_GL.sum(), known on the host (no sync here).

    Returns:
        index_M: [M] int64, received row of each slot-ordered row; inverse_M: its inverse.
    """
    G, Ls = recv_GL.shape
    device = recv_GL.device
    src_start_GL = (recv_GL.reshape(-1).cumsum(0) - recv_GL.reshape(-1)).view(G, Ls)
    counts_LG = recv_GL.t().reshape(-1)
    dst_start_LG = counts_LG.cumsum(0) - counts_LG
    segment_M = torch.repeat_interleave(torch.arange(G * Ls, device=device), counts_LG,
                                        output_size=num_rows)
    rows_M = torch.arange(num_rows, device=device)
    index_M = src_start_GL.t().reshape(-1).index_select(0, segment_M) + rows_M \
        - dst_start_LG.index_select(0, segment_M)
    inverse_M = torch.empty_like(index_M)
    inverse_M[index_M] = rows_M
    return index_M, inverse_M
