"""Expert-parallel MoE layer, and the dense single-device layer it must equal.

:class:`ExpertParallelMoE` holds the expert slots of *this* rank only (``experts.gate_up
[Ls, 2F, D]``, ``experts.down [Ls, D, F]``, slot i holding the logical expert
``placement.phy2log[layer, first local slot + i]``) and a router replicated on every rank. Its
forward routes, dispatches the token rows to replicas by the placement's token shares, runs the
SwiGLU experts of each local slot and combines. :class:`DenseMoE` is the same layer on one device,
a plain loop over experts; with equal weights the two give equal outputs and gradients under any
placement and any world size.

Replicas start identical and stay identical: during backward each replica's gradient becomes
the sum over the replicas of its expert, exchanged among the expert's holders only, and the
router's gradient is summed over the ranks (:mod:`moebalance.replica_sync`); the gradients are
final when ``backward()`` returns. A live placement changes only through
:func:`apply_placement` (weights and optimizer state move with their rows, see
:mod:`moebalance.migrate`).

Legend: T tokens, D hidden size, F expert hidden size, E logical experts, K top-k, Ls slots on
this rank, M rows this rank's slots receive, R experts of the layer with more than one replica,
G ranks of the expert-parallel group.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .dispatch.dispatcher import Dispatcher
from .migrate import Migrator, plan_migration, row_bytes
from .placement import Placement
from .replica_sync import GradientSync, HolderExchange

__all__ = ["TopKRouter", "SlotExperts", "DenseMoE", "ExpertParallelMoE", "reduce_replica_gradients",
           "apply_placement", "current_placement", "moe_layers", "clip_grad_norm_"]


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return int(value)


def _generator(seed: int, index: int) -> torch.Generator:
    """A CPU generator for parameter block ``index`` (0: router, e + 1: expert e) of ``seed``.

    Each logical expert's initial weights depend on (seed, expert) alone, so all its replicas,
    on any rank, start identical, and a DenseMoE with the same seed holds the same experts.
    """
    gen = torch.Generator()
    gen.manual_seed((int(seed) * 1_000_003 + int(index)) % (1 << 63))
    return gen


def _uniform_(param: torch.Tensor, bound: float, gen: torch.Generator) -> None:
    values = torch.rand(param.shape, generator=gen, dtype=torch.float64) * (2 * bound) - bound
    with torch.no_grad():
        param.copy_(values.to(dtype=param.dtype, device=param.device))


def _draw_seed() -> int:
    """A seed from torch's global generator (so layers built in turn differ)."""
    return int(torch.randint(0, 1 << 62, (1,)).item())


def swiglu(x_MD: torch.Tensor, gate_up_2FD: torch.Tensor, down_DF: torch.Tensor) -> torch.Tensor:
    """One SwiGLU expert: ``down @ (silu(gate @ x) * (up @ x))`` with gate, up = rows of gate_up.

    Args:
        x_MD: [M, D] input rows.
        gate_up_2FD: [2F, D], gate rows first, then up rows (the transformers layout).
        down_DF: [D, F].

    Returns:
        y_MD: [M, D].
    """
    gate, up = F.linear(x_MD, gate_up_2FD).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down_DF)


class TopKRouter(nn.Module):
    """Softmax top-k router, replicated on every rank.

    Args:
        hidden_size: D.
        num_experts: E.
        top_k: K, experts per token (1 <= K <= E).
        norm_topk_prob: renormalise the K chosen probabilities to sum to 1.

    Forward: ``hidden_states [..., D]`` -> ``(router_logits [T, E], topk_weights [T, K],
    topk_ids [T, K] int64)`` with T the product of the leading dims, like the routers of
    transformers 5.x MoE models; ``moebalance.attach()`` hooks it and records ``topk_ids``.
    """

    moebalance_router = True   # marks the class for moebalance.attach()

    def __init__(self, hidden_size: int, num_experts: int, top_k: int,
                 norm_topk_prob: bool = True) -> None:
        super().__init__()
        self.hidden_dim = _positive_int(hidden_size, "hidden_size")
        self.num_experts = _positive_int(num_experts, "num_experts")
        self.top_k = _positive_int(top_k, "top_k")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={top_k} exceeds num_experts={num_experts}; choose top_k <= "
                             f"num_experts")
        self.norm_topk_prob = bool(norm_topk_prob)
        self.weight = nn.Parameter(torch.empty(self.num_experts, self.hidden_dim))
        self.reset_parameters(0)

    def reset_parameters(self, seed: int) -> None:
        """Initialise ``weight [E, D]`` uniformly in +-1/sqrt(D) from ``seed``."""
        _uniform_(self.weight, self.hidden_dim ** -0.5, _generator(seed, 0))

    def forward(self, hidden_states: torch.Tensor):
        x_TD = hidden_states.reshape(-1, self.hidden_dim)
        router_logits = F.linear(x_TD, self.weight)
        # Softmax in at least float32 (bf16 logits), float64 stays float64.
        probs = F.softmax(router_logits, dim=-1,
                          dtype=torch.promote_types(router_logits.dtype, torch.float32))
        topk_weights, topk_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        return router_logits, topk_weights.to(router_logits.dtype), topk_ids


class SlotExperts(nn.Module):
    """SwiGLU experts stored by slot: ``gate_up [slots, 2F, D]``, ``down [slots, D, F]``.

    Every parameter has the slot as its leading dim, so a new placement changes which expert's
    numbers sit in a row, never a shape (the optimizer keeps its references).
    """

    def __init__(self, num_slots: int, hidden_size: int, ffn_hidden_size: int) -> None:
        super().__init__()
        self.num_slots = _positive_int(num_slots, "num_slots")
        self.hidden_dim = _positive_int(hidden_size, "hidden_size")
        self.ffn_dim = _positive_int(ffn_hidden_size, "ffn_hidden_size")
        self.gate_up = nn.Parameter(torch.empty(self.num_slots, 2 * self.ffn_dim, self.hidden_dim))
        self.down = nn.Parameter(torch.empty(self.num_slots, self.hidden_dim, self.ffn_dim))

    def init_slot(self, slot: int, seed: int, expert: int) -> None:
        """Initialise ``slot`` with logical expert ``expert``'s weights for ``seed``."""
        gen = _generator(seed, expert + 1)
        _uniform_(self.gate_up[slot], self.hidden_dim ** -0.5, gen)
        _uniform_(self.down[slot], self.ffn_dim ** -0.5, gen)

    def forward(self, x_MD: torch.Tensor, tokens_per_slot) -> torch.Tensor:
        """Apply slot i to its contiguous rows.

        Args:
            x_MD: [M, D], rows grouped by slot.
            tokens_per_slot: [slots] ints summing to M, rows of each slot.

        Returns:
            y_MD: [M, D].
        """
        # Empty slots still run (on zero rows) so that the output always depends on the
        # parameters: every rank then joins the backward exchanges, even one that got no rows.
        chunks = torch.split(x_MD, list(tokens_per_slot))
        return torch.cat([swiglu(rows, self.gate_up[s], self.down[s])
                          for s, rows in enumerate(chunks)])


class DenseMoE(nn.Module):
    """Single-device SwiGLU MoE layer: the reference :class:`ExpertParallelMoE` must equal.

    Args:
        hidden_size: D. ffn_hidden_size: F. num_experts: E. top_k: K.
        norm_topk_prob: renormalise the chosen router probabilities.
        seed: initial weights (router and each expert) from this seed; None draws it from
            torch's global generator.

    Attributes: ``router`` (:class:`TopKRouter`), ``experts`` (:class:`SlotExperts` with slot e
    holding expert e: ``gate_up [E, 2F, D]``, ``down [E, D, F]``).

    Forward: ``hidden_states [..., D] -> [..., D]``, a plain loop over experts.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_experts: int, top_k: int, *,
                 norm_topk_prob: bool = True, seed: int | None = None) -> None:
        super().__init__()
        self.router = TopKRouter(hidden_size, num_experts, top_k, norm_topk_prob)
        self.experts = SlotExperts(num_experts, hidden_size, ffn_hidden_size)
        self.reset_parameters(seed)

    @property
    def num_experts(self) -> int:
        return self.router.num_experts

    def reset_parameters(self, seed: int | None = None) -> None:
        seed = _draw_seed() if seed is None else int(seed)
        self.router.reset_parameters(seed)
        for e in range(self.num_experts):
            self.experts.init_slot(e, seed, e)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        D = self.router.hidden_dim
        if hidden_states.shape[-1] != D:
            raise ValueError(f"hidden_states must have shape [..., {D}], got {tuple(hidden_states.shape)}")
        x_TD = hidden_states.reshape(-1, D)
        _, topk_weights, topk_ids = self.router(x_TD)
        out = torch.zeros_like(x_TD)
        for e in range(self.num_experts):
            token, k = torch.where(topk_ids == e)
            y = swiglu(x_TD[token], self.experts.gate_up[e], self.experts.down[e])
            out = out.index_add(0, token, y * topk_weights[token, k].unsqueeze(1))
        return out.reshape(hidden_states.shape)


class ExpertParallelMoE(nn.Module):
    """SwiGLU MoE layer whose experts are spread over the ranks of a group by a placement.

    Args:
        hidden_size: D. ffn_hidden_size: F. num_experts: E. top_k: K.
        placement: the :class:`~moebalance.Placement` (its ``num_devices`` equals the group size;
            rank r holds the slots of device r).
        layer: this layer's index in the placement.
        group: the expert-parallel process group (None: the default group, or a single process
            when torch.distributed is not initialised).
        router: a module mapping ``x [T, D]`` to ``(router_logits [T, E], topk_weights [T, K],
            topk_ids [T, K])``; default a :class:`TopKRouter`. It must be identical on all ranks.
        norm_topk_prob: for the default router.
        seed: initial weights from this seed (expert e gets the weights ``DenseMoE(seed=seed)``
            gives it); None draws a seed from rank 0's global generator and broadcasts it, a
            construction-time collective.
        exchange: how rows travel between ranks ("auto", "all_to_all" or "p2p"); nodes: the
            node of each rank, to keep tokens on their node; see
            :class:`~moebalance.dispatch.Dispatcher`.
        grad_sync: "backward" (default): replica and router gradients are reduced during
            backward and are final when ``backward()`` returns (before gradient clipping);
            "manual": call :func:`reduce_replica_gradients` after backward.
        sync_router: sum the router's gradient over the group (it is replicated on every rank).
            False when something else reduces it (a DDP wrapper over the non-expert parameters).

    Attributes (read-only; a live placement changes only through :meth:`apply_placement`):
    ``placement``, ``layer``, ``local_experts`` ([Ls] int64, logical expert of each local slot).
    Also ``router``; ``experts`` (:class:`SlotExperts`, ``gate_up [Ls, 2F, D]``,
    ``down [Ls, D, F]``); ``dispatcher`` (:class:`~moebalance.dispatch.Dispatcher`).

    Keep the experts out of any data-parallel wrapper: DDP would average each slot with whatever
    unrelated expert the other ranks hold in the same slot row.

    Checkpoints: ``state_dict()`` holds this rank's slot rows and, as extra state, the layer's
    placement row, so a per-rank checkpoint resumes the placement it was saved under. To load
    into another placement or world size (or a :class:`DenseMoE`), save by logical expert with
    :mod:`moebalance.checkpoint`.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_experts: int, top_k: int,
                 placement: Placement, layer: int = 0, group=None, router: nn.Module | None = None,
                 *, norm_topk_prob: bool = True, seed: int | None = None,
                 exchange: str = "auto", nodes=None, grad_sync: str = "backward",
                 sync_router: bool = True) -> None:
        super().__init__()
        self.hidden_dim = _positive_int(hidden_size, "hidden_size")
        self.ffn_dim = _positive_int(ffn_hidden_size, "ffn_hidden_size")
        self.num_experts = _positive_int(num_experts, "num_experts")
        self.top_k = _positive_int(top_k, "top_k")
        if not isinstance(placement, Placement):
            raise TypeError(f"placement must be a moebalance.Placement, got {type(placement).__name__}")
        if placement.num_experts != self.num_experts:
            raise ValueError(f"placement has {placement.num_experts} experts but num_experts="
                             f"{num_experts}; plan the placement for this layer's experts")
        if grad_sync not in GRAD_SYNC:
            raise ValueError(f"grad_sync must be one of {list(GRAD_SYNC)}, got {grad_sync!r}")
        self.dispatcher = Dispatcher(group, exchange=exchange, nodes=nodes)
        if router is None:
            router = TopKRouter(hidden_size, num_experts, top_k, norm_topk_prob)
        elif not isinstance(router, nn.Module):
            raise TypeError(f"router must be a torch.nn.Module returning (router_logits, "
                            f"topk_weights, topk_ids), got {type(router).__name__}")
        self.router = router
        local = self.dispatcher.local_slots(placement, layer)
        self.experts = SlotExperts(len(local), hidden_size, ffn_hidden_size)
        self._pending = None
        self._set_placement(placement, layer)
        self.grad_sync = grad_sync
        self.sync_router = bool(sync_router)
        self._sync = None
        if self.dispatcher.world_size > 1:
            router_params = list(self.router.parameters()) if self.sync_router else []
            self._sync = GradientSync(self.dispatcher.group, lambda: self._exchange,
                                      [self.experts.gate_up, self.experts.down], router_params)
            self._sync.enabled = grad_sync == "backward"
        self.reset_parameters(seed)

    # -- placement ------------------------------------------------------------------------------

    def _read_only(name: str):  # noqa: N805 - builds properties at class creation
        def get(self):
            return self.__dict__["_" + name]

        def refuse(self, value):
            raise AttributeError(
                f"ExpertParallelMoE.{name} is read-only: the slot rows, routing tables and "
                f"gradient sync follow the placement together; change it with "
                f"moe.apply_placement(new_placement, optimizer) (or moebalance.apply_placement(model, "
                f"new_placement, optimizer) for every layer of a model)")

        return property(get, refuse, doc=f"The layer's current {name} (read-only).")

    placement = _read_only("placement")
    layer = _read_only("layer")
    local_experts = _read_only("local_experts")
    del _read_only

    def _set_placement(self, placement: Placement, layer: int) -> None:
        """Adopt ``placement`` for routing and gradient sync (slot storage keeps its shape)."""
        local = self.dispatcher.local_slots(placement, layer)
        if len(local) != self.experts.num_slots:
            raise ValueError(f"placement gives rank {self.dispatcher.rank} {len(local)} slots but "
                             f"this layer stores {self.experts.num_slots}; placements must keep "
                             f"the topology's slots")
        experts = placement.phy2log[layer, local.start:local.stop].copy()
        experts.setflags(write=False)
        self.__dict__["_placement"] = placement
        self.__dict__["_layer"] = int(layer)
        self.__dict__["_local_experts"] = experts
        self._exchange = HolderExchange(placement.phy2log[layer], placement.slot_device,
                                        self.dispatcher.rank, tag=int(layer))

    def apply_placement(self, new: Placement, optimizer=None, **options):
        """Move this layer to ``new`` (weights and optimizer state); see :func:`apply_placement`."""
        return apply_placement(self, new, optimizer, **options)

    @property
    def pending_migration(self):
        """The :class:`~moebalance.migrate.Migration` this layer still has to commit, or None."""
        return self._pending

    def replica_sync_bytes(self) -> int:
        """Bytes this rank sends per step to reduce its expert replicas' gradients (holders only)."""
        return self._exchange.bytes_sent([self.experts.gate_up, self.experts.down])

    def reset_parameters(self, seed: int | None = None) -> None:
        """Initialise the default router and every local slot from ``seed`` (see the class)."""
        if seed is None:
            seed = _draw_seed()
            if self.dispatcher.world_size > 1:
                box = [seed]
                dist.broadcast_object_list(box, group_src=0, group=self.dispatcher.group)
                seed = int(box[0])
        if isinstance(self.router, TopKRouter):
            self.router.reset_parameters(seed)
        for slot, expert in enumerate(self.local_experts.tolist()):
            self.experts.init_slot(slot, seed, expert)

    @classmethod
    def from_dense(cls, dense: DenseMoE, placement: Placement, layer: int = 0,
                   group=None, **options) -> "ExpertParallelMoE":
        """The expert-parallel layer holding ``dense``'s weights: slot i copies its expert's.

        Args:
            dense: a :class:`DenseMoE` (identical on every rank).
            placement, layer, group, options (exchange, nodes, grad_sync, sync_router): as in
                the constructor.
        """
        if not isinstance(dense, DenseMoE):
            raise TypeError(f"dense must be a moebalance.nn.DenseMoE, got {type(dense).__name__}")
        router = dense.router
        moe = cls(router.hidden_dim, dense.experts.ffn_dim, router.num_experts, router.top_k,
                  placement, layer, group, norm_topk_prob=router.norm_topk_prob, seed=0, **options)
        moe.to(device=router.weight.device, dtype=router.weight.dtype)
        experts = torch.tensor(moe.local_experts).to(router.weight.device)
        with torch.no_grad():
            moe.router.weight.copy_(router.weight)
            moe.experts.gate_up.copy_(dense.experts.gate_up.index_select(0, experts))
            moe.experts.down.copy_(dense.experts.down.index_select(0, experts))
        return moe

    # -- checkpoints ------------------------------------------------------------------------------

    def get_extra_state(self) -> dict:
        p = self.placement
        return {"layer": self.layer, "phy2log": p.phy2log[self.layer].tolist(),
                "share": p.share[self.layer].tolist(), "slot_device": p.slot_device.tolist(),
                "num_experts": p.num_experts}

    def set_extra_state(self, state: dict) -> None:
        """Resume the placement row a per-rank checkpoint was saved under (its rows came with it)."""
        current = self.placement
        if (state.get("num_experts") != current.num_experts
                or state.get("slot_device") != current.slot_device.tolist()):
            raise ValueError(
                f"this checkpoint of layer {self.layer} was saved for devices/slots "
                f"{np.bincount(state.get('slot_device', [])).tolist()} and "
                f"{state.get('num_experts')} experts; this layer runs "
                f"{np.bincount(current.slot_device).tolist()} and {current.num_experts}: load it by "
                f"logical expert with moebalance.checkpoint.load_expert_state_dict")
        if self._pending is not None:
            self._pending.wait()
        phy2log = current.phy2log.copy()
        share = current.share.copy()
        phy2log[self.layer] = state["phy2log"]
        share[self.layer] = state["share"]
        self._set_placement(Placement(phy2log, share, current.slot_device, current.num_experts)
                            .validate(), self.layer)

    # -- forward --------------------------------------------------------------------------------

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``hidden_states [..., D]`` (this rank's tokens) -> ``[..., D]``."""
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.shape[-1:] != (self.hidden_dim,):
            raise ValueError(f"hidden_states must be a tensor of shape [..., {self.hidden_dim}], got "
                             f"{tuple(getattr(hidden_states, 'shape', ()))}")
        if self._pending is not None:
            self._commit_pending()
        x_TD = hidden_states.reshape(-1, self.hidden_dim)
        _, topk_weights, topk_ids = self.router(x_TD)
        recv_MD, handle = self.dispatcher.dispatch(x_TD, topk_ids, topk_weights, self.placement,
                                                   self.layer)
        y_MD = self.experts(recv_MD, handle.tokens_per_local_slot)
        return self.dispatcher.combine(y_MD, handle).reshape(hidden_states.shape)

    def _commit_pending(self) -> None:
        """Before this layer's first forward after a boundary: put its staged rows in place."""
        migration = self._pending
        migration.commit(self.layer)
        if not migration.pending(self.layer):
            self._pending = None

    # -- gradient sync --------------------------------------------------------------------------

    def reduce_replica_gradients(self, include_router: bool = True) -> None:
        """Reduce this layer's gradients now; see :func:`reduce_replica_gradients`."""
        reduce_replica_gradients(self, include_router=include_router)


GRAD_SYNC = ("backward", "manual")


def moe_layers(module: nn.Module) -> list[ExpertParallelMoE]:
    """The :class:`ExpertParallelMoE` layers of ``module`` (itself included), in module order."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    return [m for m in module.modules() if isinstance(m, ExpertParallelMoE)]


def reduce_replica_gradients(module: nn.Module, *, include_router: bool = True) -> None:
    """Make every expert replica's gradient the gradient of its whole logical expert, now.

    For layers built with ``grad_sync="backward"`` (the default) this already happened during
    backward and the call does nothing. For ``grad_sync="manual"`` layers, call it on every rank
    of the expert-parallel group after ``backward()`` and before ``optimizer.step()``:

    * experts with more than one replica: each holder exchanges its gradient rows with the other
      holders of the expert only and sums them in holder-rank order, so replicas that start
      identical stay identical under any deterministic optimizer; experts with one replica need
      nothing. Per step a rank sends ``(h - 1)`` rows per replicated expert it holds
      (``ExpertParallelMoE.replica_sync_bytes()``), not a dense buffer of all replicated experts;
    * the router (replicated on every rank), when ``include_router`` and the layer's
      ``sync_router``: its gradient is summed over the ranks (SUM, so scale each rank's loss by
      1 / global tokens to match one process on the global batch).
    """
    for layer in moe_layers(module):
        if layer._sync is None or layer.grad_sync != "manual":
            continue
        ex, exchange, group = layer.experts, layer._exchange, layer.dispatcher.group
        posted = [(p, exchange.post(p.grad if p.grad is not None else torch.zeros_like(p), kind, group))
                  for kind, p in enumerate((ex.gate_up, ex.down))]
        for p, post in posted:
            total = exchange.finish(post)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.index_copy_(0, exchange.rep_slots.to(p.device), total.to(p.grad.dtype))
        if include_router and layer.sync_router:
            for p in layer.router.parameters():
                if p.requires_grad:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=group)


def current_placement(module: nn.Module) -> Placement:
    """The placement the layers of ``module`` hold now: row ``layer.layer`` from each layer.

    During a migration that moves layers one by one, some layers hold rows of the new placement
    and some of the old; the result is the placement in force, layer by layer.
    """
    layers = moe_layers(module)
    if not layers:
        raise ValueError(f"{type(module).__name__} holds no ExpertParallelMoE layer")
    base = layers[0].placement
    phy2log, share = base.phy2log.copy(), base.share.copy()
    for layer in layers:
        p = layer.placement
        if p.phy2log.shape != base.phy2log.shape or not np.array_equal(p.slot_device, base.slot_device):
            raise ValueError("the ExpertParallelMoE layers of this module follow placements of "
                             "different shapes; one placement must cover all of them")
        phy2log[layer.layer] = p.phy2log[layer.layer]
        share[layer.layer] = p.share[layer.layer]
    return Placement(phy2log, share, base.slot_device, base.num_experts)


def apply_placement(module: nn.Module, new: Placement, optimizer=None, *, topology=None,
                    blocking: bool = True, timeout_s: float = 60.0,
                    max_bytes_in_flight: int | None = None):
    """Move every :class:`ExpertParallelMoE` layer of ``module`` to placement ``new``.

    The one public way to change a live placement. Call on every rank of the group at a step
    boundary (after ``optimizer.step()``), with the same ``new`` everywhere.

    Args:
        module: an ExpertParallelMoE or a model holding them (all in one process group).
        new: the placement to reach, for the same topology (devices and their slots).
        optimizer: the optimizer that updates the experts: every state tensor shaped like a slot
            tensor (momentum, Adam moments) moves with its rows. None moves weights only.
        topology: the devices (their nodes pick nearby senders); optional.
        blocking: True: finish now (transfers, then every layer commits). False: return at once;
            each layer commits right before its next forward, so the transfers run beside
            whatever comes first (see :mod:`moebalance.migrate`).
        timeout_s: how long a layer's commit waits for its transfers before the migration fails.
        max_bytes_in_flight: start only as many layers per step boundary as fit (at least one).

    Returns:
        The :class:`~moebalance.migrate.Migration` (``report()`` has moves, bytes and time).

    Raises:
        MigrationError: with ``blocking``, on every rank, if a transfer failed; the layers keep a
            valid placement (the old one where the new one did not commit) and no row is lost.
    """
    layers = moe_layers(module)
    if not layers:
        raise ValueError(f"{type(module).__name__} holds no ExpertParallelMoE layer")
    if not isinstance(new, Placement):
        raise TypeError(f"new must be a moebalance.Placement, got {type(new).__name__}")
    groups = {id(layer.dispatcher.group) for layer in layers}
    if len(groups) != 1:
        raise ValueError("the ExpertParallelMoE layers of module use different process groups; "
                         "apply a placement to each group's layers separately")
    if len({layer.layer for layer in layers}) != len(layers):
        raise ValueError("two ExpertParallelMoE layers of module share a placement layer index; "
                         "give each layer its own `layer`")
    for layer in layers:
        if layer._pending is not None:
            layer._pending.wait()
    old = current_placement(module)
    new.validate()
    params = {layer.layer: [layer.experts.gate_up, layer.experts.down] for layer in layers}
    plan = plan_migration(old, new, topology,
                          expert_bytes=max(row_bytes(p, optimizer) for p in params.values()))
    migrator = Migrator(layers[0].dispatcher.group, timeout_s=timeout_s,
                        max_bytes_in_flight=max_bytes_in_flight)
    migration = migrator.start(plan, params, optimizer)
    for layer in layers:
        if layer.layer in plan.changed_layers:
            layer._pending = migration
            migration.on_commit(layer.layer, lambda index, layer=layer: layer._set_placement(
                plan.target, index))
    if blocking:
        try:
            migration.wait()
        finally:
            for layer in layers:
                layer._pending = None
    return migration


def _first_holder_rows(layer: ExpertParallelMoE) -> torch.Tensor:
    """Local slots whose expert has no replica on a lower global slot (each expert counted once)."""
    placement, index = layer.placement, layer.layer
    phy2log = placement.phy2log[index]
    first = np.full(placement.num_experts, -1, dtype=np.int64)
    first[phy2log[::-1]] = np.arange(phy2log.size)[::-1]
    lo = int(np.searchsorted(placement.slot_device, layer.dispatcher.rank))
    local = np.arange(lo, lo + layer.experts.num_slots)
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
        module: a model holding ExpertParallelMoE layers (one process group).
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
        rows = _first_holder_rows(layer)
        for p in (layer.experts.gate_up, layer.experts.down):
            slot_rows[id(p)] = rows
    grads, parts = [], []
    for p in module.parameters():
        if p.grad is None:
            continue
        grads.append(p.grad)
        if id(p) in slot_rows:
            g = p.grad.index_select(0, slot_rows[id(p)].to(p.grad.device))
        elif rank == 0:
            g = p.grad
        else:
            continue
        g = g.detach().double()
        parts.append(g.abs().max() if norm_type == float("inf") and g.numel() else g.pow(2).sum())
    device = grads[0].device if grads else torch.device("cpu")
    total = torch.stack(parts).to(device) if parts else torch.zeros(1, dtype=torch.float64, device=device)
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
    return norm
