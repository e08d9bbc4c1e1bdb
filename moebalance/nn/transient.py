"""Transient copies in a layer: a hot expert's weights lent to a cold rank for one step.

The dispatcher chooses the step's copies (:mod:`moebalance.dispatch.transient`) and routes part
of a copied expert's pairs to the copy's *transient slot* on its target rank. This module moves
what the copies need:

* **forward** (:func:`transient_weights`): the source rank sends the expert's slot rows (every
  slot tensor of the layer) to the target, which receives them into its K transient slots;
  one batch of point-to-point messages, every rank knowing the step's copies;
* **backward**: the target sends the gradient of each copy's rows to *every* holder of the
  expert (posted during backward, like the replicas' sums of :mod:`.grad_sync`); when
  backward ends each holder adds them to its row, after the replicas' sum and in copy order,
  so all holders keep the same bits and the gradient is the one the step would have without
  copies. The optimizer state never moves: the holders' update is unchanged.

A rank with no copy this step still runs its transient slots on zero rows, so every rank joins
the backward's messages (as :func:`~moebalance.nn.moe.looped_swiglu` does for empty slots).

Legend: K transient slots per rank, C copies of the step, Ls local slots.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..collective_errors import backward_attempt
from ..dispatch.transient import TransientStep
from ..migrate.wire import (
    TRANSIENT_TAG_BASE,
    TRANSIENT_TAG_COPIES,
    TRANSIENT_TAG_KINDS,
    TRANSIENT_TAG_LAYERS,
)

__all__ = ["transient_weights", "check_transient"]


def check_transient(transient: int, world_size: int, grad_sync: str, num_slot_tensors: int) -> None:
    """Refuse transient slots a layer cannot run (named argument, the fix)."""
    if transient and world_size > 1:
        if grad_sync != "backward":
            raise ValueError(f"transient={transient} needs grad_sync=\"backward\" (the copies' "
                             f"gradients return when backward ends), got {grad_sync!r}; or pass "
                             f"transient=0")
        if transient * world_size > TRANSIENT_TAG_COPIES:
            raise ValueError(f"transient={transient} slots on {world_size} ranks exceed the "
                             f"{TRANSIENT_TAG_COPIES} copies a step can tag; use transient <= "
                             f"{TRANSIENT_TAG_COPIES // world_size}")
        if num_slot_tensors > TRANSIENT_TAG_KINDS:
            raise ValueError(f"a layer with transient slots may have at most "
                             f"{TRANSIENT_TAG_KINDS} slot tensors, got {num_slot_tensors}")


def _tag(layer: int, phase: int, copy: int, kind: int) -> int:
    return (TRANSIENT_TAG_BASE + (((layer % TRANSIENT_TAG_LAYERS) * 2 + phase)
                                  * TRANSIENT_TAG_COPIES + copy) * TRANSIENT_TAG_KINDS + kind)


class _Link:
    """One step's copies as seen by one rank of one layer."""

    def __init__(self, layer, step: TransientStep) -> None:
        self.step = step
        self.group = layer.dispatcher.group
        self.rank = layer.dispatcher.rank
        self.layer = int(layer.layer)
        self.sync = layer._sync
        local = layer.local_experts.tolist()
        # A rank holds at most one replica of an expert: its local slot, by expert.
        self.slot_of = {int(e): i for i, e in enumerate(local)}

    def _op(self, op, tensor, peer, tag):
        return dist.P2POp(op, tensor, group=self.group, group_peer=peer, tag=tag)

    def fetch(self, slot_params) -> tuple:
        """Each slot tensor's K transient rows on this rank, filled with the copies' weights."""
        step, rank = self.step, self.rank
        outs = tuple(p.new_zeros((step.num_slots,) + tuple(p.shape[1:])) for p in slot_params)
        ops = []
        for c, ((expert, source, target), k) in enumerate(zip(step.copies_C3.tolist(),
                                                              step.slot_C.tolist())):
            for kind, (param, out) in enumerate(zip(slot_params, outs)):
                tag = _tag(self.layer, 0, c, kind)
                if rank == source:
                    ops.append(self._op(dist.isend, param[self.slot_of[expert]].detach(),
                                        target, tag))
                elif rank == target:
                    ops.append(self._op(dist.irecv, out[k], source, tag))
        for work in (dist.batch_isend_irecv(ops) if ops else []):
            work.wait()
        return outs

    def post_gradients(self, slot_params, grads) -> None:
        """Send the copies' gradients to their experts' holders; add them when backward ends."""
        step, rank, sync = self.step, self.rank, self.sync
        failures = backward_attempt(self.group)
        ops, sent, inbox = [], [], []
        for c, ((expert, _, target), k, holders) in enumerate(zip(
                step.copies_C3.tolist(), step.slot_C.tolist(), step.holders_C)):
            if rank == target:
                for kind, grad in enumerate(grads):
                    row = grad[k].contiguous()
                    sent.append(row)
                    ops += [self._op(dist.isend, row, h, _tag(self.layer, 1, c, kind))
                            for h in holders]
            if rank in holders:
                rows = [param.new_empty(param.shape[1:]) for param in slot_params]
                ops += [self._op(dist.irecv, row, target, _tag(self.layer, 1, c, kind))
                        for kind, row in enumerate(rows)]
                inbox.append((self.slot_of[expert], rows))
        works = []
        with failures.run():
            works = dist.batch_isend_irecv(ops) if ops else []

        def add_copies() -> None:
            for work in works:
                work.wait()
            del sent[:]
            for slot, rows in inbox:
                for param, row in zip(slot_params, rows):
                    if param.grad is None:
                        param.grad = torch.zeros_like(param)
                    param.grad[slot] += row if sync.scale == 1.0 else row * sync.scale

        sync.add_late(add_copies)


class _TransientWeights(torch.autograd.Function):
    """The copies' rows as a function of the slot tensors (backward: :meth:`_Link.post_gradients`,
    which adds into ``.grad`` itself when backward ends and so returns no gradient here)."""

    @staticmethod
    def forward(ctx, link: _Link, *slot_params):
        ctx.link = link
        ctx.slot_params = slot_params
        return link.fetch(slot_params)

    @staticmethod
    def backward(ctx, *grads):
        ctx.link.post_gradients(ctx.slot_params, grads)
        return (None,) * (1 + len(grads))


def transient_weights(layer, step: TransientStep) -> tuple:
    """Each of ``layer``'s slot tensors' [K, ...] transient rows for this step's copies.

    Collective over the layer's group (every rank calls it after the same dispatch). Tracked by
    autograd when the slot tensors require grad: the copies' gradients then return to the
    holders when backward ends (:class:`_Link`).
    """
    return _TransientWeights.apply(_Link(layer, step), *layer.slot_parameters())
