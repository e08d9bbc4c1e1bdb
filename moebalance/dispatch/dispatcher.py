"""Dispatcher: send every routed token to one replica of its expert and bring the results back.

One :class:`Dispatcher` owns the communication of an expert-parallel group. ``dispatch`` returns
the rows this rank's expert slots must process and a :class:`DispatchHandle`; ``combine`` takes
the slots' outputs and that handle and returns the weighted sum per token::

    recv_x_MD, handle = dispatcher.dispatch(x_TD, topk_ids_TK, topk_weights_TK, placement, layer)
    y_MD = experts(recv_x_MD, handle.tokens_per_local_slot)     # rows grouped by local slot
    out_TD = dispatcher.combine(y_MD, handle)

Steps of ``dispatch`` (kernels from :func:`moebalance.dispatch.kernels.kernels_for`):

1. count: this rank's pairs per expert (a counting sort by expert, which also gives each pair's
   place among its expert's pairs), exchanged across the group in one small collective on the
   rows' device: every rank then holds ``counts_GE``, with a flag per rank for bad input.
2. shares: this step's re-split over the existing replicas (:mod:`.shares`: one kernel call
   on the counts' device, for layers where some expert has two or more replicas), from
   ``counts_GE`` and the devices' speeds; with ``resplit=False``, the placement's.
3. route: every rank computes the same flow table from ``counts_GE`` (:mod:`.routing`): each
   replica receives its share of the expert's pairs over the whole group, to within one pair,
   own device first, then the node, then the rest; a pair goes to the replica its place
   among its expert's pairs falls in.
4. permute + exchange: rows ``x[t]`` are gathered into *sorted* order (destination rank, then
   its local slot) and delivered in *slot-major* order (local slot, then source rank), by one
   of the row exchanges of :mod:`.exchange` (``Dispatcher(exchange=...)``).

``combine`` runs these backwards and ends with ``out[t] = sum_k w[t, k] * y[pair (t, k)]``; the
exchanges only move rows, so every exchange gives bit-identical outputs and gradients.

Host syncs: one per dispatch, the ``.tolist()`` of the split sizes and rows per local slot (the
row exchange and the expert GEMMs need host ints), which follow from the flow table, with the
bad-input flags of every rank. Expert ids outside ``[0, E)``, wrong shapes, dtypes or devices of
the inputs, and any exception of the caller's own work before the dispatch (an
:class:`~moebalance.collective_errors.Attempt` passed in, e.g. the MoE layer's router) are
reported through the count exchange, so every rank of the group raises the same
:class:`~moebalance.collective_errors.GroupError` instead of leaving the others waiting in a
collective. ``combine`` agrees on its inputs (and on the caller's work between the two, e.g. the
experts) with one all-reduce of one int before its exchange.

Autograd: see :mod:`.autograd`; ``x.requires_grad`` must agree across the ranks of the group
(it does when all ranks run the same model). Buffers: see :mod:`.buffers`. A Dispatcher is
used by one thread at a time, like the collectives of its group.

Legend: T tokens on this rank, K top-k, D hidden size, E logical experts, X most replicas of an
expert, S global slots, G ranks of the group, Ls slots of this rank, N = T*K routed pairs,
M rows received by this rank (pairs routed to its slots), N' nodes, C = E + the step's flags
(columns of the count exchange).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch
import torch.distributed as dist

from .._check import index, integer
from ..collective_errors import Attempt, GroupValueError, agree, flag_device, raise_failures
from ..placement import Placement
from .autograd import CombineRows, DispatchRows
from .buffers import release_buffers
from .checks import FLOAT_DTYPES
from .exchange import EXCHANGES, AllToAll, LocalRows, PointToPoint, RowExchange, auto_exchange
from .kernels import kernels_for
from .routing import ReplicaTable, replica_flows, replica_table
from .shares import ResplitPlan, resplit_plan, resplit_shares
from .transient import TransientRouting, TransientStep, default_transient_cost

__all__ = ["Dispatcher", "DispatchHandle", "EXCHANGES", "release_buffers"]

# The flat all-gather is all_gather_single from torch 2.13 on (all_gather_into_tensor, its
# older name, now warns).
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
# Placements whose tables are kept (the current one, the one being migrated to, spares).
_CACHED_PLACEMENTS = 4
# Columns of each rank's row in the count exchange after its E counts: expert ids out of range,
# malformed inputs, and the width D and dtype of its rows (which every rank must share).
_BAD_IDS, _BAD_INPUT, _WIDTH, _DTYPE = 0, 1, 2, 3
_FLAGS = 4


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
        kernels: the kernel module the dispatch ran with (combine uses the same).
        counts_GE: [G, E] int64 (rows' device), pairs of every (rank, expert) of this dispatch.
        share_EX: [E, X] float64 (rows' device), the shares the pairs were routed by.
        placement, layer, rank: what the rows were routed by.
        transient: the step's transient copies (:class:`~.transient.TransientStep`), None
            when it made none; with copies, ``tokens_per_local_slot`` ends with this rank's K
            transient slots.
    """

    tokens_per_local_slot: list
    order_N: torch.Tensor
    pos_TK: torch.Tensor
    topk_weights_TK: torch.Tensor
    exchange: RowExchange
    kernels: ModuleType
    counts_GE: torch.Tensor
    share_EX: torch.Tensor
    placement: Placement
    layer: int
    rank: int
    transient: TransientStep | None = None

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


_DTYPE_CODES = FLOAT_DTYPES


def _dtype_code(dtype: torch.dtype) -> int:
    """The index of ``dtype`` in the float dtypes the kernels take (-1 for any other)."""
    return _DTYPE_CODES.index(dtype) if dtype in _DTYPE_CODES else -1


class _LayerState:
    """One layer of one placement on one device: its replica table, this rank's local slots as
    (expert, replica column) and, with re-split, its :class:`ResplitPlan`."""

    def __init__(self, table: ReplicaTable, first_slot: int, num_local: int,
                 plan: ResplitPlan | None) -> None:
        self.table = table
        slots = table.slots_EX.cpu().numpy()
        local = np.arange(first_slot, first_slot + num_local)
        e, j = np.nonzero((slots[..., None] == local).any(-1))
        # Order the (expert, column) pairs by local slot.
        which = slots[e, j] - first_slot
        order = np.argsort(which)
        device = table.slots_EX.device
        self.local_e = torch.from_numpy(e[order]).to(device)
        self.local_j = torch.from_numpy(j[order]).to(device)
        self.plan = plan
        self.transient: TransientRouting | None = None


class _PlacementState:
    """Host facts about one placement, checked once, and its per-(layer, device) state."""

    def __init__(self, placement: Placement, rank: int, world_size: int, speeds) -> None:
        placement.validate()
        self.placement = placement  # strong reference: the cache key id() cannot be reused
        self.rank = rank
        self.speeds = speeds
        slots_per_rank = np.bincount(placement.slot_device, minlength=world_size)
        self.slot_offsets = np.concatenate([[0], np.cumsum(slots_per_rank)]).astype(np.int64)
        self.slots_per_rank = slots_per_rank.tolist()
        self.num_local_slots = int(slots_per_rank[rank])
        self._layers: dict = {}

    def layer(self, layer: int, device: torch.device) -> _LayerState:
        key = (layer, device)
        state = self._layers.get(key)
        if state is None:
            table = replica_table(self.placement, layer, device)
            plan = None if self.speeds is None else resplit_plan(table, self.speeds, device)
            state = _LayerState(table, int(self.slot_offsets[self.rank]), self.num_local_slots,
                                plan)
            self._layers[key] = state
        return state


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
        resplit: re-split each step's pairs over the existing replicas so that the slowest
            device of the layer finishes as early as those replicas allow (:mod:`.shares`),
            instead of using the placement's shares. On by default; it changes which replica
            serves a pair, never the math. False: the placement's shares.
        speeds: the relative speed of each rank's device (e.g. ``topology.speed``), used by the
            re-split; None: equal speeds.
        debug: also check, with host syncs, that ``x`` and ``topk_weights`` are finite before
            any communication (the check of expert ids always runs, through the counts exchange).
        transient: transient slots per rank (:mod:`.transient`): each step, a hot expert's
            weights may be copied for that step to a cold rank, which then serves part of its
            pairs; 0 (default): none. Needs ``resplit``. The copies are chosen on the host from
            the exchanged counts: on GPUs that is one more host sync per dispatch. The caller
            runs the copies' rows (:mod:`moebalance.nn.transient` moves weights and gradients).
        transient_cost: the price of one copy in pairs of expert work at speed 1 (a copy is made
            only where it saves more); None: :func:`~.transient.default_transient_cost` for the
            rows' dtype and device.

    Per-placement tables are built on first use and cached by placement identity; a new
    :class:`~moebalance.Placement` object gets new tables (the last few are kept).
    """

    def __init__(self, group=None, *, exchange: str = "auto", nodes=None, resplit: bool = True,
                 speeds=None, debug: bool = False, transient: int = 0,
                 transient_cost: float | None = None) -> None:
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
            # per device type ("cpu:gloo,cuda:nccl"): get_backend says "undefined" for a group
            # that init_process_group() made without a backend name
            self._backend = str(dist.get_backend_config(group))
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
        if not isinstance(resplit, bool):
            raise TypeError(f"resplit must be True or False, got {resplit!r}")
        self.resplit = resplit
        self.speeds = self._checked_speeds(speeds)
        self.debug = bool(debug)
        self.transient = integer(transient, "transient", minimum=0)
        if self.transient and not resplit:
            raise ValueError("transient slots need the per-step re-split: pass resplit=True, or "
                             "transient=0")
        if transient_cost is not None:
            transient_cost = float(transient_cost)
            if not np.isfinite(transient_cost) or transient_cost < 0:
                raise ValueError(f"transient_cost must be a finite number of pairs >= 0, got "
                                 f"{transient_cost}; or None for the default estimate")
        self.transient_cost = transient_cost
        self._states: OrderedDict[int, _PlacementState] = OrderedDict()
        self._on_node: dict = {}

    def _checked_speeds(self, speeds) -> tuple[float, ...] | None:
        if speeds is None:
            return None
        speeds = np.asarray(speeds, dtype=np.float64)
        if speeds.shape != (self.world_size,) or not np.all(np.isfinite(speeds)) \
                or not np.all(speeds > 0):
            raise ValueError(f"speeds must give a finite speed > 0 for each of the "
                             f"{self.world_size} ranks of the group (e.g. topology.speed), "
                             f"got {speeds.tolist()!r}; or pass None for equal speeds")
        return tuple(float(s) for s in speeds)

    def set_speeds(self, speeds) -> None:
        """Re-split by ``speeds`` ([G] relative speed of each rank, e.g. a measured topology's
        ``speed``; None: equal) from the next dispatch on.

        Every rank of the group must call it with the same speeds before the same step (the
        re-split is computed on every rank from the same counts; ranks with different speeds
        would route the same pair to different replicas): use
        :func:`moebalance.nn.slots.set_device_speeds`, which the Rebalancer calls when it
        adopts measured speeds. Cached per-placement tables are rebuilt on next use.
        """
        speeds = self._checked_speeds(speeds)
        if speeds != self.speeds:
            self.speeds = speeds
            self._states.clear()

    def __repr__(self) -> str:
        return (f"Dispatcher(rank={self.rank}, world_size={self.world_size}, "
                f"exchange={self.exchange!r}, resplit={self.resplit}, debug={self.debug})")

    def exchange_for(self, device_type: str) -> str:
        """The exchange rows on ``device_type`` ("cpu", "cuda") use: "p2p" or "all_to_all",
        or "local" in a single process (no exchange)."""
        if self.world_size == 1:
            return "local"
        if self.exchange != "auto":
            return self.exchange
        return auto_exchange(self._backend, device_type)

    # -- placement state ---------------------------------------------------------------------

    def _state(self, placement, layer) -> _PlacementState:
        if not isinstance(placement, Placement):
            raise TypeError("placement must be a moebalance.Placement, got "
                            f"{type(placement).__name__}")
        state = self._states.get(id(placement))
        if state is None or state.placement is not placement:
            if placement.num_devices != self.world_size:
                raise ValueError(
                    f"placement spans {placement.num_devices} devices but the process group has "
                    f"{self.world_size} ranks; plan for a topology of {self.world_size} devices "
                    f"(one per rank)")
            speeds = None
            if self.resplit:
                speeds = self.speeds if self.speeds is not None else (1.0,) * self.world_size
            state = _PlacementState(placement, self.rank, self.world_size, speeds)
            self._states[id(placement)] = state
            while len(self._states) > _CACHED_PLACEMENTS:
                self._states.popitem(last=False)
        else:
            self._states.move_to_end(id(placement))
        index(layer, "layer", placement.num_layers)
        return state

    def local_slots(self, placement: Placement, layer: int = 0) -> range:
        """The global slot ids this rank owns under ``placement`` (checks it and ``layer``)."""
        state = self._state(placement, layer)
        return range(int(state.slot_offsets[self.rank]), int(state.slot_offsets[self.rank + 1]))

    def _node_masks(self, device: torch.device) -> torch.Tensor | None:
        """[N', G] bool (on ``device``): which ranks sit on each node; None without nodes."""
        if self.nodes is None:
            return None
        masks = self._on_node.get(device)
        if masks is None:
            nodes = np.asarray(self.nodes)
            masks = torch.from_numpy(nodes[None] == np.unique(nodes)[:, None]).to(device)
            self._on_node[device] = masks
        return masks

    # -- input checks --------------------------------------------------------------------------

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
                             f"{tuple(topk_ids_TK.shape)}, got shape "
                             f"{tuple(topk_weights_TK.shape)} and dtype {topk_weights_TK.dtype}")
        for name, value in (("topk_ids_TK", topk_ids_TK), ("topk_weights_TK", topk_weights_TK)):
            if value.device != x_TD.device:
                raise ValueError(f"{name} is on {value.device} but x_TD is on {x_TD.device}; "
                                 f"move them to one device")
        if self.debug:
            if not bool(torch.isfinite(x_TD).all()):
                raise ValueError("x_TD holds NaN or inf values")
            if not bool(torch.isfinite(topk_weights_TK).all()):
                raise ValueError("topk_weights_TK holds NaN or inf values")

    def _exchange_device(self, x_TD) -> torch.device:
        """Where the count exchange runs: the rows' device, or (rows not even a tensor) the one
        the group's backend needs."""
        if isinstance(x_TD, torch.Tensor):
            return x_TD.device
        if self._backend is None:
            return torch.device("cpu")
        return flag_device(self.group)

    def _gather_rows(self, row: torch.Tensor) -> torch.Tensor:
        """[G, E + 2] int64: every rank's row of the count exchange (one all-gather)."""
        if self.world_size == 1:
            return row.view(1, -1)
        rows = row.new_empty(self.world_size * row.shape[0])
        try:
            _all_gather_flat(rows, row, group=self.group)
        except RuntimeError as exc:
            said = str(exc).lower()
            if "timed out" not in said and "timeout" not in said:
                raise
            # The first collective of a layer's step: a rank alone here is most often a forward
            # that only some ranks run (a sample generated under `if rank == 0`).
            raise RuntimeError(
                f"the count exchange of an expert-parallel MoE layer timed out on rank "
                f"{dist.get_rank(self.group)}: other ranks of the group did not run this forward. "
                f"Every rank must run every forward of an expert-parallel model, since each "
                f"layer's experts live on all of them; run it (or model.generate) on every rank, "
                f"each with its own inputs, not under `if rank == 0`") from exc
        return rows.view(self.world_size, -1)

    # -- dispatch ------------------------------------------------------------------------------

    def dispatch(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                 placement: Placement, layer: int, *, attempt: Attempt | None = None):
        """Send each routed pair's token row to one replica of its expert.

        Args:
            x_TD: [T, D] float, this rank's tokens (T may be 0).
            topk_ids_TK: [T, K] integer, logical expert of each pair, in [0, E).
            topk_weights_TK: [T, K] float, weight of each pair (kept for :meth:`combine`).
            placement: the current placement; ``placement.num_devices`` must equal the group size.
            layer: index of this MoE layer in the placement.
            attempt: the caller's local work before this dispatch (e.g. its router); if it
                failed, this rank joins the count exchange with a flag and every rank raises
                the same :class:`~moebalance.collective_errors.GroupError`.

        Returns:
            recv_x_MD: [M, D], the rows this rank's slots process, grouped by local slot.
            handle: :class:`DispatchHandle` for :meth:`combine`.

        Raises:
            GroupValueError / GroupTypeError / GroupError: on every rank, when any rank's inputs
            (or ``attempt``) failed; the text names the ranks and their messages.
        """
        state = self._state(placement, layer)
        E, S, G = placement.num_experts, placement.num_slots, self.world_size
        if attempt is None:
            attempt = Attempt(f"dispatch of layer {layer}")
        if not attempt.failed:
            with attempt.run():
                self._check_inputs(x_TD, topk_ids_TK, topk_weights_TK)
                layer_state = state.layer(int(layer), x_TD.device)
        if attempt.failed:
            self._join_failed(attempt, E, self._exchange_device(x_TD))

        device = x_TD.device
        kernels = kernels_for(device.type)
        table = layer_state.table
        ids_TK = topk_ids_TK.to(torch.int64)
        # Out-of-range ids are clamped for routing and reported after the count exchange, so
        # that every rank raises together (no host sync here, no rank left in a collective).
        bad = ((ids_TK < 0) | (ids_TK >= E)).sum().view(1)
        ids_TK = ids_TK.clamp(0, E - 1).contiguous()
        _, place_TK, counts_E = kernels.sort_by_slot(ids_TK, E)
        # Flags filled on the device (a host tensor copied over would sync the stream).
        flags = counts_E.new_zeros(_FLAGS)
        flags[_BAD_IDS:_BAD_IDS + 1] = bad
        flags[_WIDTH] = x_TD.shape[1]
        flags[_DTYPE] = _dtype_code(x_TD.dtype)
        rows_GC = self._gather_rows(torch.cat([counts_E, flags]))
        counts_GE = rows_GC[:, :E]
        slots_EX, device_EX, slot_offsets = table.slots_EX, table.device_EX, state.slot_offsets
        step = None
        if self.transient and G > 1:
            routing = self._transient_routing(state, layer_state, x_TD)
            # Chosen on the host from every rank's counts: the one extra host sync of a
            # dispatch with transient slots (none on the CPU).
            step, slots, devices, shares = routing.choose(counts_GE.cpu().numpy())
            share_EX = torch.from_numpy(shares).to(device)
            if step is not None:
                slots_EX, device_EX = (torch.from_numpy(a).to(device) for a in (slots, devices))
                slot_offsets, S = routing.slot_offsets, routing.num_global_slots
        elif layer_state.plan is not None and layer_state.plan.order_V.numel() > 0:
            share_EX = resplit_shares(counts_GE.sum(dim=0), table.share_EX, layer_state.plan)
        else:
            share_EX = table.share_EX
        flow_GEX = replica_flows(counts_GE, share_EX, device_EX, self._node_masks(device))
        bounds_EX = torch.cumsum(flow_GEX[self.rank], dim=1)
        rank_TK = place_TK - (torch.cumsum(counts_E, 0) - counts_E)[ids_TK]
        slot_TK = kernels.route(ids_TK, rank_TK, slots_EX, bounds_EX)
        order_N, pos_TK, counts_S = kernels.sort_by_slot(slot_TK, S)
        recv_GL = flow_GEX[:, layer_state.local_e, layer_state.local_j]
        if step is not None:
            recv_GL = torch.cat([recv_GL, self._transient_rows(step, flow_GEX)], dim=1)
        # The one host sync of the per-step path.
        host = np.asarray(torch.cat([counts_S, recv_GL.reshape(-1), rows_GC[:, E:].reshape(-1)])
                          .tolist(), dtype=np.int64)
        self._raise_on_flags(host[S + recv_GL.numel():].reshape(G, _FLAGS), E, attempt)
        counts_S_host = host[:S]
        recv_GL_host = host[S:S + recv_GL.numel()].reshape(G, -1)

        if G == 1:
            rows = LocalRows(order_N.shape[0], order_N.shape[0])
        elif self.exchange_for(device.type) == "p2p":
            rows = PointToPoint.build(self.group, self.rank, slot_offsets, counts_S_host,
                                      recv_GL_host)
        else:
            rows = AllToAll.build(self.group, slot_offsets, counts_S_host, recv_GL_host, recv_GL)
        token_N = order_N // ids_TK.shape[1]
        recv_x_MD = DispatchRows.apply(x_TD.contiguous(), token_N, pos_TK, rows, kernels)
        handle = DispatchHandle(
            tokens_per_local_slot=recv_GL_host.sum(axis=0).tolist(), order_N=order_N,
            pos_TK=pos_TK, topk_weights_TK=topk_weights_TK.contiguous(), exchange=rows,
            kernels=kernels, counts_GE=counts_GE, share_EX=share_EX, placement=placement,
            layer=int(layer), rank=self.rank, transient=step)
        return recv_x_MD, handle

    def _transient_routing(self, state: _PlacementState, layer_state: _LayerState,
                           x_TD: torch.Tensor) -> TransientRouting:
        routing = layer_state.transient
        if routing is None:
            table = layer_state.table
            G = self.world_size
            cost = self.transient_cost
            if cost is None:
                cost = default_transient_cost(x_TD.dtype, x_TD.device.type)
            routing = TransientRouting(
                *(t.cpu().numpy() for t in (table.slots_EX, table.device_EX, table.share_EX)),
                state.slot_offsets, self.transient, state.speeds,
                self.nodes if self.nodes is not None else (0,) * G, cost)
            layer_state.transient = routing
        return routing

    def _transient_rows(self, step: TransientStep, flow_GEX: torch.Tensor) -> torch.Tensor:
        """[G, K] rows every rank sends to each of this rank's transient slots."""
        G = flow_GEX.shape[0]
        rows_GK = flow_GEX.new_zeros((G, step.num_slots))
        for (expert, _, target), k, column in zip(step.copies_C3.tolist(), step.slot_C.tolist(),
                                                  step.column_C.tolist()):
            if target == self.rank:
                rows_GK[:, k] = flow_GEX[:, expert, column]
        return rows_GK

    def abort(self, error: BaseException, placement: Placement, layer: int, *,
              device: torch.device | str | None = None):
        """Raise the same :class:`~moebalance.collective_errors.GroupError` (carrying
        ``error``'s text) on every rank of the group; ``error`` itself in a single process.

        For a rank that cannot dispatch (bad input found before ``dispatch``): it joins the
        count exchange the other ranks are in, with a flag, so that they raise instead of
        waiting for it until the process group's timeout. (Passing ``attempt=`` to
        :meth:`dispatch` does the same for any exception of a block of code.)

        Args:
            error: the exception this rank hit.
            placement, layer: those of the dispatch the other ranks are running.
            device: where the count exchange runs (the rows' device; default CPU, or the
                current CUDA device on an NCCL group).
        """
        if not isinstance(error, BaseException):
            raise TypeError(f"error must be an exception, got {type(error).__name__}")
        attempt = Attempt(f"dispatch of layer {layer}")
        attempt.fail(error)
        E = self._state(placement, layer).placement.num_experts
        self._join_failed(attempt, E, self._exchange_device(None) if device is None else device)

    def _join_failed(self, attempt: Attempt, num_experts: int, device) -> None:
        """This rank cannot dispatch: join the count exchange with the bad-input flag, then
        raise with every rank (:func:`~moebalance.collective_errors.raise_failures`)."""
        if self.world_size > 1:
            row = torch.zeros(num_experts + _FLAGS, dtype=torch.int64, device=device)
            row[num_experts + _BAD_INPUT] = 1
            self._gather_rows(row)
        raise_failures(attempt, self.group)

    def _raise_on_flags(self, flags_GF: np.ndarray, num_experts: int, attempt: Attempt) -> None:
        """Raise the same error on every rank if any rank flagged a failed attempt, expert ids
        out of range, or rows of another width or dtype than the others (``flags_GF`` [G, 4]
        host ints)."""
        if flags_GF[:, _BAD_INPUT].any():
            raise_failures(attempt, self.group)
        for column, what in ((_WIDTH, "width D"), (_DTYPE, "dtype")):
            values = flags_GF[:, column]
            if np.any(values != values[0]):
                shown = (values.tolist() if column == _WIDTH
                         else [str(_DTYPE_CODES[v]) if v >= 0 else "other" for v in values])
                raise GroupValueError(
                    f"the ranks of the group passed x_TD rows of different {what} (rank by "
                    f"rank: {shown}); every rank must dispatch rows of one width and dtype",
                    attempt.where, [(g, f"x_TD {what} {shown[g]}") for g in range(len(shown))
                                    if values[g] != values[0]])
        bad_per_rank = flags_GF[:, _BAD_IDS].tolist()
        if any(bad_per_rank):
            bad_ranks = [g for g, n in enumerate(bad_per_rank) if n]
            raise GroupValueError(
                f"topk_ids_TK holds {sum(bad_per_rank)} expert ids outside [0, {num_experts}) "
                f"(on rank(s) {bad_ranks}); the router and the placement must agree on the "
                f"number of experts; every rank of the group stops this dispatch",
                attempt.where, [(g, f"{n} expert ids out of range") for g, n in
                                enumerate(bad_per_rank) if n])

    # -- combine -------------------------------------------------------------------------------

    @staticmethod
    def _check_combine(y_MD, handle: DispatchHandle) -> None:
        if not isinstance(y_MD, torch.Tensor):
            raise TypeError(f"y_MD must be a torch.Tensor, got {type(y_MD).__name__}")
        M = handle.num_recv_rows
        if y_MD.dim() != 2 or y_MD.shape[0] != M or not y_MD.is_floating_point():
            raise ValueError(f"y_MD must be a float tensor of shape [M, D] with M={M} (rows "
                             f"returned by dispatch), got shape {tuple(y_MD.shape)} and dtype "
                             f"{y_MD.dtype}")
        if y_MD.device != handle.pos_TK.device:
            raise ValueError(f"y_MD is on {y_MD.device} but the dispatch ran on "
                             f"{handle.pos_TK.device}")

    def combine(self, y_MD: torch.Tensor, handle: DispatchHandle, *,
                attempt: Attempt | None = None) -> torch.Tensor:
        """Bring the slots' outputs back and sum each token's K results with its weights.

        Args:
            y_MD: [M, D'] float, one output row per row of the ``recv_x`` that ``dispatch``
                returned, in the same order (D' may differ from D; every rank's D' and dtype
                must agree).
            handle: the :class:`DispatchHandle` of that dispatch.
            attempt: the caller's local work since the dispatch (e.g. its experts); if it
                failed, every rank raises the same error here.

        Returns:
            out_TD': [T, D'] in y's dtype: ``out[t] = sum_k topk_weights[t, k] * y[row of (t, k)]``.

        Raises:
            GroupValueError / GroupTypeError / GroupError: on every rank of the group, when any
            rank's ``y_MD`` is malformed or its ``attempt`` failed. Agreeing costs one
            all-reduce of one int (the row exchange cannot carry a flag without copying every
            row), on the CPU where the backend takes CPU tensors.
        """
        if not isinstance(handle, DispatchHandle):
            raise TypeError(f"handle must be the DispatchHandle returned by dispatch(), got "
                            f"{type(handle).__name__}")
        if attempt is None:
            attempt = Attempt(f"combine of layer {handle.layer}")
        with attempt.run():
            self._check_combine(y_MD, handle)
        if handle.exchange_kind != "local":
            ok = isinstance(y_MD, torch.Tensor) and y_MD.dim() == 2
            agree(attempt, self.group, same={
                "width D' of y_MD": y_MD.shape[1] if ok else -1,
                "dtype of y_MD": _dtype_code(y_MD.dtype) if ok else -1})
        elif attempt.failed:
            raise attempt.error
        K = handle.pos_TK.shape[1]
        return CombineRows.apply(y_MD.contiguous(), handle.topk_weights_TK, handle.pos_TK,
                                 handle.order_N // K, handle.order_N, handle.exchange,
                                 handle.kernels)
