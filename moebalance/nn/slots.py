"""ExpertSlots: what every expert-parallel layer shares, whatever its experts compute.

A layer of this kind holds the expert slots of *this* rank as parameters whose leading dim is
the slot (``[Ls, ...]`` each), a :class:`~moebalance.dispatch.Dispatcher` over its process
group and a placement row. This module keeps, for all such layers (moebalance's own
:class:`~moebalance.nn.moe.ExpertParallelMoE`, the layers :func:`moebalance.wrap` puts into
transformers models):

* the placement state, read-only; :func:`apply_placement` is the one way to change it, moving
  slot rows and their optimizer state (:mod:`moebalance.migrate.transfer`) and committing each layer
  right before its next forward;
* gradient sync: replicas of an expert reduced among their holders during backward
  (:mod:`moebalance.nn.grad_sync`), or on request (:func:`reduce_replica_gradients`);
* global-norm clipping (:func:`clip_grad_norm_`), each logical expert counted once;
* checkpoints: the placement row as extra state in ``state_dict()``.

Legend: L layers of the placement, S global slots, Ls slots on this rank, E logical experts.
"""

from __future__ import annotations

import copy
import warnings
import weakref
from abc import abstractmethod

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..collective_errors import (
    Attempt,
    agree,
    agree_spreading_non_finite,
    non_finite,
    take_backward_failure,
)
from ..device_index import DeviceIndex
from ..frameworks import CLIPPED_MARK, exclude_experts_from_ddp, mark_slot_parameters
from ..migrate.plan import plan_migration
from ..migrate.transfer import Migrator, row_bytes
from ..placement import Placement
from .grad_sync import GradientSync, HolderExchange

__all__ = ["ExpertSlots", "GRAD_SYNC", "moe_layers", "current_placement", "apply_placement",
           "reduce_replica_gradients", "clip_grad_norm_", "set_device_speeds"]

GRAD_SYNC = ("backward", "manual")

# Deep copies of each layer, in the order they were made (the same on every rank): an EMA's
# ``torch.optim.swa_utils.AveragedModel``, a frozen reference model. A copy holds the rows of the
# placement it was copied under; averaging it with the layer pairs slot rows, not experts, so a
# copy follows the layer's migrations (its weights only: :meth:`ExpertSlots._follow_copies`).
_COPIES: "weakref.WeakKeyDictionary[ExpertSlots, list]" = weakref.WeakKeyDictionary()


def _read_only(name: str) -> property:
    def get(self):
        return self.__dict__["_" + name]

    def refuse(self, value):
        raise AttributeError(
            f"{type(self).__name__}.{name} is read-only: the slot rows, routing tables and "
            f"gradient sync follow the placement together; change it with "
            "layer.apply_placement(new_placement, optimizer) (or "
            "moebalance.apply_placement(model, new_placement, optimizer) for every layer of "
            "a model)")

    return property(get, refuse, doc=f"The layer's current {name} (read-only).")


_warned_subgroup = False


def _warn_if_subgroup(group_size: int) -> None:
    """Warn once per process when expert-parallel layers span fewer ranks than the job: the
    layout of expert-parallel groups with data parallelism across them, whose groups' experts
    moebalance would not keep equal (a DDP over the whole job is refused at its first forward)."""
    global _warned_subgroup
    if _warned_subgroup or not (dist.is_available() and dist.is_initialized()):
        return
    world = dist.get_world_size()
    if group_size < world:
        _warned_subgroup = True
        warnings.warn(
            f"moebalance: these expert-parallel layers span {group_size} of the job's {world} "
            "ranks. Their experts are kept equal within that group only: ranks outside it that "
            "train the same model (expert-parallel groups with data parallelism across them) "
            "would train their experts apart. Build the layers over every rank of the job (one "
            "device per rank), unless the other ranks stay out of training", stacklevel=3)


class ExpertSlots(nn.Module):
    """Base of expert-parallel layers. Subclasses create ``self.dispatcher`` and their slot
    parameters, implement :meth:`named_slot_parameters`, then call :meth:`_init_slots`.

    Attributes (read-only): ``placement``, ``layer`` (its row in the placement),
    ``local_experts`` ([Ls] int64, the logical expert of each local slot); ``dispatcher``.
    """

    placement = _read_only("placement")
    layer = _read_only("layer")
    local_experts = _read_only("local_experts")

    # Times the expert computation when set (:class:`moebalance.speeds.ExpertTimer`, set by
    # ``SpeedTracker.attach``): subclasses pass the rows their slots receive through
    # ``begin`` and the slots' outputs through ``end``.
    expert_timer = None

    @abstractmethod
    def named_slot_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(name within this layer, parameter [Ls, ...]) of every slot tensor, in a fixed order."""

    def slot_parameters(self) -> list[nn.Parameter]:
        return [p for _, p in self.named_slot_parameters()]

    def router_module(self) -> nn.Module:
        """The router whose choices this layer serves (what a LoadTracker records)."""
        return self.router

    def _check_placement(self, placement: Placement, layer: int, num_experts: int) -> None:
        if not isinstance(placement, Placement):
            raise TypeError("placement must be a moebalance.Placement, got "
                            f"{type(placement).__name__}")
        if placement.num_experts != num_experts:
            raise ValueError(f"placement has {placement.num_experts} experts but the layer has "
                             f"num_experts={num_experts}; plan the placement for this "
                             "layer's experts")

    def _init_slots(self, placement: Placement, layer: int, *, grad_sync: str,
                    group_params=(), grad_scale: float = 1.0) -> None:
        """Adopt ``placement`` and set up gradient sync (call once the slot parameters exist).

        Args:
            group_params: parameters replicated on every rank whose gradients this layer sums
                over the group (its router), besides the slot tensors.
            grad_scale: factor on every gradient the sync produces (1: gradients of the sum of
                the ranks' losses; 1/G: of their mean).
        """
        if grad_sync not in GRAD_SYNC:
            raise ValueError(f"grad_sync must be one of {list(GRAD_SYNC)}, got {grad_sync!r}")
        self._pending = None
        self._set_placement(placement, layer)
        self.grad_sync = grad_sync
        self._sync = None
        if self.dispatcher.world_size > 1:
            this = weakref.ref(self)     # no cycle module -> sync -> module (see GradientSync)
            self._sync = GradientSync(self.dispatcher.group, lambda: this()._exchange,
                                      self.slot_parameters(), list(group_params), scale=grad_scale)
            self._sync.enabled = grad_sync == "backward"
        # Slot rows differ per rank: any DDP around this layer must leave them alone.
        exclude_experts_from_ddp(self)
        mark_slot_parameters(self.slot_parameters())
        _warn_if_subgroup(self.dispatcher.world_size)
        # The gradient sync over the ranks holds these very tensors (a plain list: a deepcopy of
        # the layer maps it to the copy's own).
        self._slot_held = self.slot_parameters() if self._sync is not None else []

    def _set_placement(self, placement: Placement, layer: int) -> None:
        """Adopt ``placement`` for routing and gradient sync (slot storage keeps its shape)."""
        local = self.dispatcher.local_slots(placement, layer)
        num_slots = self.slot_parameters()[0].shape[0]
        if len(local) != num_slots:
            raise ValueError(f"placement gives rank {self.dispatcher.rank} {len(local)} slots but "
                             f"this layer stores {num_slots}; placements must keep the "
                             "topology's slots")
        experts = placement.phy2log[layer, local.start:local.stop].copy()
        experts.setflags(write=False)
        self.__dict__["_first_holders"] = None        # DeviceIndex of first_holder_rows, lazily
        self.__dict__["_placement"] = placement
        self.__dict__["_layer"] = int(layer)
        self.__dict__["_local_experts"] = experts
        self._exchange = HolderExchange(placement.phy2log[layer], placement.slot_device,
                                        self.dispatcher.rank, tag=int(layer))

    def __deepcopy__(self, memo):
        """A copy that follows this layer's placement changes (see ``_COPIES``); a migration in
        flight stays the layer's (the copy holds the rows as they are, and follows the commit)."""
        twin = type(self).__new__(type(self))
        memo[id(self)] = twin
        memo[id(self.__dict__.get("_pending"))] = None
        twin.__setstate__(copy.deepcopy(self.__dict__, memo))
        _COPIES.setdefault(self, []).append(weakref.ref(twin))
        return twin

    def _commit_placement(self, target: Placement, layer: int, migrator: Migrator) -> None:
        """Adopt ``target`` once this layer's rows are in place, and move its copies' rows the
        same way (collective: every rank's layer commits at the same point)."""
        old = self.placement
        self._set_placement(target, layer)
        self._follow_copies(old, target, layer, migrator)

    def _follow_copies(self, old: Placement, target: Placement, layer: int,
                       migrator: Migrator) -> None:
        """Move the slot rows of this layer's live copies that still hold ``old``'s row (one
        blocking, weights-only migration each, before the layer's forward) and give them
        ``target``. The ranks first agree on how many copies follow."""
        alive = [ref() for ref in _COPIES.get(self, [])]
        _COPIES[self] = [weakref.ref(c) for c in alive if c is not None]
        copies = [c for c in alive if c is not None and c.layer == layer
                  and np.array_equal(c.placement.slot_device, old.slot_device)
                  and np.array_equal(c.placement.phy2log[layer], old.phy2log[layer])]
        agree(Attempt(f"moving the deep copies of expert-parallel layer {layer} (an EMA's "
                      f"AveragedModel, a reference model) with it: make them on every rank"),
              self.dispatcher.group, same={"copies": len(copies)})
        if not copies:
            return

        def row(p: Placement) -> Placement:
            return Placement(p.phy2log[[layer]], p.share[[layer]], p.slot_device, p.num_experts)

        plan = plan_migration(row(old), row(target))
        for twin in copies:
            migrator.start(plan, {0: twin.slot_parameters()}, None).wait()
            twin._set_placement(target, layer)

    def apply_placement(self, new: Placement, optimizer=None, **options):
        """Move this layer to ``new`` (weights and optimizer state); see :func:`apply_placement`."""
        return apply_placement(self, new, optimizer, **options)

    @property
    def pending_migration(self):
        """The :class:`~moebalance.migrate.Migration` this layer still has to commit, or None."""
        return self._pending

    def replica_sync_bytes(self) -> int:
        """Bytes this rank sends per step to reduce its replicas' gradients (holders only)."""
        return self._exchange.bytes_sent(self.slot_parameters())

    def _commit_pending(self) -> None:
        """Before this layer's first forward after a boundary: put its staged rows in place.
        Raises RuntimeError first if the slot parameters are no longer the layer's own."""
        held = getattr(self, "_slot_held", ())      # empty on one rank: nothing to check
        if held and any(h is not p for h, p in zip(held, self.slot_parameters())):
            # FSDP's fully_shard swaps every parameter for its shard (and, during forward, for
            # the gathered tensor): the ranks' slots would be mixed as if they were one tensor.
            raise RuntimeError(
                f"the expert slot parameters of {type(self).__name__} (layer {self.layer}) are not "
                "the tensors it was built with: something replaced them, as FSDP's fully_shard "
                "does. Sharded data parallelism is not supported (each rank's slots hold other "
                "experts); leave the model unsharded or wrap it in DistributedDataParallel, and "
                "load checkpoints without assign=True (mb.checkpoint.load, or load_state_dict)")
        migration = self._pending
        if migration is None:
            return
        if migration.commit_gate is not None and not migration.commit_gate():
            return        # gradients are accumulating: commit after the optimizer's step
        migration.commit(self.layer)
        if not migration.pending(self.layer):
            self._pending = None

    # -- checkpoints ------------------------------------------------------------------------------

    def get_extra_state(self) -> torch.Tensor:
        """The placement row this rank's slot rows were saved under, for a per-rank checkpoint:
        one float64 tensor ``[layer, num_experts, S, phy2log[layer] (S), share[layer] (S),
        slot_device (S), rank]`` (a tensor, so safetensors files, as the Hugging Face Trainer
        writes, can hold it; ids are exact in float64). ``rank``: whose slots the rows are."""
        p = self.placement
        head = [float(self.layer), float(p.num_experts), float(p.num_slots)]
        return torch.from_numpy(np.concatenate([
            np.asarray(head), p.phy2log[self.layer].astype(np.float64), p.share[self.layer],
            p.slot_device.astype(np.float64), [float(self.dispatcher.rank)]]))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs) -> None:
        # A state_dict holds its own rank's slots only: rank 0's, loaded on every rank (the
        # data-parallel habit: save on rank 0, load everywhere), would give the other ranks
        # rank 0's experts in their slots. Refused before any row is copied, unless a framework
        # callback loads every expert by logical id right after (_OTHER_RANKS_ROWS).
        saved = _saved_rank(state_dict.get(prefix + "_extra_state"))
        if saved is not None and saved != self.dispatcher.rank:
            if _OTHER_RANKS_ROWS[0] == 0:
                raise ValueError(
                    f"this state_dict holds the expert slots of rank {saved}, and a state_dict "
                    f"holds only its own rank's experts: rank {self.dispatcher.rank} must load "
                    f"its own. Save one per rank (on every rank: torch.save(model.state_dict(), "
                    f"f'ckpt-rank{{rank}}.pt')), or every expert by logical id "
                    f"(mb.checkpoint.save(path, model, optimizer), mb.save_pretrained)")
            self.other_ranks_rows_loaded = True
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    def set_extra_state(self, state) -> None:
        """Resume the placement row a per-rank checkpoint was saved under (its rows came along).
        Takes :meth:`get_extra_state`'s tensor, or the dict earlier versions saved."""
        if isinstance(state, torch.Tensor):
            values = state.detach().to("cpu", torch.float64).numpy()
            S = int(values[2]) if values.size >= 3 else -1
            if values.size == 4 + 3 * S:
                values = values[:-1]                 # the saving rank (checked at the load)
            if values.size != 3 + 3 * S:
                raise ValueError(f"the extra state of layer {self.layer} holds {values.size} "
                                 f"numbers, not a placement row; load this checkpoint by logical "
                                 f"expert with moebalance.nn.checkpoint.load_expert_state_dict")
            state = {"layer": int(values[0]), "num_experts": int(values[1]),
                     "phy2log": values[3:3 + S].astype(np.int64).tolist(),
                     "share": values[3 + S:3 + 2 * S].tolist(),
                     "slot_device": values[3 + 2 * S:].astype(np.int64).tolist()}
        current = self.placement
        if (state.get("num_experts") != current.num_experts
                or state.get("slot_device") != current.slot_device.tolist()):
            raise ValueError(
                f"this checkpoint of layer {self.layer} was saved for devices/slots "
                f"{np.bincount(state.get('slot_device', [])).tolist()} and "
                f"{state.get('num_experts')} experts; this layer runs "
                f"{np.bincount(current.slot_device).tolist()} and {current.num_experts}: load it "
                f"by logical expert with moebalance.nn.checkpoint.load_expert_state_dict")
        if self._pending is not None:
            self._pending.wait()
        phy2log = current.phy2log.copy()
        share = current.share.copy()
        phy2log[self.layer] = state["phy2log"]
        share[self.layer] = state["share"]
        self._set_placement(Placement(phy2log, share, current.slot_device, current.num_experts)
                            .validate(), self.layer)


# > 0 while a framework loads a state_dict whose experts it then loads by logical id (the
# Lightning callback's load hooks): another rank's slot rows pass, and the layers that took
# them set ``other_ranks_rows_loaded`` for the callback to check.
_OTHER_RANKS_ROWS = [0]


def _saved_rank(state) -> int | None:
    """The rank whose slots a saved extra state's rows are (None: not recorded)."""
    if not isinstance(state, torch.Tensor) or state.dim() != 1 or state.numel() < 3:
        return None
    S = int(state[2])
    return int(state[-1]) if state.numel() == 4 + 3 * S else None


def moe_layers(module: nn.Module) -> list[ExpertSlots]:
    """The expert-parallel layers of ``module`` (itself included), in module order."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    return [m for m in module.modules() if isinstance(m, ExpertSlots)]


def _require_layers(module: nn.Module) -> list[ExpertSlots]:
    layers = moe_layers(module)
    if not layers:
        raise ValueError(f"{type(module).__name__} holds no expert-parallel layer "
                         f"(ExpertParallelMoE, or a model passed through moebalance.wrap)")
    return layers


def reduce_replica_gradients(module: nn.Module, *, include_router: bool = True) -> None:
    """Make every expert replica's gradient the gradient of its whole logical expert, now.

    For layers built with ``grad_sync="backward"`` (the default) this already happened during
    backward and the call does nothing. For ``grad_sync="manual"`` layers, call it on every rank
    of the expert-parallel group after ``backward()`` and before ``optimizer.step()``:

    * experts with more than one replica: each holder exchanges its gradient rows with the other
      holders of the expert only and sums them in holder-rank order, so replicas that start
      identical stay identical under any deterministic optimizer; experts with one replica need
      nothing. Per step a rank sends one row per replicated expert it holds with two holders
      and ``2 (h - 1) / h`` rows of one with ``h >= 3`` (``layer.replica_sync_bytes()``), not
      a dense buffer of all replicated experts;
    * the parameters the layer replicates on every rank (its router), when ``include_router``:
      their gradient is summed over the ranks.
    """
    for layer in moe_layers(module):
        if layer._sync is None or layer.grad_sync != "manual":
            continue
        exchange, group, scale = layer._exchange, layer.dispatcher.group, layer._sync.scale
        # A gradient that cannot be exchanged on one rank (wrong shape, dtype or device) is
        # replaced by zeros there, so every rank posts the same messages; the ranks then agree
        # and all raise the same error (with one more all-reduce of one int, beside a whole
        # gradient exchange). A failure left from the backward travels with it.
        attempt = Attempt(f"reduce_replica_gradients of layer {layer.layer}")
        left = take_backward_failure(group)
        if left is not None:
            attempt.fail(left)
        posted = []
        for kind, p in enumerate(layer.slot_parameters()):
            with attempt.run():
                increment = torch.zeros_like(p)
                if p.grad is not None:
                    _check_grad(p.grad, p, f"the gradient of slot tensor {kind}")
                    increment = p.grad
                posted.append((p, exchange.post(increment, kind, group)))
            if len(posted) == kind:     # it failed: zeros take this rank's part
                posted.append((p, exchange.post(torch.zeros_like(p), kind, group)))
        for p, post in posted:
            total = exchange.finish(post)
            if attempt.failed:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            rows = exchange.rep_slots_on(p.device)
            if scale != 1.0:
                p.grad.mul_(scale)
            p.grad.index_copy_(0, rows, (total * scale).to(p.grad.dtype))
        if include_router:
            for p in layer._sync.group_params:
                with attempt.run():
                    if p.grad is not None:
                        _check_grad(p.grad, p, "the gradient of a router parameter")
                if not attempt.failed and p.grad is None:
                    p.grad = torch.zeros_like(p)
                total = torch.zeros_like(p) if attempt.failed else p.grad
                dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
                if scale != 1.0 and not attempt.failed:
                    total.mul_(scale)
        # A non-finite expert gradient on one rank is one on every rank (mark_non_finite).
        params = layer.slot_parameters()
        agree_spreading_non_finite(attempt, group, non_finite(params), params[0])


def _check_grad(grad, param: torch.Tensor, name: str) -> None:
    """Raise ValueError unless ``grad`` can be reduced as ``param``'s gradient."""
    if (not isinstance(grad, torch.Tensor) or grad.shape != param.shape
            or grad.dtype != param.dtype or grad.device != param.device):
        raise ValueError(f"{name} is {getattr(grad, 'dtype', type(grad).__name__)} "
                         f"{tuple(getattr(grad, 'shape', ()))} on {getattr(grad, 'device', '?')}; "
                         f"it must match the parameter: {param.dtype} {tuple(param.shape)} on "
                         f"{param.device}")


def current_placement(module: nn.Module) -> Placement:
    """The placement the layers of ``module`` hold now: row ``layer.layer`` from each layer.

    During a migration that moves layers one by one, some layers hold rows of the new placement
    and some of the old; the result is the placement in force, layer by layer.
    """
    layers = _require_layers(module)
    base = layers[0].placement
    phy2log, share = base.phy2log.copy(), base.share.copy()
    for layer in layers:
        p = layer.placement
        if p.phy2log.shape != base.phy2log.shape or not np.array_equal(p.slot_device,
                                                                       base.slot_device):
            raise ValueError("the expert-parallel layers of this module follow placements of "
                             "different shapes; one placement must cover all of them")
        phy2log[layer.layer] = p.phy2log[layer.layer]
        share[layer.layer] = p.share[layer.layer]
    return Placement(phy2log, share, base.slot_device, base.num_experts)


def set_device_speeds(module: nn.Module, speeds) -> None:
    """Make the per-step re-split of every expert-parallel layer of ``module`` use ``speeds``
    ([G] relative speed of each rank, e.g. ``topology.speed``; None: equal speeds).

    Call it on every rank of the group with the same speeds between the same two steps (as
    :class:`moebalance.Rebalancer` does when it adopts measured speeds, from figures every rank
    gathered alike): the re-split runs on every rank from the same counts and must agree on
    where each pair goes. Layers built with ``resplit=False`` keep the placement's shares.
    """
    layers = _require_layers(module)
    for dispatcher in {id(layer.dispatcher): layer.dispatcher for layer in layers}.values():
        dispatcher.set_speeds(speeds)


def apply_placement(module: nn.Module, new: Placement, optimizer=None, *, topology=None,
                    blocking: bool = True, timeout_s: float = 60.0,
                    max_bytes_in_flight: int | None = None):
    """Move every expert-parallel layer of ``module`` to placement ``new``.

    The one public way to change a live placement. Call on every rank of the group at a step
    boundary (after ``optimizer.step()``), with the same ``new`` everywhere.

    Args:
        module: an expert-parallel layer or a model holding them (all in one process group).
        new: the placement to reach, for the same topology (devices and their slots).
        optimizer: the optimizer that updates the experts: every state tensor shaped like a slot
            tensor (momentum, Adam moments) moves with its rows. None moves weights only.
        topology: the devices (their nodes pick nearby senders); optional.
        blocking: True: finish now (transfers, then every layer commits). False: return at once;
            each layer commits right before its next forward, so the transfers run beside
            whatever comes first (see :mod:`moebalance.migrate.transfer`).
        timeout_s: how long a layer's commit waits for its transfers before the migration fails.
        max_bytes_in_flight: start only as many layers per step boundary as fit (at least one).

    Returns:
        The :class:`~moebalance.migrate.transfer.Migration` (``report()`` has its moves, bytes
        and time).

    Raises:
        MigrationError: with ``blocking``, on every rank, if a transfer failed; the layers keep a
            valid placement (the old one where the new one did not commit) and no row is lost.
    """
    layers = _require_layers(module)
    groups = {id(layer.dispatcher.group) for layer in layers}
    if len(groups) != 1:
        raise ValueError("the expert-parallel layers of module use different process groups; "
                         "apply a placement to each group's layers separately")
    for layer in layers:
        if layer._pending is not None:
            layer._pending.wait()
    # Checks and planning are local: the ranks agree on them (one all-reduce of one int, once
    # per placement change) before the first transfer, so a bad `new` on one rank raises the
    # same error everywhere.
    attempt = Attempt("apply_placement")
    with attempt.run():
        if not isinstance(new, Placement):
            raise TypeError(f"new must be a moebalance.Placement, got {type(new).__name__}")
        if len({layer.layer for layer in layers}) != len(layers):
            raise ValueError("two expert-parallel layers of module share a placement layer "
                             "index; give each layer its own `layer`")
        old = current_placement(module)
        new.validate()
        params = {layer.layer: layer.slot_parameters() for layer in layers}
        plan = plan_migration(old, new, topology,
                              expert_bytes=max(row_bytes(p, optimizer) for p in params.values()))
    agree(attempt, layers[0].dispatcher.group)
    migrator = Migrator(layers[0].dispatcher.group, timeout_s=timeout_s,
                        max_bytes_in_flight=max_bytes_in_flight)
    migration = migrator.start(plan, params, optimizer)
    for layer in layers:
        if layer.layer in plan.changed_layers:
            layer._pending = migration
            migration.on_commit(layer.layer, lambda index, layer=layer: layer._commit_placement(
                plan.target, index, migrator))
    if blocking:
        try:
            migration.wait()
        finally:
            for layer in layers:
                layer._pending = None
    return migration


def first_holder_rows(layer: ExpertSlots) -> torch.Tensor:
    """Local slots whose expert has no replica on a lower global slot (each expert counted once)."""
    placement, index = layer.placement, layer.layer
    phy2log = placement.phy2log[index]
    first = np.full(placement.num_experts, -1, dtype=np.int64)
    first[phy2log[::-1]] = np.arange(phy2log.size)[::-1]
    lo = int(np.searchsorted(placement.slot_device, layer.dispatcher.rank))
    local = np.arange(lo, lo + len(layer.local_experts))
    return torch.from_numpy(np.flatnonzero(first[layer.local_experts] == local))


def clip_grad_norm_(module: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients of an expert-parallel model by their *global* norm. Collective.

    ``torch.nn.utils.clip_grad_norm_`` on each rank sees only that rank's slots, so ranks scale by
    different factors and replicas of one expert drift apart. Here every logical expert counts
    once (its first holder's rows) and every parameter outside the expert slots once (it is
    replicated: its gradient is the same on every rank), the norm is reduced over the group, and
    every rank scales by the same factor. After it, any rank's local norm is at most the global
    one, so a framework's own per-rank clipping to the same ``max_norm`` changes nothing.

    Args:
        module: a model holding expert-parallel layers (one process group).
        max_norm: the largest allowed global norm.
        norm_type: 2.0 or ``float("inf")``.

    Returns:
        The global norm before clipping (a 0-dim tensor).
    """
    if not isinstance(max_norm, (int, float)) or isinstance(max_norm, bool) or not max_norm > 0:
        raise ValueError(f"max_norm must be a number > 0, got {max_norm!r}")
    if norm_type not in (2.0, 2, float("inf")):
        raise ValueError(f"norm_type must be 2.0 or float('inf'), got {norm_type!r}")
    layers = moe_layers(module)
    group = layers[0].dispatcher.group if layers else None
    world = layers[0].dispatcher.world_size if layers else 1
    rank = layers[0].dispatcher.rank if layers else 0
    slot_rows = {}
    for layer in layers:
        if layer._first_holders is None:      # once per placement: no per-step host copy
            layer.__dict__["_first_holders"] = DeviceIndex(first_holder_rows(layer))
        for p in layer.slot_parameters():
            slot_rows[id(p)] = layer._first_holders
    grads, parts = [], []
    for p in module.parameters():
        if p.grad is None:
            continue
        grads.append(p.grad)
        if id(p) in slot_rows:
            g = p.grad.index_select(0, slot_rows[id(p)].on(p.grad.device))
        elif rank == 0:
            g = p.grad
        else:
            continue
        g = g.detach().double()
        parts.append(g.abs().max() if norm_type == float("inf") and g.numel() else g.pow(2).sum())
    # a rank without gradients reduces on its parameters' device, as its peers do
    device = grads[0].device if grads else next(
        (p.device for p in module.parameters()), torch.device("cpu"))
    total = (torch.stack(parts).to(device) if parts
             else torch.zeros(1, dtype=torch.float64, device=device))
    if norm_type == float("inf"):
        total = total.max() if total.numel() else total.sum()
        if world > 1:
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
        norm = total
    else:
        total = total.sum()
        if world > 1:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        norm = total.sqrt()
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
        setattr(g, CLIPPED_MARK, True)     # a per-rank clip after this one need not be checked
    return norm
