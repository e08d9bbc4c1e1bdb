"""Gradient reduction of replicated parameters: expert replicas among their holders, the rest over the group.

Replicas of an expert must stay identical (DESIGN invariant 3), so each replica's gradient
becomes the sum of the gradients of all replicas of that expert. :class:`HolderExchange` does it
among the holders only: a holder sends its row to each other holder of the expert and sums the
rows it receives in ascending holder-rank order, so every holder computes the same sum bit for
bit and no rank carries rows of experts it does not hold. A rank sends, per step and per
replicated expert it holds, ``(h - 1)`` rows (``h`` the expert's replica count), one
point-to-point message per peer and tensor; a dense all-reduce over all replicated experts would
send about ``2 (G - 1) / G`` rows of *every* replicated expert from every rank. (A two-phase
reduce-scatter among holders would send ``2 (h - 1) / h`` rows; for the usual ``h`` of 2 that
is the same, and one phase overlaps with backward without a second round.)

:class:`GradientSync` drives the exchange during backward. A tensor hook sees each backward's
*increment* of a parameter's gradient before it is accumulated: it posts the exchange of the
replicated rows (async), and returns the increment with those rows zeroed; a callback queued on
the autograd engine waits for the exchange when backward ends and adds the sum to ``.grad``.
``.grad`` then holds ``previous + sum of increments`` on every replica, bit-identical, also under
gradient accumulation, and it is final when ``backward()`` returns, before any gradient clipping.
Parameters replicated on every rank (a router, embeddings) use the same path with an all-reduce
(SUM) of the whole increment, in buckets of a few MB launched in a fixed order as they fill.

Legend: Ls local slots, n local slots of replicated experts, H most replicas of any expert of the
layer, G ranks.
"""

from __future__ import annotations

import weakref
from typing import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch.autograd import Variable

__all__ = ["HolderExchange", "GradientSync"]

# Point-to-point tags of gradient messages: base + layer * kinds + kind.
_TAG_BASE = 1 << 24
_TAG_KINDS = 16


class HolderExchange:
    """Which rows of one layer's slot tensors this rank swaps with which peer, and how to sum them.

    Args:
        phy2log_S: [S] logical expert of each global slot of the layer.
        slot_device_S: [S] device (rank) of each slot, non-decreasing.
        rank: this rank.
        tag: a number unique to the layer within its group (messages carry it).
    """

    def __init__(self, phy2log_S: np.ndarray, slot_device_S: np.ndarray, rank: int, tag: int) -> None:
        phy2log_S = np.asarray(phy2log_S, dtype=np.int64)
        slot_device_S = np.asarray(slot_device_S, dtype=np.int64)
        lo, hi = np.searchsorted(slot_device_S, [rank, rank + 1])
        local = phy2log_S[lo:hi]
        replicas = np.bincount(phy2log_S)
        rep_slots = np.flatnonzero(replicas[local] > 1)            # [n] local slot indices
        self.rank = int(rank)
        self.tag = int(tag)
        self.num_held = int(rep_slots.size)
        self.height = int(replicas.max()) if phy2log_S.size else 1  # H, the same on every rank
        self.rep_slots = torch.from_numpy(rep_slots)
        own_index = np.empty(rep_slots.size, dtype=np.int64)
        peers: dict[int, tuple[list, list]] = {}                   # peer -> (my slots, contrib index)
        for i, s in enumerate(rep_slots.tolist()):
            expert = int(local[s])
            holders = np.sort(slot_device_S[phy2log_S == expert])
            for j, holder in enumerate(holders.tolist()):
                if holder == rank:
                    own_index[i] = j * rep_slots.size + i
                else:
                    mine, into = peers.setdefault(holder, ([], []))
                    mine.append((expert, s))
                    into.append((expert, j * rep_slots.size + i))
        self.own_index = torch.from_numpy(own_index)
        # Per peer, rows in ascending expert id on both sides, so the two ends agree on order.
        self.peers = []
        for peer in sorted(peers):
            mine, into = peers[peer]
            self.peers.append((peer, torch.tensor([s for _, s in sorted(mine)], dtype=torch.int64),
                               torch.tensor([k for _, k in sorted(into)], dtype=torch.int64)))
        self.rows_sent = sum(int(slots.numel()) for _, slots, _ in self.peers)

    def bytes_sent(self, tensors: Sequence[torch.Tensor]) -> int:
        """Bytes this rank sends per exchange of ``tensors`` ([Ls, ...] each)."""
        return self.rows_sent * sum(t[0].numel() * t.element_size() for t in tensors)

    def post(self, increment: torch.Tensor, kind: int, group) -> "_Posted":
        """Start exchanging the replicated rows of ``increment`` ([Ls, ...], one slot tensor's
        gradient increment); ``kind`` numbers the tensor within the layer."""
        device = increment.device
        n = self.num_held
        contrib = increment.new_zeros((self.height * n, *increment.shape[1:]))
        contrib.index_copy_(0, self.own_index.to(device),
                            increment.index_select(0, self.rep_slots.to(device)))
        ops, landing = [], []
        tag = _TAG_BASE + self.tag * _TAG_KINDS + kind
        for peer, slots, into in self.peers:
            out = increment.index_select(0, slots.to(device))
            inc = torch.empty_like(out)
            ops.append(dist.P2POp(dist.isend, out, group=group, group_peer=peer, tag=tag))
            ops.append(dist.P2POp(dist.irecv, inc, group=group, group_peer=peer, tag=tag))
            landing.append((inc, into.to(device)))
        works = dist.batch_isend_irecv(ops) if ops else []
        return _Posted(works, contrib, landing, n, self.height)

    def finish(self, posted: "_Posted") -> torch.Tensor:
        """Wait for ``posted`` and return the summed rows [n, ...] (holder-rank order)."""
        for work in posted.works:
            work.wait()
        contrib = posted.contrib
        for inc, into in posted.landing:
            contrib.index_copy_(0, into, inc)
        parts = contrib.view(posted.height, posted.n, *contrib.shape[1:])
        total = parts[0].clone()
        for j in range(1, posted.height):
            total += parts[j]
        return total


class _Posted:
    def __init__(self, works, contrib, landing, n, height) -> None:
        self.works, self.contrib, self.landing, self.n, self.height = works, contrib, landing, n, height


class GradientSync:
    """Reduce gradients during backward: expert slot rows among holders, other tensors over the group.

    Args:
        group: the process group.
        exchange_for: a callable returning the current :class:`HolderExchange` of the slot
            tensors (read at every backward, so a placement change takes effect at once); None
            when there are no slot tensors.
        slot_params: the slot tensors ([Ls, ...] each) whose replicated rows are reduced.
        group_params: tensors replicated on every rank whose gradients are summed over the group.
        scale: factor on every reduced gradient (1: gradients of the sum of the ranks' losses;
            1 / G: of their mean, for losses that each rank averages over its own tokens).

    ``enabled`` False makes the hooks pass gradients through untouched (manual reduction).
    """

    def __init__(self, group, exchange_for: Callable[[], HolderExchange] | None,
                 slot_params: Sequence[torch.nn.Parameter],
                 group_params: Sequence[torch.nn.Parameter] = (), *, scale: float = 1.0) -> None:
        self.group = group
        self.exchange_for = exchange_for
        self.scale = float(scale)
        self.group_params = [p for p in group_params if p.requires_grad]
        self.enabled = True
        self._pending: list[Callable[[], None]] = []
        self._queued = False
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
        if not self._queued:
            self._queued = True
            Variable._execution_engine.queue_callback(self._finish)

    def _finish(self) -> None:
        if self.group_params:
            self._launch_ready(everything=True)
            self._launched = 0
        pending, self._pending, self._queued = self._pending, [], False
        for step in pending:
            step()

    # The hooks hold the sync and their tensor by weak reference: a tensor whose hook refers back
    # to it (or to a module owning it) makes a cycle that only the garbage collector frees, so the
    # module and its process group would outlive the user's last reference, often until exit.
    def _slot_hook(self, param: torch.nn.Parameter, kind: int):
        sync_ref, param_ref = weakref.ref(self), weakref.ref(param)

        def reduce_replicas(grad: torch.Tensor):
            self, param = sync_ref(), param_ref()
            if self is None or param is None or not self.enabled:
                return None
            exchange = self.exchange_for()
            scaled = grad if self.scale == 1.0 else grad * self.scale
            if exchange.num_held == 0 and not exchange.peers:
                return None if self.scale == 1.0 else scaled
            posted = exchange.post(grad, kind, self.group)
            rows = exchange.rep_slots.to(grad.device)

            def add_sum():
                total = exchange.finish(posted)
                if self.scale != 1.0:
                    total = total * self.scale
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                param.grad.index_add_(0, rows, total.to(param.grad.dtype))

            self._pending.append(add_sum)
            self._queue_finish()
            return scaled.index_fill(0, rows, 0)

        return reduce_replicas

    def _group_hook(self, param: torch.nn.Parameter):
        bucket = self._bucket_of[id(param)]
        sync_ref, param_ref = weakref.ref(self), weakref.ref(param)

        def sum_over_group(grad: torch.Tensor):
            self, param = sync_ref(), param_ref()
            if self is None or param is None or not self.enabled:
                return None
            self._ready[bucket][id(param)] = grad.detach()
            if len(self._ready[bucket]) == len(self._buckets[bucket]):
                self._launch_ready()
            self._queue_finish()
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
