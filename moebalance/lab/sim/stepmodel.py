"""The step model: modelled seconds of one training step from each device's expert load.

Per MoE layer ``l`` of step ``t``, with ``load_g`` (token, expert) pairs on device ``g``, P pairs
in all (G devices x tokens per device x K), uniform sources (every device sends P / G pairs,
spread over the replicas as their loads), ``m_g`` devices on g's node and ``N_g`` pairs on it:

* **compute** ``= max_g load_g * flops_per_pair / expert_flops_g`` with ``flops_per_pair = 18 D F``
  (forward 6 D F, backward twice that);
* **all-to-all** ``= 4 * max_g a_g`` (dispatch and combine, forward and backward), where one
  exchange costs device g ``a_g = max(send, recv)_intra * row / intra_bw_g + max(send,
  recv)_inter * row * c / inter_bw_g + latencies``; sent: ``(N_g - load_g) / G`` to its node,
  ``(P - N_g) / G`` off it; received: ``load_g (m_g - 1) / G`` and ``load_g (G - m_g) / G``;
  ``row = D * activation_bytes``, ``c`` the model's remote copies per pair;
* **rest of the layer** (attention, shared experts): a constant, ``non_moe_flops_per_token *
  tokens_per_device / min_g expert_flops_g`` (data-parallel work waits for the slowest kind).

Step time ``= sum_l (compute + all-to-all + rest) + exposed migration``.

**Speeds that change.** With a cluster's ``speed_changes`` (a straggler), ``expert_flops_g`` of
a step is the kind's figure times the device's factor at that step (``factors_TG`` below), in
the compute term and in the rest of the layer alike; the links keep their figures.

**Pipeline stages.** A device holds the experts of ``layers_per_device`` consecutive layers (one
pipeline stage); every stage is an expert-parallel group like the cluster described. The step
model adds the stages' layer times (no pipeline overlap: the same for every policy, so ratios
between policies are unaffected) and reports tokens per second for the ``G x
tokens_per_device`` tokens of one step.

**Migration.** A re-plan's transfer takes, per stage, ``max_g`` over the stage's devices of the
sum over link classes of the larger of its in- and outgoing bytes over that link (moved bytes
per expert = parameters x moved bytes per parameter); stages move in parallel. A *live*
migration (moebalance: weights and optimizer state travel beside the next step) is exposed by
the part longer than that step's compute on the stage (expert GEMMs and the rest of its layers;
not its all-to-all, which shares the links); a *blocking* one (training stops while experts
move) is exposed entirely.

**Transient copies** (:mod:`.transient`). A copy of one expert's weights for one step costs a
device ``c_g``: per link class, the larger of its in- and outgoing copy bytes over its own
bandwidth, summed over the classes (as a migration's transfer); the gradient's reduce back to the
owner in backward moves the same bytes the other way (the same ``c_g``). Copies chosen on the
*previous* step's counts are made ahead: a stage's copies and reduces (``2 c_g`` summed over its
layers, slowest device) are exposed by the part longer than the stage's compute (a live
migration's window). Copies chosen on *this* step's counts wait for the count exchange and share
the links with the layer's dispatch: the forward exposes ``max_g (a_g + c_g) - max_g a_g`` per
layer (an upper bound: the copy's bytes taken as not sharing the direction the dispatch leaves
idle); the reduces are exposed beyond the backward's share of the stage's compute
(:data:`BACKWARD_SHARE`). Stages run one after another in this model, so their exposed seconds
add.

Legend: T steps, L layers, E experts, G devices, S slots.
"""

from __future__ import annotations

import numpy as np

from ...placement import Placement
from ...topology import Topology
from .cluster import ClusterSpec, ModelShape

__all__ = ["StepModel"]

# Exchanges per layer and step: dispatch and combine, forward and backward.
EXCHANGES = 4

# Backward's share of a layer's compute: 12 D F of the 18 D F per pair (and the same 2:1 for
# the rest of the layer's matrix products).
BACKWARD_SHARE = 2.0 / 3.0


class StepModel:
    """Modelled step terms of ``model`` on ``cluster`` (see the module docstring)."""

    def __init__(self, cluster: ClusterSpec, model: ModelShape,
                 topology: Topology | None = None) -> None:
        self.cluster, self.model = cluster, model
        self.topology = topology or cluster.topology(model)
        G = cluster.num_devices
        self.G = G
        self.flops_G = cluster.kind_array("expert_flops")
        self.intra_bw_G = cluster.kind_array("intra_bandwidth")
        self.inter_bw_G = cluster.kind_array("inter_bandwidth")
        self.node_G = np.asarray(cluster.nodes, dtype=np.int64)
        self.node_size_G = np.bincount(self.node_G)[self.node_G].astype(np.float64)
        self.node_onehot_GN = np.zeros((G, int(self.node_G.max()) + 1))
        self.node_onehot_GN[np.arange(G), self.node_G] = 1.0
        self.pairs = float(G * model.tokens_per_device * model.top_k)
        single_node = self.node_size_G == G
        self.latency_G = (np.where(self.node_size_G > 1, cluster.kind_array("intra_latency"), 0.0)
                          + np.where(single_node, 0.0, cluster.kind_array("inter_latency")))
        self.non_moe = model.non_moe_flops_per_token * model.tokens_per_device / self.flops_G.min()

    # -- per layer and step -----------------------------------------------------------------------

    def _flops(self, factors_TG: np.ndarray | None) -> np.ndarray:
        """[T, 1, G] (or [G] without factors): expert FLOP/s of every device at every step."""
        if factors_TG is None:
            return self.flops_G
        return (self.flops_G * np.asarray(factors_TG, dtype=np.float64))[:, None, :]

    def compute_seconds(self, loads_TLG: np.ndarray, factors_TG: np.ndarray | None = None
                        ) -> np.ndarray:
        """[T, L] slowest device's expert compute; ``factors_TG`` [T, G]: each device's
        throughput over its kind's at each step (None: 1)."""
        return (loads_TLG * (self.model.flops_per_pair / self._flops(factors_TG))).max(axis=-1)

    def non_moe_seconds(self, shape_TL: tuple[int, int], factors_TG: np.ndarray | None = None
                        ) -> np.ndarray:
        """[T, L] the rest of every layer: waits for the slowest device of the step."""
        if factors_TG is None:
            return np.full(shape_TL, self.non_moe)
        slowest_T = (self.flops_G * np.asarray(factors_TG, dtype=np.float64)).min(axis=-1)
        rest_T = self.model.non_moe_flops_per_token * self.model.tokens_per_device / slowest_T
        return np.broadcast_to(rest_T[:, None], shape_TL).copy()

    def all_to_all_seconds(self, loads_TLG: np.ndarray) -> np.ndarray:
        """[T, L] the four exchanges of each layer, set by the slowest device."""
        return EXCHANGES * self.exchange_seconds(loads_TLG).max(axis=-1)

    def exchange_seconds(self, loads_TLG: np.ndarray) -> np.ndarray:
        """[T, L, G] one exchange's seconds on every device (``a_g`` of the module docstring)."""
        G, m = self.G, self.model
        node_load = loads_TLG @ self.node_onehot_GN                             # [T, L, N]
        on_node = node_load[..., self.node_G]                                   # [T, L, G]
        send_intra = (on_node - loads_TLG) / G
        send_inter = (self.pairs - on_node) / G
        recv_intra = loads_TLG * (self.node_size_G - 1) / G
        recv_inter = loads_TLG * (G - self.node_size_G) / G
        return (np.maximum(send_intra, recv_intra) * m.row_bytes / self.intra_bw_G
                + np.maximum(send_inter, recv_inter) * m.row_bytes * m.remote_copies_per_pair
                / self.inter_bw_G + self.latency_G)

    def imbalance(self, loads_TLG: np.ndarray, factors_TG: np.ndarray | None = None
                  ) -> np.ndarray:
        """[T] summary imbalance of each step, ``sum_l max_g load/speed / sum_l ideal``, with
        the speeds the devices run at (the topology's times ``factors_TG`` [T, G])."""
        speed = self.topology.speed
        if factors_TG is not None:
            speed = (speed * np.asarray(factors_TG, dtype=np.float64))[:, None, :]
        hottest = (loads_TLG / speed).max(axis=-1).sum(axis=-1)
        ideal = (loads_TLG.sum(axis=-1) / speed.sum(axis=-1)).sum(axis=-1)
        return hottest / np.maximum(ideal, 1e-300)

    # -- migrations -------------------------------------------------------------------------------

    def stage_of_layer(self, num_layers: int) -> np.ndarray:
        """[L] pipeline stage of every layer: ``layers_per_device`` consecutive layers a stage."""
        per = self.model.layers_per_device or num_layers
        return np.arange(num_layers) // per

    def migration(self, old: Placement, new: Placement) -> tuple[np.ndarray, float, int]:
        """(seconds [stages], bytes, moves) of going from ``old`` to ``new``.

        Every expert a device holds in ``new`` and not in ``old`` is copied from an old holder,
        one on the same node when there is one (spread over the holders). A stage's layers move
        at once over its own devices; stages move in parallel (they are other devices)."""
        G, E, L = self.G, new.num_experts, new.num_layers
        dev = new.slot_device
        stage = self.stage_of_layer(L)
        size = self.model.bytes_per_move
        per_link = np.stack([self.intra_bw_G, self.inter_bw_G])
        seconds = np.zeros(int(stage.max()) + 1)
        moves = 0
        for s in range(seconds.size):
            bytes_in = np.zeros((2, G))       # [intra, inter] per device
            bytes_out = np.zeros((2, G))
            for layer in np.flatnonzero(stage == s):
                held_old = np.zeros((G, E), dtype=bool)
                held_old[dev, old.phy2log[layer]] = True
                held_new = np.zeros((G, E), dtype=bool)
                held_new[dev, new.phy2log[layer]] = True
                dst, expert = np.nonzero(held_new & ~held_old)
                moves += dst.size
                for g, e in zip(dst.tolist(), expert.tolist()):
                    holders = np.flatnonzero(held_old[:, e])
                    local = holders[self.node_G[holders] == self.node_G[g]]
                    pool = local if local.size else holders
                    src = int(pool[g % pool.size])
                    link = 0 if local.size else 1
                    bytes_in[link, g] += size
                    bytes_out[link, src] += size
            seconds[s] = np.maximum(bytes_in / per_link, bytes_out / per_link).sum(axis=0).max()
        return seconds, float(moves * size), int(moves)

    def layer_terms(self, loads_TLG: np.ndarray, factors_TG: np.ndarray | None = None
                    ) -> dict[str, np.ndarray]:
        """Per step and layer [T, L]: ``expert_compute``, ``all_to_all`` and ``non_moe``
        (``factors_TG`` [T, G]: device throughput over its kind's per step, None: 1)."""
        compute = self.compute_seconds(loads_TLG, factors_TG)
        return {"expert_compute": compute, "all_to_all": self.all_to_all_seconds(loads_TLG),
                "non_moe": self.non_moe_seconds(compute.shape, factors_TG)}

    def exposed_migration(self, stage_seconds: np.ndarray, terms_L: dict[str, np.ndarray],
                          mode: str) -> float:
        """Seconds a migration of ``stage_seconds`` [stages] adds to the step it runs beside,
        whose layer terms are ``terms_L`` (each [L]); ``mode`` "live", "blocking" or "free"."""
        if mode == "free" or stage_seconds.size == 0:
            return 0.0
        if mode == "blocking":
            return float(stage_seconds.max())
        if mode != "live":
            raise ValueError(f"migration mode must be 'live', 'blocking' or 'free', got {mode!r}")
        busy = terms_L["expert_compute"] + terms_L["non_moe"]
        stage = self.stage_of_layer(busy.shape[0])
        window = np.bincount(stage, weights=busy, minlength=stage_seconds.size)
        return float(np.maximum(stage_seconds - window, 0.0).max())

    def transient_seconds(self, copy_TLG: np.ndarray, loads_TLG: np.ndarray,
                          terms_TL: dict[str, np.ndarray], guide: str) -> np.ndarray:
        """[T] seconds the steps' transient copies add (the module docstring's rule).

        Args:
            copy_TLG: [T, L, G] each device's transfer seconds ``c_g`` of the weight copies.
            loads_TLG: [T, L, G] the loads the steps ran with (the dispatch they share links
                with). terms_TL: :meth:`layer_terms` of those loads.
            guide: "previous" (copies made ahead) or "current" (on the critical path).
        """
        busy_TL = terms_TL["expert_compute"] + terms_TL["non_moe"]
        stage = self.stage_of_layer(busy_TL.shape[1])
        starts = np.flatnonzero(np.r_[True, stage[1:] != stage[:-1]])
        window_TS = np.add.reduceat(busy_TL, starts, axis=1)
        copy_TS = np.add.reduceat(copy_TLG, starts, axis=1).max(axis=-1)
        if guide == "previous":
            return np.maximum(2.0 * copy_TS - window_TS, 0.0).sum(axis=1)
        if guide != "current":
            raise ValueError(f"guide must be 'previous' or 'current', got {guide!r}")
        a_TLG = self.exchange_seconds(loads_TLG)
        forward = ((a_TLG + copy_TLG).max(axis=-1) - a_TLG.max(axis=-1)).sum(axis=1)
        backward = np.maximum(copy_TS - BACKWARD_SHARE * window_TS, 0.0).sum(axis=1)
        return forward + backward

    def ideal_moe_seconds(self, num_layers: int) -> float:
        """Expert compute of one perfectly balanced step (the move price's step time)."""
        return num_layers * self.pairs * self.model.flops_per_pair / self.flops_G.sum()
