"""Transient copies in ExpertParallelMoE on 4 gloo ranks: lent weights serve a hot expert's
tokens, the math and the holders' updates stay those of the dense layer.

All cases run in the shared spawn of 4 ranks (see ``_dist.py``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _dist import case_id, shared_spawn
from torch.testing import assert_close

from moebalance.dispatch import Dispatcher
from moebalance.nn.moe import DenseMoE, ExpertParallelMoE
from moebalance.placement import Placement

WORLD = 4
D, F, E = 16, 12, 8
HOT = 4        # held by rank 1 alone; the router sends every token to it
HOT_REPLICATED = 0      # held by ranks 0 and 1


def placement() -> Placement:
    """4 ranks x 3 slots: experts 0-3 twice, 4-7 once (expert 4 on rank 1)."""
    phy2log = np.array([[0, 1, 2, 3, 4, 0, 5, 6, 1, 7, 2, 3]])
    replicas = np.bincount(phy2log[0], minlength=E)
    share = 1.0 / replicas[phy2log]
    return Placement(phy2log, share, np.repeat(np.arange(WORLD), 3), E).validate()


def hot_dense(seed: int, dtype=torch.float64, hot: int = HOT) -> DenseMoE:
    dense = DenseMoE(D, F, E, 2, seed=seed).to(dtype)
    with torch.no_grad():
        dense.router.weight[hot, 0] = 5.0      # x[:, 0] = 3: expert `hot` in every top 2
    return dense


def batch(seed: int, tokens: int, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, D, generator=gen, dtype=torch.float64)
    x[:, 0] = 3.0
    proj = torch.randn(tokens, D, generator=gen, dtype=torch.float64)
    return x.to(dtype), proj.to(dtype)


TOKENS = [16, 8, 12, 10]


def rows_of(rank: int):
    lo = sum(TOKENS[:rank])
    return lo, lo + TOKENS[rank]


def lending_layer(dense: DenseMoE, exchange: str = "p2p", transient: int = 1) -> ExpertParallelMoE:
    moe = ExpertParallelMoE.from_dense(dense, placement())
    # Every copy that shortens the slowest rank pays (price 0): copies on every step here.
    moe.dispatcher = Dispatcher(exchange=exchange, transient=transient, transient_cost=0.0)
    moe.copies_seen = []
    dispatch = moe.dispatcher.dispatch

    def recording(*args, **kwargs):
        recv, handle = dispatch(*args, **kwargs)
        moe.copies_seen.append(handle.transient)
        return recv, handle

    moe.dispatcher.dispatch = recording
    return moe


# -- cases ------------------------------------------------------------------------------------


def lent_weights_serve_the_hot_expert_and_the_math_is_the_dense_layers():
    """Outputs, input, router and slot gradients equal the dense layer's (fp64, both row
    exchanges); the hot expert's copies took rows; the holders' gradient includes the copies'."""
    rank = dist.get_rank()
    for exchange, hot, holders in (("p2p", HOT, {1}), ("all_to_all", HOT, {1}),
                                   ("p2p", HOT_REPLICATED, {0, 1})):
        dense = hot_dense(31, hot=hot)
        x_all, proj_all = batch(32, sum(TOKENS))
        xd = x_all.clone().requires_grad_()
        out_d = dense(xd)
        (out_d * proj_all).sum().backward()
        lo, hi = rows_of(rank)
        moe = lending_layer(dense, exchange)
        x = x_all[lo:hi].clone().requires_grad_()
        out = moe(x)
        (out * proj_all[lo:hi]).sum().backward()
        step = moe.copies_seen[-1]
        assert step is not None and step.num_copies >= 1, "no transient copy was made"
        assert set(step.copies_C3[:, 0].tolist()) == {hot}, step.copies_C3
        assert set(step.copies_C3[:, 1].tolist()) <= holders, "copies come from a holder"
        assert not set(step.copies_C3[:, 2].tolist()) & holders
        tol = dict(rtol=1e-10, atol=1e-12, msg=lambda m, ex=exchange: f"{ex}: {m}")
        assert_close(out, out_d[lo:hi].detach(), **tol)
        assert_close(x.grad, xd.grad[lo:hi], **tol)
        assert_close(moe.router.weight.grad, dense.router.weight.grad, **tol)
        local = torch.tensor(moe.local_experts)
        assert_close(moe.experts.gate_up.grad, dense.experts.gate_up.grad[local], **tol)
        assert_close(moe.experts.down.grad, dense.experts.down.grad[local], **tol)


def copies_leave_the_hottest_rank_less_to_do():
    """With copies the holder of the hot expert receives fewer rows than without them."""
    dense = hot_dense(41)
    x_all, _ = batch(42, sum(TOKENS))
    lo, hi = rows_of(dist.get_rank())
    received = []
    for transient in (0, 1):
        moe = lending_layer(dense, transient=transient)
        with torch.no_grad():
            _, handle = moe.dispatcher.dispatch(*_routed(moe, x_all[lo:hi]), moe.placement, 0)
        rows = torch.tensor([handle.num_recv_rows])
        everyone = [torch.zeros_like(rows) for _ in range(WORLD)]
        dist.all_gather(everyone, rows)
        received.append([int(r) for r in everyone])
    without, with_copies = received
    assert max(with_copies) < max(without), (without, with_copies)
    assert sum(with_copies) == sum(without)


def _routed(moe, x):
    _, weights, ids = moe.router(x)
    return x, ids, weights


def replicas_stay_identical_and_track_the_dense_layer_under_adamw():
    """Three AdamW steps with copies of a replicated expert on every step: every replica of an
    expert equal bit for bit, every weight equal to the dense layer's trained on the same
    batches."""
    rank = dist.get_rank()
    dense = hot_dense(51, torch.float64, hot=HOT_REPLICATED)
    moe = lending_layer(dense)
    opt_d = torch.optim.AdamW(dense.parameters(), lr=1e-2, weight_decay=0.1)
    opt_m = torch.optim.AdamW(moe.parameters(), lr=1e-2, weight_decay=0.1)
    lo, hi = rows_of(rank)
    for step in range(3):
        x_all, proj_all = batch(60 + step, sum(TOKENS))
        opt_d.zero_grad()
        (dense(x_all) * proj_all).sum().backward()
        opt_d.step()
        opt_m.zero_grad()
        (moe(x_all[lo:hi]) * proj_all[lo:hi]).sum().backward()
        opt_m.step()
    lent = [s for s in moe.copies_seen if s is not None]
    assert len(lent) >= 2, [s and s.copies_C3.tolist() for s in moe.copies_seen]
    assert {int(e) for s in lent for e in s.copies_C3[:, 0]} == {HOT_REPLICATED}
    mine = (moe.local_experts.tolist(), moe.experts.gate_up.detach(), moe.experts.down.detach())
    everyone = [None] * WORLD
    dist.all_gather_object(everyone, mine)
    first = {}
    for experts, gate_up, down in everyone:
        for slot, e in enumerate(experts):
            if e in first:
                assert torch.equal(gate_up[slot], first[e][0]), f"replicas of {e} differ"
                assert torch.equal(down[slot], first[e][1]), f"replicas of {e} differ"
            first.setdefault(e, (gate_up[slot], down[slot]))
    local = torch.tensor(moe.local_experts)
    assert_close(moe.experts.gate_up.detach(), dense.experts.gate_up.detach()[local],
                 rtol=1e-9, atol=1e-11)
    assert_close(moe.experts.down.detach(), dense.experts.down.detach()[local],
                 rtol=1e-9, atol=1e-11)


def transient_slots_need_gradients_reduced_in_backward():
    with pytest.raises(ValueError, match="transient=1 needs grad_sync=\"backward\""):
        ExpertParallelMoE(D, F, E, 2, placement(), grad_sync="manual", transient=1)
    with pytest.raises(ValueError, match="transient slots need the per-step re-split"):
        ExpertParallelMoE(D, F, E, 2, placement(), resplit=False, transient=1)


CASES = [
    lent_weights_serve_the_hot_expert_and_the_math_is_the_dense_layers,
    copies_leave_the_hottest_rank_less_to_do,
    replicas_stay_identical_and_track_the_dense_layer_under_adamw,
    transient_slots_need_gradients_reduced_in_backward,
]

dist_results = shared_spawn(CASES, __name__, world_size=WORLD)


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_on_four_gloo_ranks(dist_results, case):
    dist_results.check(case)


# -- single process -----------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [-1, 1.5, "2"])
def test_transient_slots_must_be_a_count(bad):
    with pytest.raises((TypeError, ValueError), match="transient"):
        Dispatcher(transient=bad)


def test_a_single_process_lends_nothing():
    dense = hot_dense(7)
    moe = ExpertParallelMoE.from_dense(dense, Placement(np.arange(E)[None], np.ones((1, E)),
                                                        np.zeros(E, dtype=np.int64), E))
    moe.dispatcher = Dispatcher(transient=2, transient_cost=0.0)
    x, proj = batch(8, 10)
    assert_close(moe(x), dense(x))


def _routing(cost: float):
    from moebalance.dispatch.routing import replica_table
    from moebalance.dispatch.transient import TransientRouting

    table = replica_table(placement(), 0)
    offsets = np.array([0, 3, 6, 9, 12])
    return TransientRouting(*(t.numpy() for t in (table.slots_EX, table.device_EX,
                                                   table.share_EX)),
                            offsets, 2, [1.0, 1.0, 0.5, 1.0], [0, 0, 1, 1], cost)


def test_copies_get_slots_after_their_ranks_own_and_shares_that_pay():
    counts_GE = np.zeros((WORLD, E), dtype=np.int64)
    counts_GE[:, HOT] = 40                    # 160 pairs of an expert held by rank 1 alone
    counts_GE[:, :HOT] += 2
    step, slots_EX, device_EX, share_EX = _routing(0.0).choose(counts_GE)
    assert step is not None and set(step.copies_C3[:, 0]) == {HOT}
    assert set(step.copies_C3[:, 1]) == {1} and 1 not in set(step.copies_C3[:, 2])
    K = 2
    for (expert, _, target), k, column in zip(step.copies_C3, step.slot_C, step.column_C):
        assert device_EX[expert, column] == target
        # rank g's transient slot k: after its 3 own slots, in the numbering with K per rank
        assert slots_EX[expert, column] == 3 * (target + 1) + target * K + k
        assert share_EX[expert, column] > 0
    placed = slots_EX[:, 0]
    assert np.array_equal(placed, np.array([0, 1, 2, 3, 4, 6, 7, 9]) + K * (placed // (3 + K)))
    np.testing.assert_allclose(share_EX.sum(axis=1), 1.0)
    # loads per rank over speed: the copies even out the hot expert
    loads = np.zeros(WORLD)
    np.add.at(loads, device_EX[device_EX >= 0], (counts_GE.sum(0)[:, None] * share_EX)[
        device_EX >= 0])
    times = loads / np.array([1.0, 1.0, 0.5, 1.0])
    assert times.max() < counts_GE[:, HOT].sum() / 1.0


def test_no_copy_where_none_pays_keeps_the_placements_numbering():
    counts_GE = np.full((WORLD, E), 3, dtype=np.int64)
    counts_GE[:, HOT] = 40
    step, slots_EX, _, share_EX = _routing(1e9).choose(counts_GE)
    assert step is None and slots_EX is None
    from moebalance.dispatch.routing import replica_table
    table = replica_table(placement(), 0)
    assert share_EX.shape == tuple(table.share_EX.shape)
    np.testing.assert_allclose(share_EX.sum(axis=1), 1.0)
