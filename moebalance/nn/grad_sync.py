"""Reduce replicated parameters' gradients: expert replicas among holders, the rest over the group.

Replicas of an expert must stay identical (DESIGN invariant 3), so each replica's gradient
becomes the sum of the gradients of all replicas of that expert. :class:`HolderExchange` does it
among the holders only, so no rank carries rows of experts it does not hold, and every holder
ends with the same bits. An expert with two holders takes one phase (each sends its row to the
other, during backward); one with ``h >= 3`` takes two, a reduce-scatter of ``h`` chunks among
its holders during backward and an all-gather of the summed chunks when backward ends, each
chunk summed once in ascending holder-rank order. A rank sends, per step and per replicated
expert it holds, one row when ``h`` is 2 and about ``2 (h - 1) / h`` rows otherwise (sending
the whole row to every other holder would cost ``h - 1``: hot experts of a large model have
10-20 replicas); a dense all-reduce over all replicated experts would send about
``2 (G - 1) / G`` rows of *every* replicated expert from every rank.

:class:`GradientSync` drives the exchange during backward. A tensor hook sees each backward's
*increment* of a parameter's gradient before it is accumulated: it posts the exchange of the
replicated rows (async), and returns the increment with those rows zeroed; a callback queued on
the autograd engine waits for the exchange when backward ends and adds the sum to ``.grad``.
``.grad`` then holds ``previous + sum of increments`` on every replica, bit-identical, also under
gradient accumulation, and it is final when ``backward()`` returns, before any gradient clipping.
A hook or finishing step that fails on one rank posts zeros instead, so that every rank posts the
same messages, and the group agrees on the failure when backward ends
(:func:`moebalance.collective_errors.close_backward`): every rank raises the same error.
Parameters replicated on every rank (a router, embeddings) use the same path with an all-reduce
(SUM) of the whole increment, in buckets of a few MB launched in a fixed order as they fill.

Legend: Ls local slots, n local slots of replicated experts, R elements of one slot row, G ranks.
"""

from __future__ import annotations

import weakref
from typing import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch.autograd import Variable

from ..collective_errors import backward_attempt, close_backward, note_gradients
from ..device_index import DeviceIndex
from ..migrate.wire import GRAD_SYNC_TAG_BASE, GRAD_SYNC_TAG_KINDS, TAG_SPACES, tag_space

__all__ = ["HolderExchange", "GradientSync"]



class HolderExchange:
    """Which rows of one layer's slot tensors this rank swaps with which peer, and how to sum them.

    An expert with two holders is summed in one phase: each holder sends its row to the other
    and adds the two (the same bits either way round). An expert with ``h >= 3`` holders is
    summed in two: its row is cut into ``h`` chunks, the holder at position ``j`` (ascending
    rank) receives chunk ``j`` from every other holder and sums the ``h`` of them in holder
    order, then sends the sum to every other holder. A holder then sends ``2 (h - 1) / h`` rows
    instead of ``h - 1``, and every holder gets the same bits, each chunk being summed once.

    Args:
        phy2log_S: [S] logical expert of each global slot of the layer.
        slot_device_S: [S] device (rank) of each slot, non-decreasing.
        rank: this rank.
        tag: a number unique to the layer within its group (messages carry it).
    """

    def __init__(self, phy2log_S: np.ndarray, slot_device_S: np.ndarray, rank: int,
                 tag: int) -> None:
        phy2log_S = np.asarray(phy2log_S, dtype=np.int64)
        slot_device_S = np.asarray(slot_device_S, dtype=np.int64)
        lo, hi = np.searchsorted(slot_device_S, [rank, rank + 1])
        local = phy2log_S[lo:hi]
        replicas = np.bincount(phy2log_S)
        rep_slots = np.flatnonzero(replicas[local] > 1)            # [n] local slot indices
        self.rank = int(rank)
        self.tag = int(tag)
        last = GRAD_SYNC_TAG_BASE + ((self.tag + 1) * GRAD_SYNC_TAG_KINDS) * 2 - 1
        if self.tag < 0 or last not in tag_space("grad_sync"):
            raise ValueError(f"tag {tag} puts gradient messages outside their tag space "
                             f"{TAG_SPACES['grad_sync']}; layer tags must be small "
                             "non-negative ints")
        self.num_held = int(rep_slots.size)
        self.rep_slots = torch.from_numpy(rep_slots)
        self._rep_slots = DeviceIndex(self.rep_slots)     # device copies, made once per device
        pairs: dict[int, list] = {}      # peer -> [(expert, i)], i indexes rep_slots
        splits: dict[int, list] = {}     # peer -> [(expert, i, my position, its position, h)]
        self.split = []                  # (i, my position, h) of each expert with h >= 3
        for i, s in enumerate(rep_slots.tolist()):
            expert = int(local[s])
            holders = np.sort(slot_device_S[phy2log_S == expert]).tolist()
            me = holders.index(rank)
            if len(holders) == 2:
                pairs.setdefault(holders[1 - me], []).append((expert, i))
                continue
            self.split.append((i, me, len(holders)))
            for j, holder in enumerate(holders):
                if holder != rank:
                    splits.setdefault(holder, []).append((expert, i, me, j, len(holders)))
        # Per peer, entries in ascending expert id on both sides, so the two ends agree on order.
        self.pairs = [(peer, torch.tensor([i for _, i in sorted(pairs[peer])], dtype=torch.int64))
                      for peer in sorted(pairs)]
        self.splits = [(peer, [entry[1:] for entry in sorted(splits[peer])])
                       for peer in sorted(splits)]
        self._pair_rows = [DeviceIndex(rows) for _, rows in self.pairs]

    def rep_slots_on(self, device: torch.device) -> torch.Tensor:
        """``rep_slots`` [n] on ``device`` (copied once per device: no per-step host sync)."""
        return self._rep_slots.on(device)

    def elements_sent(self, row_numel: int) -> int:
        """Elements this rank sends per exchange of one tensor whose rows have ``row_numel``."""
        sent = sum(int(rows.numel()) for _, rows in self.pairs) * row_numel
        for _, me, h in self.split:
            mine = _chunk(row_numel, h, me)
            sent += row_numel - (mine[1] - mine[0]) + (h - 1) * (mine[1] - mine[0])
        return sent

    def bytes_sent(self, tensors: Sequence[torch.Tensor]) -> int:
        """Bytes this rank sends per exchange of ``tensors`` ([Ls, ...] each)."""
        return sum(self.elements_sent(t[0].numel()) * t.element_size() for t in tensors)

    def _tag(self, kind: int, phase: int) -> int:
        return GRAD_SYNC_TAG_BASE + (self.tag * GRAD_SYNC_TAG_KINDS + kind) * 2 + phase

    def post(self, increment: torch.Tensor, kind: int, group) -> "_Posted":
        """Start exchanging the replicated rows of ``increment`` ([Ls, ...], one slot tensor's
        gradient increment); ``kind`` numbers the tensor within the layer."""
        device = increment.device
        # The row length is explicit: with no replicated row (n = 0) -1 could not be inferred.
        mine_nR = increment.index_select(0, self.rep_slots_on(device)).reshape(
            self.num_held, increment[0].numel())
        R = mine_nR.shape[1]
        ops, pair_in, split_in = [], [], []
        tag = self._tag(kind, 0)
        for (peer, _), rows_on in zip(self.pairs, self._pair_rows):
            rows = rows_on.on(device)
            out = mine_nR.index_select(0, rows)
            inc = torch.empty_like(out)
            ops += _send_recv(out, inc, group, peer, tag)
            pair_in.append((rows, inc))
        for peer, entries in self.splits:
            # Chunk `its position` of each shared row goes out; chunk `my position` comes in.
            out = torch.cat([mine_nR[i, slice(*_chunk(R, h, j))] for i, _, j, h in entries])
            size = sum(_size(R, h, me) for _, me, _, h in entries)
            inc = mine_nR.new_empty(size)
            ops += _send_recv(out, inc, group, peer, tag)
            split_in.append((peer, entries, inc))
        works = dist.batch_isend_irecv(ops) if ops else []
        return _Posted(works, mine_nR, pair_in, split_in, increment.shape[1:], kind, group)

    def finish(self, posted: "_Posted") -> torch.Tensor:
        """Wait for ``posted`` and return the summed rows [n, ...] (holder-rank order)."""
        for work in posted.works:
            work.wait()
        mine_nR = posted.mine
        R = mine_nR.shape[1]
        total_nR = mine_nR.clone()
        for rows, inc in posted.pair_in:
            total_nR.index_add_(0, rows, inc)      # a + b: the same bits on both holders
        if self.split:
            self._reduce_chunks(posted, total_nR, R)
        return total_nR.view(self.num_held, *posted.row_shape)

    def _reduce_chunks(self, posted: "_Posted", total_nR: torch.Tensor, R: int) -> None:
        """Second phase: sum my chunk of each split expert, send it to its other holders and
        place the sums they send back."""
        parts: dict[int, dict[int, torch.Tensor]] = {i: {} for i, _, _ in self.split}
        for _, entries, inc in posted.split_in:
            offset = 0
            for i, me, j, h in entries:
                n = _size(R, h, me)
                parts[i][j] = inc[offset:offset + n]
                offset += n
        for i, me, h in self.split:
            a, b = _chunk(R, h, me)
            parts[i][me] = posted.mine[i, a:b]
            acc = parts[i][0].clone()
            for j in range(1, h):
                acc += parts[i][j]
            total_nR[i, a:b] = acc
        ops, landing = [], []
        tag = self._tag(posted.kind, 1)
        for peer, entries in self.splits:
            out = torch.cat([total_nR[i, slice(*_chunk(R, h, me))] for i, me, _, h in entries])
            inc = total_nR.new_empty(sum(_size(R, h, j) for _, _, j, h in entries))
            ops += _send_recv(out, inc, posted.group, peer, tag)
            landing.append((entries, inc))
        for work in (dist.batch_isend_irecv(ops) if ops else []):
            work.wait()
        for entries, inc in landing:
            offset = 0
            for i, _, j, h in entries:
                a, b = _chunk(R, h, j)
                total_nR[i, a:b] = inc[offset:offset + b - a]
                offset += b - a


def _send_recv(out: torch.Tensor, inc: torch.Tensor, group, peer: int, tag: int) -> list:
    """P2P ops of one message each way; an empty one (rows shorter than their holder count)
    is skipped, on both ends alike since both compute its size."""
    ops = ([dist.P2POp(dist.isend, out, group=group, group_peer=peer, tag=tag)] if out.numel()
           else [])
    if inc.numel():
        ops.append(dist.P2POp(dist.irecv, inc, group=group, group_peer=peer, tag=tag))
    return ops


def _chunk(R: int, h: int, j: int) -> tuple[int, int]:
    """[start, stop) of chunk ``j`` of a row of ``R`` elements cut into ``h``."""
    return j * R // h, (j + 1) * R // h


def _size(R: int, h: int, j: int) -> int:
    a, b = _chunk(R, h, j)
    return b - a


class _Posted:
    def __init__(self, works, mine, pair_in, split_in, row_shape, kind, group) -> None:
        self.works, self.mine, self.pair_in, self.split_in = works, mine, pair_in, split_in
        self.row_shape, self.kind, self.group = row_shape, kind, group


class GradientSync:
    """Reduce gradients in backward: expert slot rows among holders, other tensors over the group.

    Args:
        group: the process group.
        exchange_for: a callable returning the current :class:`HolderExchange` of the slot
            tensors (read at every backward, so a placement change takes effect at once); None
            when there are no slot tensors.
        slot_params: the slot tensors ([Ls, ...] each) whose replicated rows are reduced.
        group_params: tensors replicated on every rank whose gradients are summed over the group.
        scale: factor on every reduced gradient (1: gradients of the sum of the ranks' losses;
            1 / G: of their mean, for losses that each rank averages over its own tokens).

    ``enabled`` False makes the hooks pass gradients through untouched (manual reduction);
    ``group_enabled`` False does it for ``group_params`` alone (a DDP around the model reduces
    them).
    """

    def __init__(self, group, exchange_for: Callable[[], HolderExchange] | None,
                 slot_params: Sequence[torch.nn.Parameter],
                 group_params: Sequence[torch.nn.Parameter] = (), *, scale: float = 1.0) -> None:
        self.group = group
        self.exchange_for = exchange_for
        self.scale = float(scale)
        self.group_params = [p for p in group_params if p.requires_grad]
        self.enabled = True
        self.group_enabled = True
        self._pending: list[Callable[[], None]] = []
        self._late: list[Callable[[], None]] = []     # after every sum (add_late)
        self._queued = None      # the backward (graph task id) whose finishing step is queued
        self._slots = [weakref.ref(p) for p in slot_params]
        self._handles = []
        for kind, param in enumerate(slot_params):
            self._handles.append(param.register_hook(self._slot_hook(param, kind)))
        self._make_buckets()
        for param in self.group_params:
            self._handles.append(param.register_hook(self._group_hook(param)))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _queue_finish(self) -> None:
        task = torch._C._current_graph_task_id()
        if self._queued != task:
            if self._queued is not None:
                # A backward that stopped before its end (an exception in the engine) left steps
                # of its own: they must not add into this one's gradients.
                self._pending = []
                self._late = []
                self._ready = [{} for _ in self._buckets]
                self._launched = 0
            self._queued = task
            Variable._execution_engine.queue_callback(self._finish)

    def _finish(self) -> None:
        failures = backward_attempt(self.group)
        if self.group_params and self.group_enabled:
            with failures.run():
                self._launch_ready(everything=True)
            self._launched = 0
        pending, self._pending, self._queued = self._pending + self._late, [], None
        self._late = []
        for step in pending:
            with failures.run():
                step()
        note_gradients(self.group, [ref() for ref in self._slots])
        close_backward(self.group)

    def add_late(self, step: Callable[[], None]) -> None:
        """Run ``step`` when this backward ends, after every sum of the replicas' gradients
        (the transient copies' gradients are added there, in one order on every holder)."""
        self._queue_finish()
        self._late.append(step)

    # The hooks hold the sync and their tensor by weak reference: a tensor whose hook refers back
    # to it (or to a module owning it) makes a cycle that only the garbage collector frees, so the
    # module and its process group would outlive the user's last reference, often until exit.
    def _slot_hook(self, param: torch.nn.Parameter, kind: int):
        sync_ref, param_ref = weakref.ref(self), weakref.ref(param)

        def reduce_replicas(grad: torch.Tensor):
            self, param = sync_ref(), param_ref()
            if self is None or param is None or not self.enabled:
                return None
            # First: a backward that stopped early leaves steps that this call clears. And every
            # rank ends the backward alike (one agreement), whether it holds a replicated expert
            # or not: under a DDP (or with frozen routers) no other hook of a rank that holds none
            # would, and its peers would wait for it in that agreement.
            self._queue_finish()
            exchange = self.exchange_for()
            scaled = grad if self.scale == 1.0 else grad * self.scale
            if exchange.num_held == 0:
                return None if self.scale == 1.0 else scaled
            failures = backward_attempt(self.group)
            try:
                posted = exchange.post(grad, kind, self.group)
            except Exception as exc:  # noqa: BLE001 - agreed on when backward ends
                failures.fail(exc)
                # Zeros take this rank's part, so its peers' messages still find their match.
                posted = exchange.post(torch.zeros_like(param), kind, self.group)
            rows = exchange.rep_slots_on(grad.device)
            # With no gradient before this backward (zero_grad's default), the replicated rows
            # are overwritten with their sum when it ends; with one (accumulation) they are
            # zeroed here and the sum added then. Both give prior + sum in the same bits, and the
            # first saves a copy of the whole gradient per backward.
            first = param.grad is None

            def add_sum():
                total = exchange.finish(posted)
                if self.scale != 1.0:
                    total = total * self.scale
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                if first:
                    param.grad.index_copy_(0, rows, total.to(param.grad.dtype))
                else:
                    param.grad.index_add_(0, rows, total.to(param.grad.dtype))

            self._pending.append(add_sum)
            return scaled if first else scaled.index_fill(0, rows, 0)

        return reduce_replicas

    def _group_hook(self, param: torch.nn.Parameter):
        bucket = self._bucket_of[id(param)]
        sync_ref, param_ref = weakref.ref(self), weakref.ref(param)

        def sum_over_group(grad: torch.Tensor):
            self, param = sync_ref(), param_ref()
            if self is None or param is None or not (self.enabled and self.group_enabled):
                return None
            self._queue_finish()
            self._ready[bucket][id(param)] = grad.detach()
            if len(self._ready[bucket]) == len(self._buckets[bucket]):
                self._launch_ready()
            return torch.zeros_like(grad)

        return sum_over_group

    # Replicated tensors travel in buckets of about BUCKET_BYTES, each one all-reduce, launched in
    # bucket order (the same on every rank, as collectives must be) as soon as a bucket's last
    # gradient arrives; whatever backward did not reach goes as zeros when backward ends.
    BUCKET_BYTES = 4 << 20

    def _make_buckets(self) -> None:
        self._buckets: list[list[torch.nn.Parameter]] = []
        self._bucket_of: dict[int, int] = {}
        size = 0
        # Reverse order of registration is roughly the order in which backward produces them.
        for param in reversed(self.group_params):
            if not self._buckets or size + param.numel() * param.element_size() > self.BUCKET_BYTES:
                self._buckets.append([])
                size = 0
            self._bucket_of[id(param)] = len(self._buckets) - 1
            self._buckets[-1].append(param)
            size += param.numel() * param.element_size()
        self._ready: list[dict] = [{} for _ in self._buckets]
        self._launched = 0

    def _launch_ready(self, everything: bool = False) -> None:
        while self._launched < len(self._buckets):
            index = self._launched
            ready = self._ready[index]
            params = self._buckets[index]
            if not everything and len(ready) < len(params):
                return
            flat = torch.cat([ready[id(p)].reshape(-1) if id(p) in ready else p.new_zeros(p.numel())
                              for p in params])
            work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            self._pending.append(lambda work=work, flat=flat, params=params: self._add_bucket(
                work, flat, params))
            self._ready[index] = {}
            self._launched += 1

    def _add_bucket(self, work, flat: torch.Tensor, params) -> None:
        work.wait()
        if self.scale != 1.0:
            flat = flat * self.scale
        for param, part in zip(params, flat.split([p.numel() for p in params])):
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            param.grad += part.view_as(param)
