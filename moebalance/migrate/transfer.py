"""Moving expert rows beside the step: :class:`Migrator` and its handle :class:`Migration`.

:mod:`.plan` says which rows move where (after vLLM's split of *what* moves from *how*);
:class:`Migrator` moves the rows of the slot tensors (weights, and every optimizer state tensor
shaped like its parameter: SGD ``momentum_buffer``, Adam ``exp_avg``, ``exp_avg_sq``,
``max_exp_avg_sq``, ...) with torch.distributed point-to-point ops (tags from :mod:`.wire`) into
staging buffers and returns a :class:`Migration`, the handle that commits them.

The protocol, and why it is exact. A moved expert's copy must equal the expert as of the step
it starts serving, although training goes on while it travels. Rows are read (packed into send
buffers) at a step boundary, right after an optimizer step, and a layer commits *before its next
forward*: between the two nothing changes the expert's weights or optimizer state, so the
staged copy is the expert. The transfers overlap with everything that runs in between (the
loader, the layers before it in the forward). On a GPU the packing and staging run on a side
stream whose indices arrive through pinned memory without a host wait, and a commit orders its
writes after the side stream with an event, also when every move of the layer stays on its
rank. A layer whose staged rows meet an optimizer step before they commit (the layer did not
run a forward in that step) is stale: the optimizer's step post-hook drops it and sends it
again right away. (A forward inside ``optimizer.step(closure)``, as Lightning runs it, commits
before the update, which is as exact.) Keeping a staged copy current by replaying the
optimizer update on it would avoid that resend, but only by re-implementing every optimizer; a
resend is one more transfer of the same bytes.

Commit of a layer: every rank waits for its own transfers of the layer (with a timeout) and checks
that every staged row fits the row it replaces (shape, dtype, device, slot index), then the
ranks agree with one small collective (with NCCL a host sync, once per committed layer); only if
every rank's transfers landed do all ranks copy the staged rows into place (weights and
optimizer state together) and call the layer's commit
callbacks (the caller swaps placement, routing and gradient-sync tables there). If any rank
failed (an exception in its transfer, a peer that never sent), no row of the layer is written
on any rank, every rank abandons the rest of the migration with the same
:class:`MigrationError` text (``Migration.error``; raised by :meth:`Migration.wait`) and keeps
serving the old placement of every layer not yet committed; layers already committed hold the
new placement, which is as valid. The next re-plan starts from what the layers hold.

Layers start together or a few at a time: with ``max_bytes_in_flight`` a migration starts the
layers that fit (at least one) and the rest at the following boundaries, one optimizer step each.

Legend: L layers, S global slots, G ranks, M moved slots, Ls local slots.
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist

from ..collective_errors import GroupError, flag_device, only_gloo
from ..device_index import to_device_async
from .plan import MigrationPlan
from .wire import (
    MIGRATION_NUMBERS,
    MIGRATION_TAG_BASE,
    MIGRATION_TAG_KINDS,
    MIGRATION_TAG_LAYERS,
    group_key,
    same_everywhere,
)

__all__ = ["Migrator", "Migration", "MigrationError"]

log = logging.getLogger("moebalance")

_TRANSFER_GROUPS: dict = {}     # ranks of a group -> the connections its migrations use
_GENERATION: dict = {}
_BROKEN_GROUPS: list = []

class MigrationError(GroupError):
    """A migration failed on some rank; every rank raises the same text, keeps the old placement."""


def shaped_state(optimizer, param: torch.Tensor) -> dict:
    """The optimizer state tensors of ``param`` that have its shape (moved with its rows)."""
    if optimizer is None:
        return {}
    state = optimizer.state.get(param, {})
    return {name: value for name, value in sorted(state.items())
            if isinstance(value, torch.Tensor) and value.shape == param.shape}


def row_bytes(params: Sequence[torch.Tensor], optimizer=None) -> int:
    """Bytes of one slot row of ``params`` together with its shaped optimizer state."""
    total = 0
    for p in params:
        per_row = p[0].numel() * p.element_size()
        total += per_row * (1 + len(shaped_state(optimizer, p)))
    return total


@dataclass
class _LayerTransfer:
    """The staging of one layer: the posted works and where their rows go."""

    works: list
    staged: list          # [(destination tensor, local rows [n] int64, staged rows [n, ...])]
    started_step: int
    bytes_sent: int
    # CUDA: recorded on the side stream after the staging; the commit's stream waits for it.
    ready: torch.cuda.Event | None = None
    send_bufs: list = ()  # the send buffers (CUDA: handed to the current stream once sent)


class Migrator:
    """Moves slot rows between the ranks of a group with point-to-point ops.

    Args:
        group: the expert-parallel process group (rank r serves device r); None: the default
            group, or a single process when torch.distributed is not initialised.
        timeout_s: how long a commit waits for a layer's transfers before the migration fails.
        max_bytes_in_flight: bytes (sent by this rank, over all layers) one boundary may start;
            at least one layer starts each time. None: every layer at once.

    Rows go by ``torch.distributed`` isend/irecv on the rows' device: async gloo ops on CPUs; on
    GPUs the send buffers are packed and the ops issued on a side stream, so the default stream
    only waits for them at the layer's commit.
    """

    def __init__(self, group=None, *, timeout_s: float = 60.0,
                 max_bytes_in_flight: int | None = None) -> None:
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) \
                or not timeout_s > 0:
            raise ValueError(f"timeout_s must be a number of seconds > 0, got {timeout_s!r}")
        if max_bytes_in_flight is not None and (
                isinstance(max_bytes_in_flight, bool)
                or not isinstance(max_bytes_in_flight, (int, np.integer))
                or max_bytes_in_flight < 1):
            raise ValueError("max_bytes_in_flight must be an int >= 1 or None, got "
                             f"{max_bytes_in_flight!r}")
        self.group = group
        self.timeout_s = float(timeout_s)
        self.max_bytes_in_flight = None if max_bytes_in_flight is None else int(max_bytes_in_flight)
        if dist.is_available() and dist.is_initialized():
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
        else:
            self.rank, self.world_size = 0, 1
        self._count = 0

    def transfer_group(self):
        """The connections the rows travel on: the ranks of ``group``, connected afresh.

        A gloo transfer that times out closes the connection it used, and a collective on that
        group would then fail. On gloo the rows therefore travel in a process group of their own
        (a ``ProcessGroupGloo`` under a store prefix unique to its generation), so training and
        the agreement keep ``group``; after a failure every rank drops it and the next migration
        connects anew. Other backends (NCCL) move the rows in ``group`` itself.
        """
        if not only_gloo(self.group):
            return self.group
        key = group_key(self.group)
        pg = _TRANSFER_GROUPS.get(key)
        if pg is None:
            generation = _GENERATION[key] = _GENERATION.get(key, 0) + 1
            store = dist.PrefixStore(f"moebalance-transfer/{'-'.join(map(str, key))}/{generation}",
                                     dist.distributed_c10d._get_default_store())
            pg = dist.ProcessGroupGloo(store, self.rank, self.world_size,
                                       timedelta(seconds=max(self.timeout_s, 1.0)))
            _TRANSFER_GROUPS[key] = pg
        return pg

    def forget_transfer_group(self) -> None:
        """Drop the transfer connections after a failure (kept referenced: a broken group is
        never torn down while an abandoned receive may still point into it)."""
        pg = _TRANSFER_GROUPS.pop(group_key(self.group), None)
        if pg is not None:
            _BROKEN_GROUPS.append(pg)

    def start(self, plan: MigrationPlan, slot_params: Mapping[int, Sequence[torch.Tensor]],
              optimizer=None) -> "Migration":
        """Begin moving ``plan``'s rows; call at a step boundary (after ``optimizer.step()``).

        Args:
            plan: from :func:`plan_migration`, identical on every rank.
            slot_params: for each layer of the plan, this rank's slot tensors of that layer
                (``[Ls, ...]`` each, the same list structure on every rank), e.g.
                ``[gate_up, down]``.
            optimizer: the ``torch.optim.Optimizer`` that updates them (its shaped state moves with
                the rows), or None to move weights only.

        Returns:
            :class:`Migration`. Collective: every rank of the group calls it with the same plan.
        """
        if not isinstance(plan, MigrationPlan):
            raise TypeError("plan must be a MigrationPlan from plan_migration(), got "
                            f"{type(plan).__name__}")
        if plan.old.num_devices != self.world_size:
            raise ValueError(f"plan spans {plan.old.num_devices} devices but the group has "
                             f"{self.world_size} ranks; plan for one device per rank")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError("optimizer must be a torch.optim.Optimizer or None, got "
                            f"{type(optimizer).__name__}")
        missing = [layer for layer in plan.changed_layers if layer not in slot_params]
        if missing:
            raise ValueError(f"slot_params has no slot tensors for layers {missing} that the plan "
                             f"changes; pass every layer's [gate_up, down] (or equivalent)")
        self._check_agreement(plan, slot_params, optimizer)
        if plan.num_moves and self.world_size > 1:
            self.transfer_group()   # every rank connects now, also one that sends nothing yet
        self._count += 1
        return Migration(self, plan,
                         {layer: list(slot_params[layer]) for layer in plan.changed_layers},
                         optimizer, self._count)

    def _check_agreement(self, plan, slot_params, optimizer) -> None:
        """Every rank must move rows of the same shapes, dtypes and optimizer state (collective)."""
        mine = []
        for layer in plan.changed_layers:
            for p in slot_params[layer]:
                if not isinstance(p, torch.Tensor) or p.dim() < 1:
                    raise TypeError(f"slot_params[{layer}] must hold tensors with a leading "
                                    "slot dim")
                mine.append((layer, tuple(p.shape[1:]), str(p.dtype),
                             tuple((n, str(t.dtype))
                                   for n, t in shaped_state(optimizer, p).items())))
        if self.world_size == 1 or same_everywhere(repr(mine), self.group):
            return
        everyone = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self.group)
        for rank, theirs in enumerate(everyone):
            if theirs != mine:
                raise ValueError(
                    f"rank {rank} holds slot tensors or optimizer state {theirs} where rank "
                    f"{self.rank} holds {mine}; every rank must pass the same layers, parameter "
                    "shapes/dtypes and optimizer (state created on every rank, e.g. after "
                    "one step)")


class Migration:
    """A migration under way: staged rows per layer, committed before each layer's next forward.

    Use:
        ``commit(layer)`` before the layer's forward (the layer's module does it); ``wait()`` to
        finish everything now (e.g. before a checkpoint); ``done``, ``error``, ``report()``.
        The optimizer's step post-hook resends stale staging and starts the next layers.

    Callbacks: ``on_commit(layer, fn)`` registers ``fn(layer)``, called on every rank right after
    the layer's rows are in place (swap placement, routing and gradient-sync tables there).
    """

    def __init__(self, migrator: Migrator, plan: MigrationPlan, slot_params: dict, optimizer,
                 number: int) -> None:
        self.migrator = migrator
        self.plan = plan
        self.optimizer = optimizer
        self.error: MigrationError | None = None
        # None, or a callable saying whether the layers may commit now (the Rebalancer's: not
        # between the micro-batches of gradient accumulation); rows held back go stale at the
        # optimizer's step and are sent again.
        self.commit_gate: Callable[[], bool] | None = None
        self._slot_params = slot_params
        self._number = number
        self._callbacks: dict[int, list[Callable[[int], None]]] = {}
        self._queue = list(plan.changed_layers)             # not started, in layer order
        self._transfers: dict[int, _LayerTransfer] = {}     # started, not committed
        self.committed: list[int] = []
        self.bytes_sent = 0
        self.resends = 0
        self._optimizer_steps = 0
        self.started_at = time.perf_counter()
        self.finished_at: float | None = None
        self._hooks = []
        self._gloo = migrator.world_size == 1 or only_gloo(migrator.group)
        if optimizer is not None:
            self._hooks = [optimizer.register_step_post_hook(self._after_optimizer_step)]
        self._start_next()

    # -- state -------------------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        """True once every layer committed or the migration failed."""
        return self.error is not None or (not self._queue and not self._transfers)

    def pending(self, layer: int) -> bool:
        """Whether ``layer`` still has rows to commit (started or queued)."""
        return self.error is None and (layer in self._transfers or layer in self._queue)

    def on_commit(self, layer: int, fn: Callable[[int], None]) -> None:
        self._callbacks.setdefault(int(layer), []).append(fn)

    def report(self) -> dict:
        """Figures of this migration (this rank's bytes; the plan's totals)."""
        seconds = (self.finished_at or time.perf_counter()) - self.started_at
        return {"moves": self.plan.num_moves, "layers": len(self.plan.changed_layers),
                "committed_layers": len(self.committed), "bytes_sent": self.bytes_sent,
                "bytes_total": self.plan.total_bytes, "seconds": seconds,
                "optimizer_steps": self._optimizer_steps, "resends": self.resends,
                "done": self.done, "error": None if self.error is None else str(self.error)}

    # -- starting --------------------------------------------------------------------------------

    def _start_next(self) -> None:
        """Start queued layers up to the bound on bytes in flight (at least one)."""
        budget = self.migrator.max_bytes_in_flight
        started_bytes = 0   # per sender, bounded like the bytes any one rank has in flight
        while self._queue and self.error is None:
            layer = self._queue[0]
            cost = self._layer_send_bytes(layer)
            if budget is not None and started_bytes and started_bytes + cost > budget:
                break
            self._queue.pop(0)
            try:
                self._transfers[layer] = self._post(layer)
            except Exception as exc:  # noqa: BLE001 - reported to every rank at the commit
                self._transfers[layer] = _LayerTransfer([_Failed(exc)], [],
                                                        self._optimizer_steps, 0)
            started_bytes += cost

    def _layer_send_bytes(self, layer: int) -> int:
        """The most bytes any rank sends for ``layer`` (from the plan: the same on every rank, so
        every rank starts the same layers)."""
        plan = self.plan
        rows = plan.rows_of_layer(layer)
        remote = plan.src_rank_M[rows] != plan.dst_rank_M[rows]
        per_rank = np.bincount(plan.src_rank_M[rows][remote], minlength=plan.old.num_devices)
        return int(per_rank.max(initial=0)) * row_bytes(self._slot_params[layer], self.optimizer)

    def _kinds(self, layer: int) -> list[torch.Tensor]:
        """The tensors whose rows move for ``layer``: each slot tensor, then its shaped state."""
        kinds = []
        for p in self._slot_params[layer]:
            kinds.append(p)
            kinds.extend(shaped_state(self.optimizer, p).values())
        return kinds

    def _post(self, layer: int) -> _LayerTransfer:
        """Pack this rank's outgoing rows of ``layer``, post the sends and receives."""
        plan, mig = self.plan, self.migrator
        rank = mig.rank
        rows = plan.rows_of_layer(layer)
        src, dst = plan.src_rank_M[rows], plan.dst_rank_M[rows]
        kinds = self._kinds(layer)
        if len(kinds) > MIGRATION_TAG_KINDS:
            raise ValueError(f"layer {layer} moves {len(kinds)} tensors per row; at most "
                             f"{MIGRATION_TAG_KINDS}")
        device = kinds[0].device
        ops: list[tuple] = []     # (is_send, peer, tensor, tag)
        staged, send_bufs = [], []
        sent = 0
        tag0 = (MIGRATION_TAG_BASE
                + (self._number % MIGRATION_NUMBERS) * MIGRATION_TAG_LAYERS * MIGRATION_TAG_KINDS
                + (layer % MIGRATION_TAG_LAYERS) * MIGRATION_TAG_KINDS)
        # Every index this rank uses for the layer, in one host array and one copy: per peer the
        # slots it sends from, the slots it stages into, and (a copy inside this rank) its sources.
        moves = []                # (peer, rows out, rows in, spans of their indices in `host`)
        pieces, offset = [], 0
        for peer in range(mig.world_size):
            out = rows[(src == rank) & (dst == peer)] if peer != rank else rows[:0]
            inc = rows[(dst == rank) & (src == peer)]
            spans = []
            for part in (plan.src_slot_M[out], plan.dst_slot_M[inc],
                         plan.src_slot_M[inc] if peer == rank else plan.src_slot_M[:0]):
                pieces.append(part)
                spans.append((offset, offset + part.size))
                offset += part.size
            moves.append((peer, out.size, inc.size, spans))
        host = torch.from_numpy(np.concatenate(pieces).astype(np.int64, copy=False))
        side = torch.cuda.Stream(device) if device.type == "cuda" else None
        ready = None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(device))
        with torch.no_grad(), (torch.cuda.stream(side) if side is not None else nullcontext()):
            # Pinned and non-blocking: the host never waits for the compute stream here.
            index = to_device_async(host, device)
            for k, tensor in enumerate(kinds):
                for peer, num_out, num_inc, spans in moves:
                    (o0, o1), (l0, l1), (c0, c1) = spans
                    if num_out:
                        buf = tensor.index_select(0, index[o0:o1])
                        ops.append((True, peer, buf, tag0 + k))
                        send_bufs.append(buf)
                        sent += buf.numel() * buf.element_size()
                    if num_inc:
                        local = index[l0:l1]
                        if peer == rank:   # a copy inside this rank: staged now, no message
                            rows_in = tensor.index_select(0, index[c0:c1])
                        else:
                            rows_in = tensor.new_empty((num_inc, *tensor.shape[1:]))
                            ops.append((False, peer, rows_in, tag0 + k))
                        staged.append((tensor, local, rows_in))
            works = self._issue(ops)
            if side is not None:
                ready = torch.cuda.Event()
                ready.record(side)
        self.bytes_sent += sent
        return _LayerTransfer(works, staged, self._optimizer_steps, sent, ready, send_bufs)

    def _issue(self, ops: list[tuple]) -> list:
        """Post ``ops`` ((is_send, peer, tensor, tag)) and return their works (the fault seam)."""
        if not ops:
            return []
        group = self.migrator.transfer_group()
        if isinstance(group, dist.ProcessGroupGloo):
            return [group.send([tensor], peer, tag) if is_send else group.recv([tensor], peer, tag)
                    for is_send, peer, tensor, tag in ops]
        # One batch (NCCL: one group call): a lone NCCL send may wait for its receive to be
        # posted, so two ranks swapping rows with separate sends would wait on each other.
        return dist.batch_isend_irecv([
            dist.P2POp(dist.isend if is_send else dist.irecv, tensor, group=group,
                       group_peer=peer, tag=tag) for is_send, peer, tensor, tag in ops])

    # -- committing --------------------------------------------------------------------------------

    def commit(self, layer: int) -> bool:
        """Put ``layer``'s staged rows in place if every rank's transfers landed. Collective.

        Returns True when the layer now holds its new contents, False when it has nothing started
        (queued, already committed, or the migration failed: then ``error`` says why, the same
        text on every rank, and no row of the layer was written).
        """
        layer = int(layer)
        transfer = self._transfers.get(layer)
        if transfer is None or self.error is not None:
            return False
        # A rank that could not even post its transfers says so first: the others then fail
        # at once instead of waiting timeout_s for rows that will never come (one more
        # all-reduce of one int per committed layer, at placement changes only).
        unposted = next((work.exc for work in transfer.works if isinstance(work, _Failed)), None)
        failures = self._agree(unposted is None, "" if unposted is None else
                               f"{type(unposted).__name__}: {unposted}".strip())
        if not failures:
            ok, message = self._wait(transfer)
            failures = self._agree(ok, message)
        del self._transfers[layer]
        if failures:
            self._fail(layer, failures)
            return False
        with torch.no_grad():
            if transfer.ready is not None and transfer.staged:
                # The staged rows and their index were made on the side stream: order the writes
                # after it on the stream that commits (also when every move stays on this rank
                # and no transfer work orders it), and keep their memory alive for that stream.
                stream = torch.cuda.current_stream(transfer.staged[0][0].device)
                stream.wait_event(transfer.ready)
            for tensor, local, rows_in in transfer.staged:
                if local.is_cuda:
                    local.record_stream(torch.cuda.current_stream(local.device))
                tensor.index_copy_(0, local, rows_in)
                # A slot that changes expert starts without the old expert's gradient.
                if getattr(tensor, "grad", None) is not None:
                    tensor.grad.index_fill_(0, local, 0)
        self.committed.append(layer)
        for fn in self._callbacks.get(layer, []):
            fn(layer)
        if self.done:
            self._finish()
        return True

    def _wait(self, transfer: _LayerTransfer) -> tuple[bool, str]:
        timeout = timedelta(seconds=self.migrator.timeout_s)
        deadline = time.monotonic() + self.migrator.timeout_s
        try:
            for work in transfer.works:
                if isinstance(work, _Failed):
                    raise work.exc
                if self._gloo:
                    left = max(deadline - time.monotonic(), 0.001)
                    work.wait(timedelta(seconds=min(left, timeout.total_seconds())))
                else:
                    # NCCL: wait() orders the current stream after the transfer, the host runs
                    # on; the group's own timeout (its watchdog) bounds a transfer that hangs.
                    work.wait()
            for tensor, local, rows_in in transfer.staged:
                _check_staged(tensor, local, rows_in)
                if rows_in.is_cuda:   # staged on the side stream, read on the current one
                    rows_in.record_stream(torch.cuda.current_stream(rows_in.device))
            for buf in transfer.send_bufs:
                if buf.is_cuda:       # made on the side stream, read by NCCL until the
                    # current stream's wait above: not to be reused before that point
                    buf.record_stream(torch.cuda.current_stream(buf.device))
        except Exception as exc:  # noqa: BLE001 - every failure becomes the same error on all ranks
            return False, f"{type(exc).__name__}: {exc}".strip()
        return True, ""

    def _agree(self, ok: bool, message: str) -> list[tuple[int, str]]:
        """[(rank, message)] of the ranks whose transfers failed (the same list on every rank)."""
        mig = self.migrator
        if mig.world_size == 1:
            return [] if ok else [(0, message)]
        failed = torch.tensor([0 if ok else 1], dtype=torch.int64, device=flag_device(mig.group))
        dist.all_reduce(failed, group=mig.group)
        if int(failed) == 0:
            return []                        # the usual case: one small all-reduce, no pickling
        everyone = [None] * mig.world_size
        dist.all_gather_object(everyone, (bool(ok), message[:500]), group=mig.group)
        return [(rank, msg) for rank, (fine, msg) in enumerate(everyone) if not fine]

    def _fail(self, layer: int, failures: list[tuple[int, str]]) -> None:
        detail = "; ".join(f"rank {rank}: {msg}" for rank, msg in failures)
        self.error = MigrationError(
            f"migration of layer {layer} failed ({detail}); every rank keeps the placement its "
            f"layers hold now (the {len(self.committed)} layer(s) committed before hold the new "
            f"one, the others the old one) and no staged row was written; re-plan to retry",
            f"migration of layer {layer}", failures)
        self._drain_all()
        self._queue.clear()
        self.migrator.forget_transfer_group()
        self._finish()
        log.error("%s", self.error)

    def _drain_all(self) -> None:
        """Abandon staged layers: their buffers are dropped once their works settle."""
        for transfer in self._transfers.values():
            for work in transfer.works:
                if not isinstance(work, _Failed) and work.is_completed():
                    try:
                        work.wait()
                    except Exception:  # noqa: BLE001 - already abandoned
                        pass
        self._transfers.clear()

    def _finish(self) -> None:
        if self.finished_at is None:
            self.finished_at = time.perf_counter()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def wait(self) -> None:
        """Start and commit every remaining layer now (at a step boundary). Collective.

        Raises:
            MigrationError: on every rank, if any rank's transfer failed (see the class).
        """
        while not self.done:
            if not self._transfers:
                self._start_next()
            for layer in sorted(self._transfers):
                self.commit(layer)
        if self.error is not None:
            raise self.error

    def result(self) -> None:
        """Raise the migration's :class:`MigrationError`, if it failed."""
        if self.error is not None:
            raise self.error

    # -- optimizer step hooks --------------------------------------------------------------------

    def _after_optimizer_step(self, optimizer, args, kwargs) -> None:
        # Rows staged before this update and not committed by now (the layer ran no forward in
        # this step) no longer equal their expert: send them again, now. A commit inside the
        # step's closure (Lightning runs forward and backward inside optimizer.step) came before
        # the update, so it is exact and the layer is no longer here.
        self._optimizer_steps += 1
        stale = sorted(self._transfers)
        for layer in stale:
            transfer = self._transfers.pop(layer)
            self.bytes_sent -= transfer.bytes_sent
            for work in transfer.works:
                if not isinstance(work, _Failed):
                    try:
                        work.wait(timedelta(seconds=self.migrator.timeout_s))
                    except Exception:  # noqa: BLE001 - the resend reports a real failure
                        pass
        if stale:
            self._queue = stale + self._queue
            self.resends += len(stale)
        if not self.done:
            self._start_next()


def _check_staged(tensor: torch.Tensor, local: torch.Tensor, rows_in: torch.Tensor) -> None:
    """Raise ValueError unless ``rows_in`` [n, ...] can be copied into rows ``local`` [n] of
    ``tensor`` [Ls, ...]: checked before the ranks agree, so the copy itself cannot fail on one
    rank alone."""
    if (rows_in.shape[1:] != tensor.shape[1:] or rows_in.shape[0] != local.shape[0]
            or rows_in.dtype != tensor.dtype or rows_in.device != tensor.device
            or local.device != tensor.device):
        raise ValueError(f"staged rows {rows_in.dtype} {tuple(rows_in.shape)} on {rows_in.device} "
                         f"do not fit {local.shape[0]} rows of a slot tensor {tensor.dtype} "
                         f"{tuple(tensor.shape)} on {tensor.device}")
    # The slot indices come from the plan (host ints): their range is read without a device sync
    # only on the CPU, where they live for gloo.
    if local.numel() and local.device.type == "cpu" and not (
            0 <= int(local.min()) and int(local.max()) < tensor.shape[0]):
        raise ValueError(f"staged rows go to slots {local.tolist()}, outside "
                         f"[0, {tensor.shape[0]})")


class _Failed:
    """A work that could not be posted: its exception is reported at the commit."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc
