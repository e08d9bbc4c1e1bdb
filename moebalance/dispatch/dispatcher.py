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
2. counts: per-slot counts go to their owners (``all_to_all_single`` of int64), so that every
   rank knows the size of every message it will send and receive.
3. permute + exchange: rows ``x[t]`` are gathered into *sorted* order (destination rank, then
   its local slot) and delivered in *slot-major* order (local slot, then source rank: each local
   slot's rows contiguous), by one of two exchanges (``Dispatcher(exchange=...)``):

   * ``"all_to_all"``: one ``all_to_all_single`` with uneven splits moves all the rows (own rows
     included), which arrive in (source rank, local slot) order; one gather on the receiver puts
     them in slot-major order. The default on NCCL and any other non-gloo backend: one
     collective is the standard, efficient exchange there, where many small messages are not.
   * ``"p2p"``: point-to-point messages, one per (peer, local slot of the receiver), all in
     flight at once (``batch_isend_irecv``). Each message is contiguous on both sides, so rows
     land directly in slot-major order with no reorder pass; rows that stay on this rank are
     gathered straight into place while the messages travel. The default on gloo, where it is
     the faster of the two.

``combine`` runs these backwards (the inverse reorder, then the reverse ``all_to_all_single``;
or the reverse messages) and ends with ``out[t] = sum_k w[t, k] * y[pair (t, k)]``. The two
exchanges only move rows; the arithmetic (gathers, weighted sums, their order) is shared, so
they give bit-identical outputs and gradients.

Host syncs: the counts exchange is followed by the single ``.tolist()`` of the per-step path
(split sizes and rows per local slot must be host ints for the row exchange and the expert
GEMMs). Expert ids outside ``[0, E)`` are detected on the device and reported through that same
exchange, so every rank of the group raises the ValueError together instead of leaving the
others waiting in a collective.

Autograd: gradients flow to ``x`` (permute's backward is combine with unit weights), through the
row exchange (its backward is the reverse exchange, reorders included), and to ``topk_weights``
(:func:`combine_weight_grad`). Every rank must run backward through the same exchanges:
``x.requires_grad`` must agree across the ranks of the group (it does when all ranks run the
same model).

Buffers: on CPU, large outputs and intermediates (send buffers, rows before the reorder) come
from a small process-wide pool that lends a buffer again only once nothing else references it (a
fresh mmap'ed buffer pays a page fault per 4 KiB, as costly as filling it);
:func:`release_buffers` frees the pool. A Dispatcher is used by one thread at a time, like the
collectives of its group.

Legend: T tokens on this rank, K top-k, D hidden size, E logical experts, S global slots, G ranks
of the group, N = T*K routed pairs, M rows received by this rank (pairs routed to its slots).
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import ClassVar, Protocol

import numpy as np
import torch
import torch.distributed as dist

from ..placement import Placement
from .kernels import kernels_for
from .routing import RoutingTable, routing_table

__all__ = ["Dispatcher", "DispatchHandle", "EXCHANGES", "RANK_PAIR_STRIDE", "release_buffers"]

# Rank r hashes pair p as pair_offset + p with pair_offset = r * RANK_PAIR_STRIDE: ranks use
# disjoint stretches of one Weyl sequence (for calls of up to 2**24 pairs), so the same pair index
# on two ranks draws different replicas. The offset does not depend on the step: routing is a pure
# function of (inputs, placement, layer, rank), and a recomputed forward (activation
# checkpointing) routes exactly as the first one did.
RANK_PAIR_STRIDE = 1 << 24

# Placements whose routing tables are kept (the current one, the one being migrated to, spares).
_CACHED_PLACEMENTS = 4

# Values of Dispatcher(exchange=...).
EXCHANGES = ("auto", "all_to_all", "p2p")


@dataclass(frozen=True, eq=False)
class DispatchHandle:
    """What :meth:`Dispatcher.combine` needs to undo one :meth:`Dispatcher.dispatch`.

    Attributes:
        tokens_per_local_slot: rows of ``recv_x`` for each local slot, in local slot order
            (host ints; the rows of local slot i are contiguous and follow those of slot i-1).
        order_N: [N] int64, pair index p = t*K + k at each sorted (sent) position.
        pos_TK: [T, K] int64, sorted position of each pair.
        topk_weights_TK: [T, K] float, the weights ``combine`` applies (autograd-tracked).
        exchange: how the rows of this dispatch travel (see :attr:`exchange_kind`).
        placement, layer, rank: what the rows were routed by.
    """

    tokens_per_local_slot: list
    order_N: torch.Tensor
    pos_TK: torch.Tensor
    topk_weights_TK: torch.Tensor
    exchange: _RowExchange
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

    @property
    def exchange_kind(self) -> str:
        """How the rows travelled: "p2p", "all_to_all", or "local" in a single process."""
        return self.exchange.name

    @property
    def send_splits(self) -> list | None:
        """Rows this rank sent to each rank at dispatch ([G] ints; None in a single process)."""
        return self.exchange.rows_per_rank(sent=True)

    @property
    def recv_splits(self) -> list | None:
        """Rows this rank received from each rank at dispatch ([G] ints; None in one process)."""
        return self.exchange.rows_per_rank(sent=False)


# -- reusable CPU buffers -------------------------------------------------------------------------


class _BufferPool:
    """Large CPU buffers kept across calls, reused only when nothing else references them.

    A fresh CPU allocation of tens of MiB comes from ``mmap`` and pays a page fault per 4 KiB
    on first touch -- as much time as the copy that fills it. The pool keeps the storages of
    the buffers it handed out and lends one again once its use count shows that the pool holds
    the only reference: the caller dropped every tensor on it and autograd saved none. A tensor
    still alive anywhere (returned to the user, saved for backward, viewed by numpy) keeps its
    storage out of the pool, so reuse can never overwrite live data.
    """

    MIN_BYTES = 1 << 20   # below this the allocator's free lists are already cheap
    CAPACITY = 8          # storages remembered; the least recently lent is forgotten first

    def __init__(self) -> None:
        self._storages: list[torch.UntypedStorage] = []
        self._lock = threading.Lock()

    def empty(self, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised contiguous tensor of ``shape`` and ``dtype`` on ``device``."""
        numel = math.prod(shape)
        nbytes = numel * dtype.itemsize
        if device.type != "cpu" or nbytes < self.MIN_BYTES or _use_count is None:
            return torch.empty(shape, dtype=dtype, device=device)
        with self._lock:
            best = None
            for i, storage in enumerate(self._storages):
                size = storage.nbytes()
                # Sole owner, large enough, and not so large that a small request pins it.
                if (nbytes <= size <= 2 * nbytes and _use_count(storage._cdata) == 1
                        and (best is None or size < self._storages[best].nbytes())):
                    best = i
            if best is None:
                # Slack for the step-to-step variation of M; untouched pages cost nothing.
                storage = torch.UntypedStorage(nbytes + nbytes // 8, device=device)
            else:
                storage = self._storages.pop(best)
            self._storages.append(storage)
            del self._storages[:-self.CAPACITY]
        return torch.empty(0, dtype=dtype, device=device).set_(storage, 0, shape)

    def clear(self) -> None:
        """Forget every kept storage (tensors still using one keep it alive)."""
        with self._lock:
            self._storages.clear()


# The storage use count is not public API; without it the pool simply allocates fresh buffers.
_use_count = getattr(torch._C, "_storage_Use_Count", None)
_POOL = _BufferPool()


def release_buffers() -> None:
    """Drop the CPU buffers the dispatchers of this process keep for reuse (frees their memory)."""
    _POOL.clear()


# -- how rows travel ------------------------------------------------------------------------------
#
# Rows live in two orders: *sorted* (this rank's N pairs grouped by global slot, so by destination
# rank, then its local slot) and *slot-major* (the M rows this rank's slots receive, grouped by
# local slot, then by source rank). A row exchange moves rows between the two; there is one class
# per strategy, all with the interface of _RowExchange, and the autograd functions below are
# written against that interface alone.


class _RowExchange(Protocol):
    """How the rows of one dispatch travel between sorted and slot-major order."""

    name: ClassVar[str]   # "local", "p2p" or "all_to_all"
    num_sorted: int       # N
    num_slot_major: int   # M

    def to_slot_major(self, kernels, src_TD: torch.Tensor, index_N: torch.Tensor,
                      scale_N: torch.Tensor | None) -> torch.Tensor:
        """Rows ``src[index[i]] * scale[i]`` of the sorted positions i, delivered to the ranks of
        their slots. src_TD [T, D], index_N [N] int64, scale_N [N] float or None.
        Returns [M, D] slot-major rows (every row written)."""

    def to_sorted(self, kernels, src_MD: torch.Tensor) -> torch.Tensor:
        """Slot-major rows src_MD [M, D] back to their source ranks; returns [N, D] sorted rows."""

    def rows_per_rank(self, sent: bool) -> list | None:
        """[G] ints, rows sent to (``sent``) or received from each rank (None in one process)."""


def _gather_span(kernels, src_TD, index_N, scale_N, start: int, stop: int, out) -> torch.Tensor:
    """``kernels.gather_rows`` of sorted positions start:stop into ``out`` [stop - start, D]."""
    scale = None if scale_N is None else scale_N[start:stop]
    return kernels.gather_rows(src_TD, index_N[start:stop], scale, out=out)


@dataclass(frozen=True, eq=False)
class _LocalRows:
    """A single process: every slot is local and sorted order is slot-major order."""

    name: ClassVar[str] = "local"
    num_sorted: int
    num_slot_major: int

    def to_slot_major(self, kernels, src_TD, index_N, scale_N) -> torch.Tensor:
        out_MD = _POOL.empty((self.num_slot_major, src_TD.shape[1]), src_TD.dtype, src_TD.device)
        return kernels.gather_rows(src_TD, index_N, scale_N, out=out_MD)

    def to_sorted(self, kernels, src_MD) -> torch.Tensor:
        return src_MD

    def rows_per_rank(self, sent: bool) -> None:
        return None


@dataclass(frozen=True, eq=False)
class _PointToPoint:
    """Rows as point-to-point messages, one per (peer, local slot of the receiver), all in flight
    at once (``batch_isend_irecv``).

    The rows of one (peer, receiver's local slot) pair are contiguous in both orders, so they
    land directly where they belong: no reorder pass on either side. Rows that stay on this rank
    never travel; they are gathered straight into place while the messages are in flight. The
    fastest exchange on gloo, where it saves the reorder pass and the local rows' trip through
    the transport.

    Attributes:
        group: the process group.
        num_sorted: N; num_slot_major: M.
        to_peer: (peer, tag, sorted start, rows) of each message this rank sends at dispatch.
        from_peer: (peer, tag, slot-major start, rows) of each message it receives at dispatch.
        local: (sorted start, slot-major start, rows) of each local slot's own rows.
        local_span: (start, stop) of this rank's own rows in sorted order.
    """

    name: ClassVar[str] = "p2p"
    group: object
    num_sorted: int
    num_slot_major: int
    to_peer: tuple
    from_peer: tuple
    local: tuple
    local_span: tuple

    @staticmethod
    def build(group, rank: int, slot_offsets, counts_S, recv_GL) -> _PointToPoint:
        """Messages from this rank's per-slot counts and the counts it receives.

        Args:
            slot_offsets: [G + 1] ints, rank g owns slots slot_offsets[g]:slot_offsets[g + 1].
            counts_S: [S] ints, this rank's pairs per global slot.
            recv_GL: [G, Ls] ints, rows each rank sends to each of this rank's local slots.
        """
        G, Ls = recv_GL.shape
        sorted_start = np.concatenate([[0], np.cumsum(counts_S)])
        slot_major = np.concatenate([[0], np.cumsum(recv_GL.T.reshape(-1))])[:-1].reshape(Ls, G)
        to_peer, from_peer = [], []
        # Peers in rotation order, so that not every rank sends to rank 0 first.
        for peer in [(rank + i) % G for i in range(1, G)]:
            for tag, s in enumerate(range(slot_offsets[peer], slot_offsets[peer + 1])):
                if counts_S[s]:
                    to_peer.append((peer, tag, int(sorted_start[s]), int(counts_S[s])))
            for tag in range(Ls):
                if recv_GL[peer, tag]:
                    from_peer.append((peer, tag, int(slot_major[tag, peer]),
                                      int(recv_GL[peer, tag])))
        lo = int(slot_offsets[rank])
        local = tuple((int(sorted_start[lo + j]), int(slot_major[j, rank]), int(counts_S[lo + j]))
                      for j in range(Ls) if counts_S[lo + j])
        return _PointToPoint(group, int(sorted_start[-1]), int(recv_GL.sum()), tuple(to_peer),
                             tuple(from_peer), local,
                             (int(sorted_start[lo]), int(sorted_start[lo + Ls])))

    def rows_per_rank(self, sent: bool) -> list:
        rows = [0] * dist.get_world_size(self.group)
        for peer, _, _, n in (self.to_peer if sent else self.from_peer):
            rows[peer] += n
        rows[dist.get_rank(self.group)] = sum(n for _, _, n in self.local)
        return rows

    def _post(self, recv_buf, recv_msgs, send_buf, send_msgs) -> list:
        ops = [dist.P2POp(dist.irecv, recv_buf[start:start + n], group=self.group, group_peer=peer,
                          tag=tag) for peer, tag, start, n in recv_msgs]
        ops += [dist.P2POp(dist.isend, send_buf[start:start + n], group=self.group,
                           group_peer=peer, tag=tag) for peer, tag, start, n in send_msgs]
        return dist.batch_isend_irecv(ops) if ops else []

    def to_slot_major(self, kernels, src_TD, index_N, scale_N) -> torch.Tensor:
        D, dtype, device = src_TD.shape[1], src_TD.dtype, src_TD.device
        # Only the rows that leave are gathered here (the local span of send_ND stays unused).
        send_ND = _POOL.empty((self.num_sorted, D), dtype, device)
        lo, hi = self.local_span
        for a, b in ((0, lo), (hi, self.num_sorted)):
            if b > a:
                _gather_span(kernels, src_TD, index_N, scale_N, a, b, send_ND[a:b])
        out_MD = _POOL.empty((self.num_slot_major, D), dtype, device)
        works = self._post(out_MD, self.from_peer, send_ND, self.to_peer)
        for sorted_start, slot_start, n in self.local:
            _gather_span(kernels, src_TD, index_N, scale_N, sorted_start, sorted_start + n,
                         out_MD[slot_start:slot_start + n])
        for work in works:
            work.wait()
        return out_MD

    def to_sorted(self, kernels, src_MD) -> torch.Tensor:
        out_ND = _POOL.empty((self.num_sorted, src_MD.shape[1]), src_MD.dtype, src_MD.device)
        works = self._post(out_ND, self.to_peer, src_MD, self.from_peer)
        for sorted_start, slot_start, n in self.local:
            out_ND[sorted_start:sorted_start + n].copy_(src_MD[slot_start:slot_start + n])
        for work in works:
            work.wait()
        return out_ND


@dataclass(frozen=True, eq=False)
class _AllToAll:
    """Rows through one ``all_to_all_single`` each way, reordered on the receiver.

    The collective delivers rows in (source rank, local slot) order; one gather with
    ``index_M`` puts them in slot-major order, and ``combine`` undoes it with ``inverse_M``
    before the reverse collective. The standard exchange on NCCL, where one collective beats
    many small point-to-point messages.

    Attributes:
        group: the process group.
        num_sorted: N; num_slot_major: M.
        send_splits: [G] ints, rows sent to each rank at dispatch (own rows included).
        recv_splits: [G] ints, rows received from each rank at dispatch.
        index_M: [M] int64 (device), received row (source-rank order) of each slot-major row.
        inverse_M: [M] int64 (device), the inverse permutation.
    """

    name: ClassVar[str] = "all_to_all"
    group: object
    num_sorted: int
    num_slot_major: int
    send_splits: list
    recv_splits: list
    index_M: torch.Tensor
    inverse_M: torch.Tensor

    @staticmethod
    def build(group, slot_offsets, counts_S, recv_GL, recv_counts_GL) -> _AllToAll:
        """Split sizes and the reorder from the counts (host ints and, for the reorder, the
        same received counts still on the device, so that no host-to-device copy is needed).

        Args:
            slot_offsets: [G + 1] ints, rank g owns slots slot_offsets[g]:slot_offsets[g + 1].
            counts_S: [S] ints, this rank's pairs per global slot.
            recv_GL: [G, Ls] ints, rows each rank sends to each of this rank's local slots.
            recv_counts_GL: [G, Ls] int64 tensor on the rows' device, the same counts.
        """
        sorted_start = np.concatenate([[0], np.cumsum(counts_S)])
        send_splits = np.diff(sorted_start[slot_offsets]).tolist()
        M = int(recv_GL.sum())
        index_M, inverse_M = _slot_major_index(recv_counts_GL, M)
        return _AllToAll(group, int(sorted_start[-1]), M, send_splits,
                         recv_GL.sum(axis=1).tolist(), index_M, inverse_M)

    def rows_per_rank(self, sent: bool) -> list:
        return list(self.send_splits if sent else self.recv_splits)

    def _all_to_all(self, src, num_out: int, out_splits: list, in_splits: list) -> torch.Tensor:
        out = _POOL.empty((num_out, src.shape[1]), src.dtype, src.device)
        dist.all_to_all_single(out, src, output_split_sizes=out_splits,
                               input_split_sizes=in_splits, group=self.group)
        return out

    def to_slot_major(self, kernels, src_TD, index_N, scale_N) -> torch.Tensor:
        D, dtype, device = src_TD.shape[1], src_TD.dtype, src_TD.device
        send_ND = kernels.gather_rows(src_TD, index_N, scale_N,
                                      out=_POOL.empty((self.num_sorted, D), dtype, device))
        by_rank_MD = self._all_to_all(send_ND, self.num_slot_major, self.recv_splits,
                                      self.send_splits)
        del send_ND   # back to the pool before the output is drawn from it
        return kernels.gather_rows(by_rank_MD, self.index_M,
                                   out=_POOL.empty((self.num_slot_major, D), dtype, device))

    def to_sorted(self, kernels, src_MD) -> torch.Tensor:
        by_rank_MD = kernels.gather_rows(src_MD, self.inverse_M, out=_POOL.empty(
            src_MD.shape, src_MD.dtype, src_MD.device))
        return self._all_to_all(by_rank_MD, self.num_sorted, self.send_splits, self.recv_splits)


def _slot_major_index(recv_GL: torch.Tensor, num_rows: int):
    """Gather index from (source rank, local slot) row order to (local slot, source rank) order.

    Args:
        recv_GL: [G, Ls] int64 (device), rows received from each rank for each local slot.
        num_rows: M = recv_GL.sum(), known on the host (no sync here).

    Returns:
        index_M: [M] int64, received row of each slot-major row; inverse_M: its inverse.
    """
    G, Ls = recv_GL.shape
    device = recv_GL.device
    counts_GL = recv_GL.reshape(-1)
    src_start_LG = (counts_GL.cumsum(0) - counts_GL).view(G, Ls).t().reshape(-1)
    counts_LG = recv_GL.t().reshape(-1)
    dst_start_LG = counts_LG.cumsum(0) - counts_LG
    segment_M = torch.repeat_interleave(torch.arange(G * Ls, device=device), counts_LG,
                                        output_size=num_rows)
    rows_M = torch.arange(num_rows, device=device)
    # Row r of slot-major segment (slot l, rank g) is received row src_start[g, l] + offset.
    index_M = (src_start_LG - dst_start_LG).index_select(0, segment_M) + rows_M
    inverse_M = torch.empty_like(index_M)
    inverse_M[index_M] = rows_M
    return index_M, inverse_M


# -- autograd pieces ------------------------------------------------------------------------------


class _Dispatch(torch.autograd.Function):
    """x rows to the slots of their pairs: permute and exchange in one (``rows.to_slot_major``).

    Backward: the gradient rows travel back to sorted order and each token sums its K rows.
    """

    @staticmethod
    def forward(ctx, x_TD, token_N, pos_TK, rows: _RowExchange, kernels):
        ctx.save_for_backward(pos_TK)
        ctx.rows, ctx.kernels = rows, kernels
        return rows.to_slot_major(kernels, x_TD, token_N, None)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_MD):
        (pos_TK,) = ctx.saved_tensors
        grad_ND = ctx.rows.to_sorted(ctx.kernels, grad_MD.contiguous())
        return ctx.kernels.combine(grad_ND, pos_TK, None), None, None, None, None


class _Combine(torch.autograd.Function):
    """Slot outputs back to their tokens (``rows.to_sorted``), then the weighted sum
    out[t] = sum_k w[t, k] * y[pos[t, k]]; gradients for y and w."""

    @staticmethod
    def forward(ctx, y_MD, weights_TK, pos_TK, token_N, order_N, rows: _RowExchange, kernels):
        y_ND = rows.to_sorted(kernels, y_MD)
        # y_ND is kept only when the weights need a gradient (it is their dot product partner).
        ctx.save_for_backward(y_ND if ctx.needs_input_grad[1] else None, weights_TK, pos_TK,
                              token_N, order_N)
        ctx.rows, ctx.kernels = rows, kernels
        out = _POOL.empty((pos_TK.shape[0], y_MD.shape[1]), y_MD.dtype, y_MD.device)
        return kernels.combine(y_ND, pos_TK, weights_TK, out=out)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_TD):
        y_ND, weights_TK, pos_TK, token_N, order_N = ctx.saved_tensors
        kernels = ctx.kernels
        grad_TD = grad_TD.contiguous()
        grad_y = grad_w = None
        if ctx.needs_input_grad[0]:
            # Row i of y (sorted order) is pair order[i]: its gradient is w[pair] * grad[token].
            scale_N = weights_TK.reshape(-1).index_select(0, order_N)
            grad_y = ctx.rows.to_slot_major(kernels, grad_TD, token_N, scale_N)
        if ctx.needs_input_grad[1]:
            grad_w = kernels.combine_weight_grad(grad_TD, y_ND, pos_TK).to(weights_TK.dtype)
        return grad_y, grad_w, None, None, None, None, None


# -- per-placement state --------------------------------------------------------------------------


class _PlacementState:
    """Host facts about one placement, checked once, and its routing tables per (layer, device)."""

    def __init__(self, placement: Placement, rank: int, world_size: int, nodes=None) -> None:
        placement.validate()
        self.placement = placement  # strong reference: the cache key id() cannot be reused
        self.rank = rank
        self.world_size = world_size
        self.nodes = nodes
        slots_per_rank = np.bincount(placement.slot_device, minlength=world_size)
        self.slot_offsets = np.concatenate([[0], np.cumsum(slots_per_rank)]).astype(np.int64)
        self.slots_per_rank = slots_per_rank.tolist()
        self.num_local_slots = int(slots_per_rank[rank])
        self._tables: dict = {}
        self._count_index: dict = {}

    def table(self, layer: int, device: torch.device) -> RoutingTable:
        key = (layer, device)
        table = self._tables.get(key)
        if table is None:
            table = routing_table(self.placement, layer, self.rank, self.world_size, device=device,
                                  nodes=self.nodes)
            self._tables[key] = table
        return table

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
        exchange: how rows travel between ranks: "all_to_all" (one ``all_to_all_single`` each
            way and a reorder on the receiver), "p2p" (one point-to-point message per (peer,
            local slot), no reorder), or "auto": "p2p" where the group's backend for the rows'
            device is gloo, "all_to_all" for any other backend (NCCL). Both give bit-identical
            outputs and gradients.
        nodes: the node of each rank of the group (e.g. ``topology.node``): routing then sends
            a rank's pairs to replicas on its own node before other nodes (after its own
            device), keeping all-to-all traffic local; the shares are met either way. None: no
            node preference.
        debug: also check, with host syncs, that ``x`` and ``topk_weights`` are finite and that
            every expert id is in range before any communication (the id check always runs, for
            free, through the counts exchange).

    The routing tables of a placement are built on first use and cached by placement identity
    and layer; pass the same :class:`~moebalance.Placement` object every step (a new object
    means new tables).
    """

    def __init__(self, group=None, *, exchange: str = "auto", nodes=None,
                 debug: bool = False) -> None:
        if not isinstance(exchange, str) or exchange not in EXCHANGES:
            raise ValueError(f"exchange must be one of {list(EXCHANGES)}, got {exchange!r}; "
                             f"\"auto\" picks \"p2p\" on gloo and \"all_to_all\" on other backends")
        self._backend = None
        if dist.is_available() and dist.is_initialized():
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
            if self.rank < 0:
                raise ValueError("this process is not a member of group; build the Dispatcher "
                                 "only on the ranks of its expert-parallel group")
            self._backend = str(dist.get_backend(group))
        elif group is not None:
            raise ValueError("group was given but torch.distributed is not initialised; call "
                             "torch.distributed.init_process_group first, or pass group=None")
        else:
            self.rank, self.world_size = 0, 1
        self.group = group
        self.exchange = exchange
        if nodes is not None:
            nodes = np.asarray(nodes)
            if nodes.shape != (self.world_size,) or not np.issubdtype(nodes.dtype, np.integer):
                raise ValueError(f"nodes must give the integer node of each of the "
                                 f"{self.world_size} ranks of the group (e.g. topology.node), "
                                 f"got {nodes.tolist()!r}; or pass None for no node preference")
            nodes = tuple(int(n) for n in nodes)
        self.nodes = nodes
        self.debug = bool(debug)
        self._states: OrderedDict[int, _PlacementState] = OrderedDict()

    def __repr__(self) -> str:
        return (f"Dispatcher(rank={self.rank}, world_size={self.world_size}, "
                f"exchange={self.exchange!r}, debug={self.debug})")

    def exchange_for(self, device_type: str) -> str:
        """The exchange rows on ``device_type`` ("cpu", "cuda") use: "p2p" or "all_to_all",
        or "local" in a single process (no exchange)."""
        if self.world_size == 1:
            return "local"
        if self.exchange != "auto":
            return self.exchange
        return _auto_exchange(self._backend, device_type)

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
            state = _PlacementState(placement, self.rank, self.world_size, self.nodes)
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
        common = dict(order_N=order_N, pos_TK=pos_TK, topk_weights_TK=topk_weights_TK.contiguous(),
                      placement=placement, layer=int(layer), rank=self.rank)

        if self.world_size == 1:
            host = torch.cat([counts_S, bad]).tolist()
            self._raise_bad_ids([host[-1]], E)
            rows = _LocalRows(order_N.shape[0], order_N.shape[0])
            recv_x_MD = _Dispatch.apply(x_TD, token_N, pos_TK, rows, kernels)
            return recv_x_MD, DispatchHandle(tokens_per_local_slot=host[:-1], exchange=rows,
                                             **common)

        G, Ls = self.world_size, state.num_local_slots
        send_counts = torch.cat([counts_S, bad]).index_select(0, state.count_index(device))
        recv_counts = counts_S.new_empty(G * (Ls + 1))
        dist.all_to_all_single(recv_counts, send_counts, output_split_sizes=[Ls + 1] * G,
                               input_split_sizes=[s + 1 for s in state.slots_per_rank],
                               group=self.group)
        # The one host sync of the per-step path.
        host = np.asarray(torch.cat([recv_counts, counts_S]).tolist(), dtype=np.int64)
        recv_GL1 = host[:G * (Ls + 1)].reshape(G, Ls + 1)
        self._raise_bad_ids(recv_GL1[:, Ls].tolist(), E)
        recv_GL, counts_S_host = recv_GL1[:, :Ls], host[G * (Ls + 1):]
        if self.exchange_for(device.type) == "p2p":
            rows = _PointToPoint.build(self.group, self.rank, state.slot_offsets, counts_S_host,
                                       recv_GL)
        else:
            rows = _AllToAll.build(self.group, state.slot_offsets, counts_S_host, recv_GL,
                                   recv_counts.view(G, Ls + 1)[:, :Ls])
        recv_x_MD = _Dispatch.apply(x_TD, token_N, pos_TK, rows, kernels)
        handle = DispatchHandle(tokens_per_local_slot=recv_GL.sum(axis=0).tolist(), exchange=rows,
                                **common)
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
        K = handle.pos_TK.shape[1]
        return _Combine.apply(y_MD.contiguous(), handle.topk_weights_TK, handle.pos_TK,
                              handle.order_N // K, handle.order_N, handle.exchange, kernels)


def _auto_exchange(backend: str, device_type: str) -> str:
    """The exchange "auto" picks for rows on ``device_type`` in a group of ``backend``.

    ``backend`` is what ``torch.distributed.get_backend`` returns: one name ("gloo", "nccl") or
    one per device type ("cpu:gloo,cuda:nccl"). Point-to-point messages win on gloo (no reorder
    pass, own rows never enter the transport); elsewhere one all_to_all_single is the efficient
    collective.
    """
    name = backend.lower()
    if ":" in name:
        per_device = dict(part.split(":", 1) for part in name.split(","))
        name = per_device.get(device_type, name)
    return "p2p" if name == "gloo" else "all_to_all"
