"""One rank's error is every rank's error: local blocks whose failure the group agrees on.

Code that runs on every rank of a group between collectives can fail on one rank alone (a router
given rows of another dtype, a malformed expert output, a gradient of the wrong shape, a staged
row that does not fit). If that rank raised at once, the others would wait for it in the next
collective until the process group's timeout (gloo's default is 30 minutes). Instead:

1. the local block runs inside :meth:`Attempt.run`, which records its exception instead of
   raising it (the rank goes on with harmless stand-in values of the right shapes, so that it
   posts exactly the collectives the others post);
2. the collective that follows anyway carries :attr:`Attempt.flag` (the dispatcher's count
   exchange has a column for it); where no collective follows, :func:`agree` is one all-reduce
   of a single int64;
3. once every rank knows some rank failed, :func:`raise_failures` gathers every rank's message
   (one ``all_gather_object``, on the error path only) and every rank raises the same
   :class:`GroupError`, naming the failing ranks and their original messages. The failing rank
   raises it ``from`` its original exception.

Every rank has then posted the same collectives, so the next good step works. In a single
process there is nothing to agree on: the original exception is raised as it is.

Inside the autograd engine (gradient-sync hooks, the dispatch's backward) the failure is
recorded per group (:func:`backward_attempt`), the rank goes on with zeros, and one callback at
the end of the backward agrees on it (:func:`close_backward`). An exception raised by code
outside the library in the middle of a backward (a user's tensor hook) stops that rank's
autograd engine before any library code runs again, and cannot be carried this way.

The same agreement at the end of a backward also carries whether this rank's expert gradients
hold a non-finite value (:func:`note_gradients`): when any rank's do, every rank's do
(:func:`mark_non_finite`), as a data-parallel all-reduce would make them, so a
``torch.amp.GradScaler`` skips the step on every rank alike.

Flags travel on the CPU where the group's backend takes CPU tensors (gloo), so agreeing costs no
device synchronisation (but for the non-finite flag of gradients held on a GPU); on an NCCL-only
group they travel on the current GPU and reading them is a host sync.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

__all__ = ["GroupError", "GroupValueError", "GroupTypeError", "Attempt", "agree",
           "raise_failures", "backends", "only_gloo", "flag_device", "collective_device",
           "describe", "backward_attempt",
           "take_backward_failure", "close_backward", "note_gradients", "non_finite",
           "agree_spreading_non_finite", "mark_non_finite"]

# Longest original message carried per rank (the text travels pickled, on the error path only).
_MESSAGE_CHARS = 2000


class GroupError(RuntimeError):
    """An exception on one or more ranks of a process group, raised on every rank of the group
    with the same text.

    Attributes:
        where: what the group was doing (e.g. "ExpertParallelMoE.forward of layer 0").
        failures: [(rank, "ExceptionType: message")] of every rank that failed, in rank order.
    """

    def __init__(self, message: str, where: str = "", failures=()) -> None:
        super().__init__(message)
        self.where = where
        self.failures = list(failures)

    @property
    def ranks(self) -> list[int]:
        """The ranks that failed."""
        return [rank for rank, _ in self.failures]


class GroupValueError(GroupError, ValueError):
    """A :class:`GroupError` whose first failing rank raised a ValueError (bad input)."""


class GroupTypeError(GroupError, TypeError):
    """A :class:`GroupError` whose first failing rank raised a TypeError (an argument's type)."""


def describe(exc: BaseException) -> str:
    """``"ExceptionType: message"`` of ``exc`` (a GroupError's own text as it is)."""
    if isinstance(exc, GroupError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}".strip()


class Attempt:
    """Local blocks of one rank whose failure is agreed on by the group.

    ``with attempt.run(): ...`` records the first exception raised inside (later blocks still
    run and may record nothing more); :attr:`flag` is 1 once a block failed. The collective that
    follows carries the flag, then :func:`raise_failures` (or :func:`agree`, which does both)
    raises on every rank.

    Args:
        where: what the blocks are part of, for the message every rank raises.
    """

    def __init__(self, where: str) -> None:
        self.where = where
        self.error: BaseException | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None

    @property
    def flag(self) -> int:
        return int(self.error is not None)

    def fail(self, error: BaseException) -> None:
        """Record ``error`` (if no earlier block failed)."""
        if self.error is None:
            self.error = error

    @contextmanager
    def run(self):
        """Run a local block; an Exception inside is recorded, not raised (KeyboardInterrupt and
        other BaseExceptions still propagate: the process is going down anyway)."""
        try:
            yield self
        except Exception as exc:  # noqa: BLE001 - raised on every rank by raise_failures
            self.fail(exc)


def backends(group) -> dict[str, str]:
    """``{device type: backend}`` of ``group``, e.g. ``{"cpu": "gloo", "cuda": "nccl"}``.

    Read from the group's configuration, not from ``get_backend``: a group made by
    ``init_process_group()`` with no backend name (torchrun scripts often do) is "undefined"
    there, and holds one backend for the machine's accelerator (NCCL on a GPU machine, CPU
    tensors refused) or for the CPU (gloo).
    """
    config = dist.get_backend_config(group)
    return {device.strip(): name.strip() for device, _, name in
            (part.partition(":") for part in str(config).lower().split(",")) if name}


def only_gloo(group) -> bool:
    """Whether every tensor ``group`` carries travels on gloo."""
    return set(backends(group).values()) == {"gloo"}


def flag_device(group) -> torch.device:
    """Where a flag can travel in ``group``: the CPU if a backend of it takes CPU tensors (gloo),
    else the current CUDA device."""
    if "cpu" in backends(group):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def collective_device(group) -> torch.device:
    """Where a rank with no tensor of its own (nothing recorded, no gradient) puts the one it
    reduces with its peers' in ``group``: the current CUDA device where a backend other than
    gloo serves CUDA tensors (the peers' tensors are on their GPUs, and a CPU tensor would go to
    another backend or be refused), else the CPU."""
    if backends(group).get("cuda", "gloo") != "gloo" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _world(group) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def raise_failures(attempt: Attempt, group) -> None:
    """Raise the same :class:`GroupError` on every rank of ``group``. Collective: call it on every
    rank once the group knows that some rank's attempt failed.

    One ``all_gather_object`` of each rank's message. The class follows the lowest failing
    rank's exception (:class:`GroupValueError` for a ValueError, :class:`GroupTypeError` for a
    TypeError, else :class:`GroupError`); in a single process the original exception is raised.
    """
    if _world(group) == 1:
        if attempt.error is not None:
            raise attempt.error
        raise GroupError(f"{attempt.where} failed", attempt.where)
    mine = None
    if attempt.error is not None:
        kind = ("value" if isinstance(attempt.error, ValueError) else
                "type" if isinstance(attempt.error, TypeError) else "other")
        mine = (kind, describe(attempt.error)[:_MESSAGE_CHARS])
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    failures = [(rank, theirs[1]) for rank, theirs in enumerate(everyone) if theirs is not None]
    kinds = [theirs[0] for theirs in everyone if theirs is not None]
    cls = {"value": GroupValueError, "type": GroupTypeError}.get(kinds[0] if kinds else "",
                                                                 GroupError)
    ranks = [rank for rank, _ in failures]
    detail = "; ".join(f"rank {rank}: {message}" for rank, message in failures)
    error = cls(f"{attempt.where} failed on rank(s) {ranks} ({detail}); every rank of the group "
                f"raises this error and no collective is left half-posted", attempt.where,
                failures)
    raise error from attempt.error


def agree(attempt: Attempt, group, same: dict | None = None,
          also: torch.Tensor | None = None) -> bool:
    """Raise the same :class:`GroupError` on every rank of ``group`` if any rank's ``attempt``
    failed (or the ranks' ``same`` values differ), else return whether any rank's ``also`` is
    set.

    Collective: one all-reduce (MAX) of ``1 + 2 * len(same)`` int64 (one more with ``also``) on
    :func:`flag_device`, plus :func:`raise_failures` on the error path. Use it only where no
    collective follows the local block anyway (one that does should carry ``attempt.flag``).

    Args:
        same: name -> int that every rank must hold alike (e.g. the width of the rows about to
            travel); a rank that holds another value than the group's largest is reported.
        also: a one-element bool or int tensor of this rank's (on any device; read only after
            the all-reduce), e.g. "my gradients hold a non-finite value".
    """
    if _world(group) == 1:
        if attempt.error is not None:
            raise attempt.error
        return False
    values = list((same or {}).values())
    row = [attempt.flag] + values + [-v for v in values]
    flags = torch.tensor(row, dtype=torch.int64, device=flag_device(group))
    if also is not None:
        flags = torch.cat([flags, also.reshape(1).to(device=flags.device, dtype=torch.int64)])
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    flags = flags.tolist()
    somewhere = bool(flags.pop()) if also is not None else False
    n = len(values)
    highest, lowest = flags[1:1 + n], [-v for v in flags[1 + n:]]
    if highest != lowest:
        # Error path only: every rank's values, so that the odd ones out are named.
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, values, group=group)
        for i, name in enumerate(same):
            column = [theirs[i] for theirs in everyone]
            common = max(set(column), key=lambda v: (column.count(v), -v))
            if column != [common] * len(column) and values[i] != common:
                attempt.fail(ValueError(f"{name} is {values[i]} here but {common} on most ranks "
                                        f"(rank by rank: {column}); every rank must hold the "
                                        f"same {name}"))
    if flags[0] or highest != lowest:
        raise_failures(attempt, group)
    return somewhere


# -- backward ---------------------------------------------------------------------------------
# Library code inside the autograd engine (gradient-sync hooks, the dispatch's backward) cannot
# raise on one rank alone: the others would wait in the next exchange of the backward. It records
# its failure here, goes on with zeros of the right shapes (so every rank posts the same
# messages), and one callback at the end of the backward agrees on the group's failures.
_BACKWARD: dict = {}    # group -> Attempt of this rank's library backward code
_CLOSING: dict = {}     # group -> id of the backward whose closing callback is queued
_GRADIENTS: dict = {}   # group -> [(non-finite flag, parameter)] noted during this backward

BACKWARD_WHERE = "backward of the expert-parallel layers"


def backward_attempt(group) -> Attempt:
    """The :class:`Attempt` that collects this rank's failures in library backward code of
    ``group`` until they are agreed on (:func:`close_backward`)."""
    attempt = _BACKWARD.get(group)
    if attempt is None:
        attempt = _BACKWARD[group] = Attempt(BACKWARD_WHERE)
    return attempt


def take_backward_failure(group) -> BaseException | None:
    """This rank's failure in library backward code of ``group`` not yet agreed on (and forget
    it): the next collective that carries flags reports it."""
    attempt = _BACKWARD.pop(group, None)
    return None if attempt is None else attempt.error


def close_backward(group) -> None:
    """Queue, once per backward, the agreement on the failures recorded for ``group`` during it:
    one all-reduce of one int (:func:`agree`) after every engine callback queued so far. Call
    it from an autograd engine callback, on every rank alike (the gradient sync does)."""
    task = torch._C._current_graph_task_id()
    if _CLOSING.get(group) == task:
        return
    _CLOSING[group] = task

    def agree_on_backward():
        _CLOSING.pop(group, None)
        attempt = _BACKWARD.pop(group, None) or Attempt(BACKWARD_WHERE)
        noted = _GRADIENTS.pop(group, [])
        here = torch.stack([bad for bad, _ in noted]).any() if noted else torch.tensor(False)
        agree_spreading_non_finite(attempt, group, here, noted[0][1] if noted else None)

    torch.autograd.Variable._execution_engine.queue_callback(agree_on_backward)


def note_gradients(group, params) -> None:
    """Note, for the agreement that ends this backward (:func:`close_backward`), whether a
    gradient of ``params`` (this rank's own: expert slots, which no data-parallel all-reduce
    touches) holds a non-finite value (:func:`non_finite`); when some rank's does, the others
    :func:`mark_non_finite` the first of theirs."""
    params = [p for p in params if p is not None]
    if params and _world(group) > 1:
        _GRADIENTS.setdefault(group, []).append((non_finite(params), params[0]))


def non_finite(params) -> torch.Tensor:
    """Whether a gradient of ``params`` holds a non-finite value: a bool tensor from one
    reduction on the device, no host sync."""
    grads = [p.grad for p in params if p.grad is not None and p.grad.numel()]
    if not grads:   # on the parameters' device: the flags of a backward's layers are stacked
        return torch.zeros((), dtype=torch.bool, device=params[0].device if params else "cpu")
    if grads[0].device.type == "cpu":
        # The inf-norm has no vectorised CPU kernel: 3 ms for a layer's 1.2M fp32 gradients,
        # against 0.15 ms for their extremes (which NaN and +-inf reach alike).
        extremes = torch.stack([v for g in grads for v in torch.aminmax(g)])
        return extremes.isfinite().all().logical_not()
    return torch.stack(torch._foreach_norm(grads, float("inf"))).isfinite().all().logical_not()


def agree_spreading_non_finite(attempt: Attempt, group, here: torch.Tensor, param) -> None:
    """:func:`agree` carrying ``here`` (this rank's :func:`non_finite`); when another rank's is
    set and this rank's is not, :func:`mark_non_finite` ``param`` (None: nothing to mark)."""
    if agree(attempt, group, also=here) and param is not None and not bool(here):
        mark_non_finite(param)


def mark_non_finite(param: torch.Tensor) -> None:
    """Write ``inf`` into one element of ``param``'s gradient, because another rank's expert
    gradients hold a non-finite value. Under data parallelism a non-finite gradient on one rank
    is one on every rank (the all-reduce spreads it); expert slots are not all-reduced, so this
    keeps that rule: ``torch.amp.GradScaler`` then skips the step and lowers its scale on every
    rank alike, instead of on the overflowing rank alone (which would leave the ranks' weights
    and scales apart)."""
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    with torch.no_grad():
        param.grad[(0,) * param.grad.dim()] = float("inf")     # any strides
