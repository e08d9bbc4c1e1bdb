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
router's gradient is summed over the ranks (:mod:`moebalance.nn.grad_sync`); the gradients are
final when ``backward()`` returns. A live placement changes only through
:func:`apply_placement` (weights and optimizer state move with their rows, see
:mod:`moebalance.migrate.transfer`).

Legend: T tokens, D hidden size, F expert hidden size, E logical experts, K top-k, Ls slots on
this rank, M rows this rank's slots receive, R experts of the layer with more than one replica,
G ranks of the expert-parallel group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .._check import positive_int
from ..collective_errors import Attempt, take_backward_failure
from ..dispatch.dispatcher import Dispatcher
from ..frameworks import check_ddp
from ..placement import Placement
from .slots import (
    ExpertSlots,
    apply_placement,
    clip_grad_norm_,
    current_placement,
    moe_layers,
    reduce_replica_gradients,
)
from .transient import check_transient, transient_weights

__all__ = ["TopKRouter", "SlotExperts", "DenseMoE", "ExpertParallelMoE", "reduce_replica_gradients",
           "apply_placement", "current_placement", "moe_layers", "clip_grad_norm_"]

# torch.compile runs a function so decorated as it is (a graph break). torch.compiler.disable
# imports torch._dynamo where it decorates (about 1 s of CPU in every process that imports
# moebalance); torch's own lazy form, which its optimizers use, imports it at the first call.
compile_disabled = getattr(torch, "_disable_dynamo", torch.compiler.disable)


def _generator(seed: int, index: int) -> torch.Generator:
    """A CPU generator for parameter block ``index`` (0: router, e + 1: expert e) of ``seed``.

    Each logical expert's initial weights depend on (seed, expert) alone, so all its replicas,
    on any rank, start identical, and a DenseMoE with the same seed holds the same experts.
    """
    gen = torch.Generator()
    gen.manual_seed((int(seed) * 1_000_003 + int(index)) % (1 << 63))
    return gen


def _uniform_(param: torch.Tensor, bound: float, gen: torch.Generator) -> None:
    # on the CPU generator's device, whatever default device is set (Lightning's configure_model)
    values = torch.rand(param.shape, generator=gen, dtype=torch.float64, device="cpu")
    values = values * (2 * bound) - bound
    with torch.no_grad():
        param.copy_(values.to(dtype=param.dtype, device=param.device))


def _draw_seed() -> int:
    """A seed from torch's global generator (so layers built in turn differ)."""
    return int(torch.randint(0, 1 << 62, (1,), device="cpu").item())


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
        self.hidden_dim = positive_int(hidden_size, "hidden_size")
        self.num_experts = positive_int(num_experts, "num_experts")
        self.top_k = positive_int(top_k, "top_k")
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
        self.num_slots = positive_int(num_slots, "num_slots")
        self.hidden_dim = positive_int(hidden_size, "hidden_size")
        self.ffn_dim = positive_int(ffn_hidden_size, "ffn_hidden_size")
        self.gate_up = nn.Parameter(torch.empty(self.num_slots, 2 * self.ffn_dim, self.hidden_dim))
        self.down = nn.Parameter(torch.empty(self.num_slots, self.hidden_dim, self.ffn_dim))

    def init_slot(self, slot: int, seed: int, expert: int) -> None:
        """Initialise ``slot`` with logical expert ``expert``'s weights for ``seed``."""
        gen = _generator(seed, expert + 1)
        _uniform_(self.gate_up[slot], self.hidden_dim ** -0.5, gen)
        _uniform_(self.down[slot], self.ffn_dim ** -0.5, gen)

    # The grouped GEMM path runs where torch has it for the rows' dtype; False forces the loop.
    use_grouped_mm = True

    def forward(self, x_MD: torch.Tensor, tokens_per_slot, lent=None) -> torch.Tensor:
        """Apply slot i to its contiguous rows.

        Args:
            x_MD: [M, D], rows grouped by slot.
            tokens_per_slot: [slots] ints summing to M, rows of each slot (host ints, or an
                integer tensor on x's device).
            lent: this step's transient slots (:mod:`moebalance.nn.transient`), a pair
                ``(gate_up [K, 2F, D], down [K, D, F])`` whose rows follow the slots' own:
                ``tokens_per_slot`` then holds ``slots + K`` host ints.

        Returns:
            y_MD: [M, D].

        Two paths compute the same function: one ``torch._grouped_mm`` per projection over all
        slots (:func:`grouped_swiglu`) where it runs, else the loop over slots
        (:func:`looped_swiglu`, the reference the tests compare against).
        """
        if lent is not None:
            own = sum(tokens_per_slot[:self.num_slots])
            return torch.cat([self._own_slots(x_MD[:own], tokens_per_slot[:self.num_slots]),
                              looped_swiglu(x_MD[own:], *lent, tokens_per_slot[self.num_slots:])])
        return self._own_slots(x_MD, tokens_per_slot)

    def _own_slots(self, x_MD: torch.Tensor, tokens_per_slot) -> torch.Tensor:
        # rows and weights of one dtype: _grouped_mm is not cast by autocast (bf16 rows, fp32
        # weights), where the loop's matmuls are
        if (self.use_grouped_mm and self.gate_up.dtype == self.down.dtype == x_MD.dtype
                and grouped_mm_runs(x_MD, self.ffn_dim)):
            return grouped_swiglu(x_MD, self.gate_up, self.down, tokens_per_slot)
        if isinstance(tokens_per_slot, torch.Tensor):
            tokens_per_slot = tokens_per_slot.tolist()
        return looped_swiglu(x_MD, self.gate_up, self.down, tokens_per_slot)


def looped_swiglu(x_MD: torch.Tensor, gate_up_L2FD: torch.Tensor, down_LDF: torch.Tensor,
                  tokens_per_slot) -> torch.Tensor:
    """Slot l's SwiGLU on its contiguous rows, one slot at a time (the reference).

    Args: x_MD [M, D] rows grouped by slot; gate_up_L2FD [Ls, 2F, D]; down_LDF [Ls, D, F];
    tokens_per_slot [Ls] host ints summing to M. Returns y_MD [M, D].
    """
    # Empty slots still run (on zero rows) so that the output always depends on the
    # parameters: every rank then joins the backward exchanges, even one that got no rows.
    chunks = torch.split(x_MD, list(tokens_per_slot))
    return torch.cat([swiglu(rows, gate_up_L2FD[s], down_LDF[s]) for s, rows in enumerate(chunks)])


def grouped_mm_runs(x_MD: torch.Tensor, ffn_dim: int) -> bool:
    """Whether :func:`grouped_swiglu` runs for rows like ``x_MD`` and expert hidden size F:
    torch has ``_grouped_mm``, takes the dtype there (float32 and bfloat16 on the CPU;
    bfloat16 on a CUDA GPU of compute capability 9.0 or later), and rows of D and of F
    elements are multiples of 16 bytes (its stride rule), and there is at least one row (its
    backward fails on none)."""
    if not hasattr(torch, "_grouped_mm") or x_MD.shape[0] == 0:
        return False
    size = x_MD.element_size()
    if (x_MD.shape[1] * size) % 16 or (ffn_dim * size) % 16 or not x_MD.is_contiguous():
        return False
    if x_MD.device.type == "cpu":
        return x_MD.dtype in (torch.float32, torch.bfloat16)
    if x_MD.device.type == "cuda":
        return (x_MD.dtype == torch.bfloat16
                and torch.cuda.get_device_capability(x_MD.device) >= (9, 0))
    return False


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient: ``_grouped_mm``'s backward
    rejects the stride-0 gradients that e.g. ``y.sum().backward()`` produces."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def grouped_swiglu(x_MD: torch.Tensor, gate_up_L2FD: torch.Tensor, down_LDF: torch.Tensor,
                   tokens_per_slot) -> torch.Tensor:
    """:func:`looped_swiglu` with one grouped GEMM per projection over all slots.

    Args: as :func:`looped_swiglu`; ``tokens_per_slot`` may also be an integer tensor on
    x's device (no host round trip).
    """
    if isinstance(tokens_per_slot, torch.Tensor):
        offs = torch.cumsum(tokens_per_slot.to(x_MD.device), 0).to(torch.int32)
    else:
        offs = torch.tensor(list(tokens_per_slot), dtype=torch.int32).cumsum(0, dtype=torch.int32)
        if x_MD.device.type != "cpu":
            # Pinned and non-blocking: a pageable host-to-device copy would stall the stream.
            offs = offs.pin_memory().to(x_MD.device, non_blocking=True)
    h_M2F = torch._grouped_mm(x_MD, gate_up_L2FD.transpose(1, 2), offs=offs)
    gate, up = _ContiguousGrad.apply(h_M2F).chunk(2, dim=-1)
    y_MD = torch._grouped_mm(F.silu(gate) * up, down_LDF.transpose(1, 2), offs=offs)
    return _ContiguousGrad.apply(y_MD)


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
            raise ValueError(f"hidden_states must have shape [..., {D}], got "
                             f"{tuple(hidden_states.shape)}")
        x_TD = hidden_states.reshape(-1, D)
        _, topk_weights, topk_ids = self.router(x_TD)
        out = torch.zeros_like(x_TD)
        for e in range(self.num_experts):
            token, k = torch.where(topk_ids == e)
            y = swiglu(x_TD[token], self.experts.gate_up[e], self.experts.down[e])
            out = out.index_add(0, token, y * topk_weights[token, k].unsqueeze(1))
        return out.reshape(hidden_states.shape)


class ExpertParallelMoE(ExpertSlots):
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
            node of each rank, to keep tokens on their node; resplit, speeds: re-split each
            step's tokens over the existing replicas by the devices' speeds (on by default;
            the math is the same either way); see
            :class:`~moebalance.dispatch.Dispatcher`.
        grad_sync: "backward" (default): replica and router gradients are reduced during
            backward and are final when ``backward()`` returns (before gradient clipping);
            "manual": call :func:`reduce_replica_gradients` after backward.
        transient, transient_cost: transient slots per rank: each step, a hot expert's weights
            may be lent for that step to a cold rank, which serves part of its tokens (the
            gradient returns to the expert's holders when backward ends; the math and the
            optimizer state are unchanged; needs ``grad_sync="backward"``). 0 (default): none.
            ``transient_cost``: a copy's price in routed pairs of expert work at speed 1 (None:
            a rough estimate); see :mod:`moebalance.nn.transient`.
        sync_router: sum the router's gradient over the group (it is replicated on every rank).
            False when something else reduces it. Under a DDP that wraps the layer or a model
            holding it, DDP averages the router and the expert gradients are averaged too
            (divided by G, DDP's mean), whatever this says.

    Attributes (read-only; a live placement changes only through :meth:`apply_placement`):
    ``placement``, ``layer``, ``local_experts`` ([Ls] int64, logical expert of each local slot).
    Also ``router``; ``experts`` (:class:`SlotExperts`, ``gate_up [Ls, 2F, D]``,
    ``down [Ls, D, F]``); ``dispatcher`` (:class:`~moebalance.dispatch.Dispatcher`).

    DDP: the layer lists its slot tensors in ``_ddp_params_and_buffers_to_ignore``, so a DDP
    that wraps the layer leaves them alone; a DDP that wraps a model *holding* the layer needs
    :func:`moebalance.exclude_experts_from_ddp` on that model first (the first forward raises
    otherwise: DDP would have copied rank 0's slot rows over every rank's).

    Checkpoints: ``state_dict()`` holds this rank's slot rows and, as extra state, the layer's
    placement row, so a per-rank checkpoint resumes the placement it was saved under. To load
    into another placement or world size (or a :class:`DenseMoE`), save by logical expert with
    :mod:`moebalance.nn.checkpoint`.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_experts: int, top_k: int,
                 placement: Placement, layer: int = 0, group=None, router: nn.Module | None = None,
                 *, norm_topk_prob: bool = True, seed: int | None = None,
                 exchange: str = "auto", nodes=None, grad_sync: str = "backward",
                 sync_router: bool = True, resplit: bool = True, speeds=None,
                 transient: int = 0, transient_cost: float | None = None) -> None:
        super().__init__()
        self.hidden_dim = positive_int(hidden_size, "hidden_size")
        self.ffn_dim = positive_int(ffn_hidden_size, "ffn_hidden_size")
        self.num_experts = positive_int(num_experts, "num_experts")
        self.top_k = positive_int(top_k, "top_k")
        self._check_placement(placement, layer, self.num_experts)
        self.dispatcher = Dispatcher(group, exchange=exchange, nodes=nodes, resplit=resplit,
                                     speeds=speeds, transient=transient,
                                     transient_cost=transient_cost)
        check_transient(self.dispatcher.transient, self.dispatcher.world_size, grad_sync, 2)
        if router is None:
            router = TopKRouter(hidden_size, num_experts, top_k, norm_topk_prob)
        elif not isinstance(router, nn.Module):
            raise TypeError(f"router must be a torch.nn.Module returning (router_logits, "
                            f"topk_weights, topk_ids), got {type(router).__name__}")
        self.router = router
        local = self.dispatcher.local_slots(placement, layer)
        self.experts = SlotExperts(len(local), hidden_size, ffn_hidden_size)
        self.sync_router = bool(sync_router)
        self._init_slots(placement, layer, grad_sync=grad_sync,
                         group_params=list(self.router.parameters()) if self.sync_router else ())
        self.reset_parameters(seed)

    def named_slot_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [("experts.gate_up", self.experts.gate_up), ("experts.down", self.experts.down)]

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
            raise TypeError("dense must be a moebalance.nn.moe.DenseMoE, got "
                            f"{type(dense).__name__}")
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

    # -- forward --------------------------------------------------------------------------------

    # torch.compile runs the layer as it is (a graph break) and compiles the model around it:
    # its step exchanges counts and rows with the group, plans routes on the host or in
    # Numba/CuPy kernels, and its grouped GEMM has no fake-tensor form for float32 on CPUs.
    @compile_disabled
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``hidden_states [..., D]`` (this rank's tokens) -> ``[..., D]``.

        An exception on one rank anywhere in the step (commit of a migrated layer, input
        checks, router, experts) is raised on every rank of the group as the same
        :class:`~moebalance.collective_errors.GroupError`: the router's part travels with the
        dispatch's count exchange, the experts' part with the combine's agreement.
        """
        before = Attempt(f"ExpertParallelMoE.forward of layer {self.layer} (router)")
        x_TD = topk_weights = topk_ids = None
        # A failure of this rank's last backward that no collective has reported yet.
        left = take_backward_failure(self.dispatcher.group)
        if left is not None:
            before.fail(left)
        with before.run():
            self._commit_pending()
            self._follow_ddp()
            if not isinstance(hidden_states, torch.Tensor) or \
                    hidden_states.shape[-1:] != (self.hidden_dim,):
                raise ValueError(f"hidden_states must be a tensor of shape "
                                 f"[..., {self.hidden_dim}], got "
                                 f"{tuple(getattr(hidden_states, 'shape', ()))}")
            x_TD = hidden_states.reshape(-1, self.hidden_dim)
            _, topk_weights, topk_ids = self.router(x_TD)
        recv_MD, handle = self.dispatcher.dispatch(x_TD, topk_ids, topk_weights, self.placement,
                                                   self.layer, attempt=before)
        experts = Attempt(f"ExpertParallelMoE.forward of layer {self.layer} (experts)")
        y_MD = None
        timer = self.expert_timer           # a SpeedTracker's, when one times this layer
        with experts.run():
            if timer is not None:
                recv_MD = timer.begin(recv_MD)
            lent = None if handle.transient is None else \
                transient_weights(self, handle.transient)
            y_MD = self.experts(recv_MD, handle.tokens_per_local_slot, lent)
            if timer is not None:
                y_MD = timer.end(y_MD)
        out_TD = self.dispatcher.combine(y_MD, handle, attempt=experts)
        return out_TD.reshape(hidden_states.shape)

    # -- gradient sync --------------------------------------------------------------------------

    def _follow_ddp(self) -> None:
        """Under a DDP (checked to leave the slots alone) the router is DDP's to average, and
        the expert gradients follow DDP's mean over the ranks; without one, this layer sums."""
        ddp = check_ddp(self, self.dispatcher.group)
        if self._sync is not None:
            self._sync.group_enabled = ddp is None
            self._sync.scale = 1.0 / self.dispatcher.world_size if ddp is not None else 1.0

    def reduce_replica_gradients(self, include_router: bool = True) -> None:
        """Reduce this layer's gradients now; see :func:`reduce_replica_gradients`."""
        reduce_replica_gradients(self, include_router=include_router)
