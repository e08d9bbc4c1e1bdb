"""Row exchanges: how the rows of one dispatch travel between ranks, and back at combine.

Rows live in two orders: *sorted* (this rank's N pairs grouped by global slot, so by destination
rank, then its local slot) and *slot-major* (the M rows this rank's slots receive, grouped by
local slot, then by source rank). A row exchange moves rows between the two; there is one class
per strategy, all with the interface of :class:`RowExchange`, and the autograd functions of
:mod:`.autograd` are written against that interface alone.

* :class:`LocalRows`: a single process, nothing travels.
* :class:`PointToPoint` ("p2p"): one message per (peer, local slot of the receiver), all in
  flight at once; no reorder pass. The default on gloo.
* :class:`AllToAll` ("all_to_all"): one ``all_to_all_single`` each way and a reorder on the
  receiver. The default on NCCL and other backends.

Legend: T tokens, D hidden size, G ranks, Ls local slots, S global slots, N sorted rows (pairs
this rank sends), M slot-major rows (pairs this rank's slots receive).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

import numpy as np
import torch
import torch.distributed as dist

from .buffers import POOL

__all__ = ["EXCHANGES", "RowExchange", "LocalRows", "PointToPoint", "AllToAll", "auto_exchange"]

# Values of Dispatcher(exchange=...).
EXCHANGES = ("auto", "all_to_all", "p2p")


class RowExchange(Protocol):
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
class LocalRows:
    """A single process: every slot is local and sorted order is slot-major order."""

    name: ClassVar[str] = "local"
    num_sorted: int
    num_slot_major: int

    def to_slot_major(self, kernels, src_TD, index_N, scale_N) -> torch.Tensor:
        out_MD = POOL.empty((self.num_slot_major, src_TD.shape[1]), src_TD.dtype, src_TD.device)
        return kernels.gather_rows(src_TD, index_N, scale_N, out=out_MD)

    def to_sorted(self, kernels, src_MD) -> torch.Tensor:
        return src_MD

    def rows_per_rank(self, sent: bool) -> None:
        return None


@dataclass(frozen=True, eq=False)
class PointToPoint:
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
    def build(group, rank: int, slot_offsets, counts_S, recv_GL) -> PointToPoint:
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
        return PointToPoint(group, int(sorted_start[-1]), int(recv_GL.sum()), tuple(to_peer),
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
        send_ND = POOL.empty((self.num_sorted, D), dtype, device)
        lo, hi = self.local_span
        for a, b in ((0, lo), (hi, self.num_sorted)):
            if b > a:
                _gather_span(kernels, src_TD, index_N, scale_N, a, b, send_ND[a:b])
        out_MD = POOL.empty((self.num_slot_major, D), dtype, device)
        works = self._post(out_MD, self.from_peer, send_ND, self.to_peer)
        for sorted_start, slot_start, n in self.local:
            _gather_span(kernels, src_TD, index_N, scale_N, sorted_start, sorted_start + n,
                         out_MD[slot_start:slot_start + n])
        for work in works:
            work.wait()
        return out_MD

    def to_sorted(self, kernels, src_MD) -> torch.Tensor:
        out_ND = POOL.empty((self.num_sorted, src_MD.shape[1]), src_MD.dtype, src_MD.device)
        works = self._post(out_ND, self.to_peer, src_MD, self.from_peer)
        for sorted_start, slot_start, n in self.local:
            out_ND[sorted_start:sorted_start + n].copy_(src_MD[slot_start:slot_start + n])
        for work in works:
            work.wait()
        return out_ND


@dataclass(frozen=True, eq=False)
class AllToAll:
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
    def build(group, slot_offsets, counts_S, recv_GL, recv_counts_GL) -> AllToAll:
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
        return AllToAll(group, int(sorted_start[-1]), M, send_splits,
                         recv_GL.sum(axis=1).tolist(), index_M, inverse_M)

    def rows_per_rank(self, sent: bool) -> list:
        return list(self.send_splits if sent else self.recv_splits)

    def _all_to_all(self, src, num_out: int, out_splits: list, in_splits: list) -> torch.Tensor:
        out = POOL.empty((num_out, src.shape[1]), src.dtype, src.device)
        dist.all_to_all_single(out, src, output_split_sizes=out_splits,
                               input_split_sizes=in_splits, group=self.group)
        return out

    def to_slot_major(self, kernels, src_TD, index_N, scale_N) -> torch.Tensor:
        D, dtype, device = src_TD.shape[1], src_TD.dtype, src_TD.device
        send_ND = kernels.gather_rows(src_TD, index_N, scale_N,
                                      out=POOL.empty((self.num_sorted, D), dtype, device))
        by_rank_MD = self._all_to_all(send_ND, self.num_slot_major, self.recv_splits,
                                      self.send_splits)
        del send_ND   # back to the pool before the output is drawn from it
        return kernels.gather_rows(by_rank_MD, self.index_M,
                                   out=POOL.empty((self.num_slot_major, D), dtype, device))

    def to_sorted(self, kernels, src_MD) -> torch.Tensor:
        by_rank_MD = kernels.gather_rows(src_MD, self.inverse_M, out=POOL.empty(
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


def auto_exchange(backend: str, device_type: str) -> str:
    """The exchange "auto" picks for rows on ``device_type`` in a group of ``backend``.

    ``backend`` is one name ("gloo", "nccl") or one per device type, as
    ``torch.distributed.get_backend_config`` gives it ("cpu:gloo,cuda:nccl", "cpu:gloo").
    Point-to-point messages win on gloo (no reorder pass, own rows never enter the transport);
    elsewhere one all_to_all_single is the efficient collective.
    """
    name = backend.lower()
    if ":" in name:
        per_device = dict(part.split(":", 1) for part in name.split(","))
        name = per_device.get(device_type, name)
    return "p2p" if name == "gloo" else "all_to_all"
