"""Dispatcher and ExpertParallelMoE on 4 gloo ranks: the math is placement-blind, replicas agree.

All cases run in ONE spawn of 4 ranks (see ``_dist.py``); each is reported as its own test.
Every rank builds the same dense reference and the same global batch (fixed seeds), keeps its
slice of the tokens, and compares its part of the expert-parallel result with the reference.
The comparisons with the dense layer run for both row exchanges ("p2p" and "all_to_all").
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _dist import case_id, shared_spawn
from torch.testing import assert_close

from moebalance.collective_errors import GroupError, GroupValueError
from moebalance.dispatch import Dispatcher
from moebalance.dispatch.exchange import EXCHANGES, auto_exchange
from moebalance.dispatch.routing import replica_table
from moebalance.nn.moe import DenseMoE, ExpertParallelMoE, reduce_replica_gradients
from moebalance.placement import Placement

WORLD = 4
D, F = 16, 12
MODES = ("p2p", "all_to_all")   # the row exchanges; "auto" picks p2p on gloo


# -- helpers (run inside the workers) ---------------------------------------------------------


def random_placement(seed: int, num_experts: int, slots_per_rank, num_layers: int = 1,
                     zero_share: float = 0.2) -> Placement:
    """Random valid placement: every expert >= 1 replica, none twice on a rank, random shares
    (some replicas with share 0) summing to 1 per expert."""
    rng = np.random.default_rng(seed)
    E, G = num_experts, len(slots_per_rank)
    slot_device = np.repeat(np.arange(G), slots_per_rank)
    phy2log = np.zeros((num_layers, len(slot_device)), dtype=np.int64)
    share = np.zeros_like(phy2log, dtype=np.float64)
    for layer in range(num_layers):
        held = [[] for _ in range(G)]
        for e in rng.permutation(E):                      # every expert once
            free = [g for g in range(G) if len(held[g]) < slots_per_rank[g]]
            held[int(rng.choice(free))].append(int(e))
        for g in range(G):                                # fill the rest with new replicas
            others = [e for e in range(E) if e not in held[g]]
            held[g] += rng.choice(others, slots_per_rank[g] - len(held[g]), replace=False).tolist()
        row = np.concatenate([rng.permutation(h) for h in held])
        phy2log[layer] = row
        for e in range(E):
            slots = np.flatnonzero(row == e)
            w = rng.random(slots.size) * (rng.random(slots.size) >= zero_share)
            if w.sum() == 0:
                w[rng.integers(slots.size)] = 1.0
            share[layer, slots] = w / w.sum()
    return Placement(phy2log, share, slot_device, E).validate()


def token_range(tokens_per_rank, rank):
    lo = sum(tokens_per_rank[:rank])
    return lo, lo + tokens_per_rank[rank]


def global_batch(seed: int, num_tokens: int, dtype):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, D, generator=gen, dtype=torch.float64)
    x[:, 0] = 3.0   # a constant feature lets a router weight silence an expert
    proj = torch.randn(num_tokens, D, generator=gen, dtype=torch.float64)
    return x.to(dtype), proj.to(dtype)


def dense_layer(seed: int, num_experts: int, top_k: int, dtype, dead=()) -> DenseMoE:
    dense = DenseMoE(D, F, num_experts, top_k, seed=seed).to(dtype)
    with torch.no_grad():
        for e in dead:   # logits near -30: never among the top k
            dense.router.weight[e] = 0.0
            dense.router.weight[e, 0] = -10.0
    return dense


def with_exchange(moe: ExpertParallelMoE, exchange: str, nodes=None,
                  speeds=None) -> ExpertParallelMoE:
    """``moe`` with its rows moved by ``exchange`` ("p2p" or "all_to_all"), routing with a
    node preference when ``nodes`` is given and re-splitting each step by ``speeds`` when given."""
    moe.dispatcher = Dispatcher(exchange=exchange, nodes=nodes, resplit=speeds is not None,
                                speeds=speeds)
    return moe


def labelled(exchange: str):
    """assert_close message prefix naming the exchange under test."""
    return lambda msg: f"exchange={exchange}: {msg}"


def compare_with_dense(dense: DenseMoE, placement: Placement, tokens_per_rank, seed: int,
                       rtol: float, atol: float, nodes=None, speeds=None) -> ExpertParallelMoE:
    """Forward + backward on the dense layer, then on the expert-parallel layer with each row
    exchange; outputs and every gradient must agree. Returns the last expert-parallel layer."""
    rank = dist.get_rank()
    dtype = dense.router.weight.dtype
    x_all, proj_all = global_batch(seed, sum(tokens_per_rank), dtype)
    dense.zero_grad()
    xd = x_all.clone().requires_grad_()
    out_d = dense(xd)
    (out_d * proj_all).sum().backward()
    lo, hi = token_range(tokens_per_rank, rank)

    for exchange in MODES:
        moe = with_exchange(ExpertParallelMoE.from_dense(dense, placement), exchange, nodes,
                            speeds)
        x = x_all[lo:hi].clone().requires_grad_()
        out = moe(x)
        (out * proj_all[lo:hi]).sum().backward()
        moe.reduce_replica_gradients()

        tol = dict(rtol=rtol, atol=atol, msg=labelled(exchange))
        assert_close(out, out_d[lo:hi].detach(), **tol)
        assert_close(x.grad, xd.grad[lo:hi], **tol)
        assert_close(moe.router.weight.grad, dense.router.weight.grad, **tol)
        local = torch.tensor(moe.local_experts)
        assert_close(moe.experts.gate_up.grad, dense.experts.gate_up.grad[local], **tol)
        assert_close(moe.experts.down.grad, dense.experts.down.grad[local], **tol)
    return moe


def gather_slots(moe: ExpertParallelMoE):
    """Every rank's (local experts, gate_up, down, router weight), gathered to every rank."""
    mine = (moe.local_experts.tolist(), moe.experts.gate_up.detach().clone(),
            moe.experts.down.detach().clone(), moe.router.weight.detach().clone())
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def assert_replicas_identical(moe: ExpertParallelMoE) -> None:
    first: dict = {}
    everyone = gather_slots(moe)
    for experts, gate_up, down, router in everyone:
        assert torch.equal(router, everyone[0][3]), "router weights differ between ranks"
        for slot, e in enumerate(experts):
            if e in first:
                assert torch.equal(gate_up[slot], first[e][0]), \
                    f"gate_up replicas of expert {e} differ"
                assert torch.equal(down[slot], first[e][1]), f"down replicas of expert {e} differ"
            else:
                first[e] = (gate_up[slot], down[slot])


# -- cases ------------------------------------------------------------------------------------


def outputs_and_gradients_match_dense_for_top_k_1_to_8():
    """Random placements with replicas and uneven shares, uneven slots per rank (3, 5, 2, 4),
    a rank with no tokens, experts no token picks, fp32 rtol 1e-5."""
    E, slots, tokens = 8, [3, 5, 2, 4], [6, 0, 9, 4]
    for k in range(1, 9):
        dead = list(range(E - 1, E - 1 - min(2, E - k), -1))
        dense = dense_layer(100 + k, E, k, torch.float32, dead)
        placement = random_placement(200 + k, E, slots)
        assert placement.replicas.max() > 1
        compare_with_dense(dense, placement, tokens, seed=300 + k, rtol=1e-5, atol=1e-6)


def outputs_and_gradients_match_dense_with_node_preference():
    """Routing that prefers replicas on the token's node (ranks 0-1 on node 0, 2-3 on node 1)
    changes which replica a pair visits, never the math."""
    E, slots, tokens = 8, [3, 4, 3, 2], [7, 5, 8, 3]
    dense = dense_layer(901, E, 2, torch.float32)
    placement = random_placement(902, E, slots)
    assert placement.replicas.max() > 1
    compare_with_dense(dense, placement, tokens, seed=903, rtol=1e-5, atol=1e-6, nodes=[0, 0, 1, 1])


def outputs_and_gradients_match_dense_when_a_rank_receives_nothing():
    """Rank 2's only slot holds a replica of share 0; rank 3 has no tokens."""
    E = 8
    phy2log = np.array([[0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 4, 6]])
    share = np.array([[1.0, 0.3, 1, 1, 0.5, 1, 0.0, 1, 0.0, 0.7, 0.5, 1.0]])
    placement = Placement(phy2log, share, np.repeat(np.arange(4), [4, 4, 1, 3]), E).validate()
    dense = dense_layer(7, E, 2, torch.float32)
    moe = compare_with_dense(dense, placement, [5, 3, 4, 0], seed=8, rtol=1e-5, atol=1e-6)
    # The layer above ran with rank 2 receiving no rows; check that it really did.
    x = torch.randn(4, D)
    _, w, ids = moe.router(x)
    _, handle = moe.dispatcher.dispatch(x, ids, w, placement, 0)
    if dist.get_rank() == 2:
        assert handle.tokens_per_local_slot == [0]


def outputs_and_gradients_match_dense_in_float64_with_two_layers():
    E, slots, tokens = 12, [4, 6, 3, 5], [7, 5, 0, 6]
    placement = random_placement(31, E, slots, num_layers=2)
    for layer in range(2):
        dense = dense_layer(40 + layer, E, 3, torch.float64)
        x_all, proj_all = global_batch(50 + layer, sum(tokens), torch.float64)
        xd = x_all.clone().requires_grad_()
        out_d = dense(xd)
        (out_d * proj_all).sum().backward()
        lo, hi = token_range(tokens, dist.get_rank())
        for exchange in MODES:
            moe = with_exchange(ExpertParallelMoE.from_dense(dense, placement, layer=layer),
                                exchange)
            x = x_all[lo:hi].clone().requires_grad_()
            out = moe(x)
            (out * proj_all[lo:hi]).sum().backward()
            reduce_replica_gradients(moe)
            tol = dict(rtol=1e-12, atol=1e-13, msg=labelled(exchange))
            assert_close(out, out_d[lo:hi].detach(), **tol)
            assert_close(x.grad, xd.grad[lo:hi], **tol)
            local = torch.tensor(moe.local_experts)
            assert_close(moe.experts.gate_up.grad, dense.experts.gate_up.grad[local], **tol)
            assert_close(moe.router.weight.grad, dense.router.weight.grad, **tol)


def rows_reach_a_replica_of_their_expert():
    """Scaling each local slot's rows by (its expert + 1) must give sum_k w * (e_k + 1) * x."""
    rank = dist.get_rank()
    E, K, T = 8, 3, 11 + 2 * rank
    placement = random_placement(9, E, [2, 4, 3, 5])
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(T, D, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=gen)
    expected = ((w * (ids + 1).float()).sum(1))[:, None] * x
    for exchange in MODES:
        dispatcher = Dispatcher(exchange=exchange)
        recv, handle = dispatcher.dispatch(x, ids, w, placement, 0)
        assert handle.exchange_kind == exchange
        assert recv.shape == (handle.num_recv_rows, D)
        lo = dispatcher.local_slots(placement).start
        experts = placement.phy2log[0, lo:lo + len(handle.tokens_per_local_slot)]
        scale = torch.repeat_interleave(torch.tensor(experts + 1.0, dtype=torch.float32),
                                        torch.tensor(handle.tokens_per_local_slot))
        out = dispatcher.combine(recv * scale[:, None], handle)
        assert_close(out, expected, rtol=1e-5, atol=1e-6, msg=labelled(exchange))


def exchanges_give_bit_identical_outputs_and_gradients():
    """One random layer (replicas, uneven slots and tokens, a rank without tokens): "p2p" and
    "all_to_all" give the same received rows, split sizes, outputs and gradients, bit for bit;
    "auto" picks "p2p" on gloo."""
    rank = dist.get_rank()
    E, K, tokens = 10, 3, [13, 0, 21, 8]
    placement = random_placement(71, E, [4, 3, 5, 4])
    dense = dense_layer(72, E, K, torch.float32)
    x_all, proj_all = global_batch(73, sum(tokens), torch.float32)
    lo, hi = token_range(tokens, rank)
    results = {}
    for exchange in ("auto",) + MODES:
        moe = with_exchange(ExpertParallelMoE.from_dense(dense, placement), exchange)
        x = x_all[lo:hi].clone().requires_grad_()
        _, w, ids = moe.router(x.detach())
        recv, handle = moe.dispatcher.dispatch(x.detach(), ids, w.detach(), placement, 0)
        out = moe(x)
        (out * proj_all[lo:hi]).sum().backward()
        results[exchange] = dict(
            kind=handle.exchange_kind, recv=recv, splits=(handle.send_splits, handle.recv_splits),
            per_slot=handle.tokens_per_local_slot, out=out.detach(), x_grad=x.grad,
            router_grad=moe.router.weight.grad, gate_up_grad=moe.experts.gate_up.grad,
            down_grad=moe.experts.down.grad)
    assert [results[m]["kind"] for m in ("auto",) + MODES] == ["p2p", "p2p", "all_to_all"]
    p2p, a2a = results["p2p"], results["all_to_all"]
    assert p2p["splits"] == a2a["splits"] and p2p["per_slot"] == a2a["per_slot"]
    for key in ("recv", "out", "x_grad", "router_grad", "gate_up_grad", "down_grad"):
        assert torch.equal(p2p[key], a2a[key]), f"{key} differs between p2p and all_to_all"


def replica_token_counts_follow_shares():
    """Summed over ranks, replica j of expert e receives share[j] of e's pairs: the placement's
    shares without the re-split, this step's (the handle's) with it."""
    E, K, T = 6, 2, 3000
    placement = random_placement(11, E, [3, 2, 4, 3], zero_share=0.3)
    gen = torch.Generator().manual_seed(50 + dist.get_rank())
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    table = replica_table(placement, 0)
    valid = table.valid_EX.numpy()
    for resplit in (False, True):
        dispatcher = Dispatcher(resplit=resplit)
        _, handle = dispatcher.dispatch(torch.zeros(T, 1), ids, torch.ones(T, K), placement, 0)
        received = [None] * WORLD
        dist.all_gather_object(received, handle.tokens_per_local_slot)
        per_slot = np.concatenate(received)
        pairs_E = torch.bincount(ids.reshape(-1), minlength=E)
        dist.all_reduce(pairs_E)
        s = np.zeros(placement.num_slots)
        s[table.slots_EX.numpy()[valid]] = handle.share_EX.numpy()[valid]
        if not resplit:
            np.testing.assert_array_equal(s, placement.share[0])
        expected = s * pairs_E.numpy()[placement.phy2log[0]]
        assert np.all(per_slot[s == 0] == 0), "a replica with share 0 received pairs"
        tolerance = 5 * np.sqrt(expected * (1 - s)) + 2
        assert np.all(np.abs(per_slot - expected) <= tolerance), (per_slot, expected)


def all_ranks_without_tokens_give_empty_outputs_and_gradients():
    dense = dense_layer(3, 8, 2, torch.float32)
    placement = random_placement(4, 8, [3, 3, 3, 3])
    moe = ExpertParallelMoE.from_dense(dense, placement)
    x = torch.zeros(0, D, requires_grad=True)
    out = moe(x)
    out.sum().backward()
    moe.reduce_replica_gradients()
    assert out.shape == (0, D) and x.grad.shape == (0, D)
    assert torch.count_nonzero(moe.experts.gate_up.grad) == 0


def replicas_identical_after_optimizer_steps():
    """SGD with momentum and AdamW: replicas equal bit for bit, weights track the dense layer."""
    E, slots, tokens = 8, [4, 3, 5, 2], [5, 7, 0, 6]
    placement = random_placement(21, E, slots)
    for opt_name in ("sgd", "adamw"):
        dense = dense_layer(22, E, 2, torch.float32)
        moe = ExpertParallelMoE.from_dense(dense, placement)

        def make(params):
            if opt_name == "sgd":
                return torch.optim.SGD(params, lr=0.05, momentum=0.9)
            return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)

        opt_d, opt_m = make(dense.parameters()), make(moe.parameters())
        lo, hi = token_range(tokens, dist.get_rank())
        for step in range(3):
            x_all, proj_all = global_batch(500 + step, sum(tokens), torch.float32)
            opt_d.zero_grad()
            (dense(x_all) * proj_all).sum().backward()
            opt_d.step()
            opt_m.zero_grad()
            (moe(x_all[lo:hi]) * proj_all[lo:hi]).sum().backward()
            moe.reduce_replica_gradients()
            opt_m.step()
        assert_replicas_identical(moe)
        local = torch.tensor(moe.local_experts)
        assert_close(moe.experts.gate_up.detach(), dense.experts.gate_up.detach()[local],
                     rtol=1e-4, atol=1e-5)
        assert_close(moe.router.weight.detach(), dense.router.weight.detach(), rtol=1e-4, atol=1e-5)


def construction_gives_identical_replicas_even_with_different_rank_seeds():
    torch.manual_seed(1000 + dist.get_rank())      # ranks disagree on the global generator
    placement = random_placement(5, 8, [3, 4, 2, 3])
    moe = ExpertParallelMoE(D, F, 8, 2, placement)
    assert_replicas_identical(moe)
    seeded = ExpertParallelMoE(D, F, 8, 2, placement, seed=77)
    dense = DenseMoE(D, F, 8, 2, seed=77)
    local = torch.tensor(seeded.local_experts)
    assert torch.equal(seeded.experts.gate_up.detach(), dense.experts.gate_up.detach()[local])
    assert torch.equal(seeded.router.weight.detach(), dense.router.weight.detach())


def bad_input_raises_a_clear_error_on_every_rank():
    rank = dist.get_rank()
    E, K, T = 8, 2, 5
    placement = random_placement(61, E, [2, 3, 2, 2])
    dispatcher = Dispatcher()
    x, w = torch.randn(T, D), torch.rand(T, K)
    ids = torch.randint(0, E, (T, K))
    bad_ids = ids.clone()
    if rank == 1:
        bad_ids[2, 1] = E                          # only rank 1 is wrong; all must raise
    for exchange in MODES:
        with pytest.raises(ValueError, match="outside"):
            Dispatcher(exchange=exchange).dispatch(x, bad_ids, w, placement, 0)
    with pytest.raises(ValueError, match="topk_weights_TK"):
        dispatcher.dispatch(x, ids, w[:, :1], placement, 0)
    with pytest.raises(ValueError, match="topk_ids_TK"):
        dispatcher.dispatch(x, ids[:-1], w[:-1], placement, 0)
    with pytest.raises(ValueError, match="x_TD"):
        dispatcher.dispatch(x[0], ids, w, placement, 0)
    with pytest.raises(ValueError, match="layer"):
        dispatcher.dispatch(x, ids, w, placement, 1)
    two_ranks = random_placement(62, E, [5, 4])
    with pytest.raises(ValueError, match="4 ranks"):
        dispatcher.dispatch(x, ids, w, two_ranks, 0)
    with pytest.raises(ValueError, match="4 ranks"):
        ExpertParallelMoE(D, F, E, K, two_ranks, seed=0)
    with pytest.raises(ValueError, match="num_experts"):
        ExpertParallelMoE(D, F, E + 1, K, placement, seed=0)
    recv, handle = dispatcher.dispatch(x, ids, w, placement, 0)
    with pytest.raises(ValueError, match="y_MD"):
        dispatcher.combine(recv[1:], handle)
    # The group is still in step after all the errors above.
    out = dispatcher.combine(recv, handle)
    assert_close(out, w.sum(1, keepdim=True) * x, rtol=1e-5, atol=1e-6)


def outputs_and_gradients_match_dense_with_per_step_resplit():
    """Re-splitting each step's pairs over the replicas (unequal speeds, nodes) changes which
    replica a pair visits, never the math."""
    E, slots, tokens = 8, [3, 5, 2, 4], [9, 0, 6, 11]
    dense = dense_layer(911, E, 2, torch.float32)
    placement = random_placement(912, E, slots)
    compare_with_dense(dense, placement, tokens, seed=913, rtol=1e-5, atol=1e-6,
                       nodes=[0, 0, 1, 1], speeds=[1.0, 2.0, 0.5, 1.5])


def issue_placement() -> Placement:
    """Expert 0 on all 4 ranks (shares .1/.2/.3/.4), expert 1 on ranks 0, 1, 3 (.7/.05/.25),
    expert 2 on ranks 1 and 2 (.35/.65), expert 3 on rank 2 alone."""
    phy2log = np.array([[0, 1, 0, 1, 2, 0, 2, 3, 0, 1]])
    share = np.array([[0.1, 0.7, 0.2, 0.05, 0.35, 0.3, 0.65, 1.0, 0.4, 0.25]])
    return Placement(phy2log, share, np.array([0, 0, 1, 1, 1, 2, 2, 2, 3, 3]), 4).validate()


def assert_shares_met(dispatcher, placement, ids) -> int:
    """Every replica receives share x the expert's pairs over the group, within one pair, where
    share is what the dispatch routed by (the placement's, or this step's re-split); returns
    the largest deviation seen."""
    T, K = ids.shape
    _, handle = dispatcher.dispatch(torch.zeros(T, 1), ids, torch.ones(T, K), placement, 0)
    received = [None] * WORLD
    dist.all_gather_object(received, handle.tokens_per_local_slot)
    per_slot = np.concatenate(received)
    pairs_E = torch.bincount(ids.reshape(-1), minlength=placement.num_experts)
    dist.all_reduce(pairs_E)
    table = replica_table(placement, 0)
    valid = table.valid_EX.numpy()
    share_S = np.zeros(placement.num_slots)
    share_S[table.slots_EX.numpy()[valid]] = handle.share_EX.numpy()[valid]
    if not dispatcher.resplit:
        np.testing.assert_array_equal(share_S, placement.share[0])
    expected = share_S * pairs_E.numpy()[placement.phy2log[0]]
    deviation = np.abs(per_slot - expected)
    assert np.all(deviation <= 1.0), (per_slot, expected)
    return float(deviation.max())


def shares_are_met_for_uneven_batches_and_rank_preferences():
    """Batch sizes [12000, 6000, 0, 14000] with one preference, then equal batches where each
    rank prefers another expert: shares are met to within one pair either way, with and
    without node preference."""
    rank = dist.get_rank()
    placement = issue_placement()
    gen = torch.Generator().manual_seed(60 + rank)
    uneven = [12000, 6000, 0, 14000][rank]
    same_pref = torch.tensor([0.4, 0.3, 0.2, 0.1])
    own_pref = torch.full((4,), 0.1)
    own_pref[rank] = 0.7
    for nodes in (None, [0, 0, 1, 1]):
        dispatcher = Dispatcher(nodes=nodes)
        for T, pref in ((uneven, same_pref), (3000, own_pref)):
            ids = torch.multinomial(pref.expand(max(T, 1), 4), 2, generator=gen)[:T]
            assert_shares_met(dispatcher, placement, ids)


def a_malformed_input_on_one_rank_raises_on_every_rank():
    """Rank 3 passes rows of width D + 1, then weights of the wrong shape, then goes through
    Dispatcher.abort: every rank raises the same error each time, and the group is still in
    step after."""
    rank = dist.get_rank()
    placement = random_placement(81, 8, [2, 3, 2, 2])
    dispatcher = Dispatcher()
    x, w, ids = torch.randn(5, D), torch.rand(5, 2), torch.randint(0, 8, (5, 2))
    wide = torch.randn(5, D + 1) if rank == 3 else x
    with pytest.raises(ValueError, match="width D"):
        dispatcher.dispatch(wide, ids, w, placement, 0)
    half = x.double() if rank == 3 else x
    with pytest.raises(ValueError, match="dtype"):
        dispatcher.dispatch(half, ids, w, placement, 0)
    bad_w = w[:, :1] if rank == 3 else w
    with pytest.raises(GroupValueError, match=r"rank\(s\) \[3\].*topk_weights_TK") as info:
        dispatcher.dispatch(x, ids, bad_w, placement, 0)
    assert info.value.ranks == [3]
    if rank == 3:
        with pytest.raises(GroupError, match=r"rank\(s\) \[3\].*KeyError.*no router output"):
            dispatcher.abort(KeyError("no router output"), placement, 0)
    else:
        with pytest.raises(GroupError, match=r"rank\(s\) \[3\].*KeyError.*no router output"):
            dispatcher.dispatch(x, ids, w, placement, 0)
    recv, handle = dispatcher.dispatch(x, ids, w, placement, 0)
    assert_close(dispatcher.combine(recv, handle), w.sum(1, keepdim=True) * x, rtol=1e-5, atol=1e-6)


def a_new_placement_object_every_step_is_routed_by_its_own_shares():
    """A live swap between steps (a new Placement object each time, even with equal contents)
    routes by the new object's shares; the cache keeps a few placements, keyed by object."""
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(90 + rank)
    dispatcher = Dispatcher(resplit=False)
    for step in range(6):
        placement = random_placement(300 + step % 3, 8, [3, 2, 4, 3], zero_share=0.3)
        ids = torch.multinomial(torch.ones(8), 2 * (500 + 300 * rank), replacement=True,
                                generator=gen).view(-1, 2)
        assert_shares_met(dispatcher, placement, ids)
        assert dispatcher._states[id(placement)].placement is placement
    assert len(dispatcher._states) <= 4


def manual_gradient_sync_without_replicated_experts_is_a_no_op_in_step():
    """grad_sync="manual" where no expert has a second replica: the expert gradients stay as
    they are, the router's is summed over the ranks, and the group stays in step."""
    placement = Placement(np.arange(8)[None], np.ones((1, 8)), np.repeat(np.arange(4), 2),
                          8).validate()
    dense = DenseMoE(D, F, 8, 2, seed=5)
    moe = ExpertParallelMoE.from_dense(dense, placement, grad_sync="manual")
    x = torch.randn(5, D, generator=torch.Generator().manual_seed(dist.get_rank()))
    moe(x).square().sum().backward()
    experts = moe.experts.gate_up.grad.clone()
    router = moe.router.weight.grad.clone()
    reduce_replica_gradients(moe)
    assert torch.equal(moe.experts.gate_up.grad, experts)
    dist.all_reduce(router)
    assert_close(moe.router.weight.grad, router)
    assert_close(moe(x), dense(x), rtol=1e-5, atol=1e-6)


def a_backward_stopped_by_an_exception_leaves_the_next_ones_sums_whole():
    """A backward that raises after the replicas' sums were posted (an exception in the
    engine: its end-of-backward steps never run) must not cost the next backward its sums."""
    E, slots, tokens = 8, [3, 3, 3, 3], [5, 6, 7, 4]
    dense = dense_layer(71, E, 2, torch.float64)
    moe = ExpertParallelMoE.from_dense(dense, random_placement(72, E, slots))
    x_all, proj_all = global_batch(73, sum(tokens), torch.float64)
    lo, hi = token_range(tokens, dist.get_rank())
    x = x_all[lo:hi].clone().requires_grad_()
    out = moe(x)

    def stop(grad):
        raise RuntimeError("stopped on purpose")

    x.register_hook(stop)
    with pytest.raises(RuntimeError, match="stopped on purpose"):
        (out * proj_all[lo:hi]).sum().backward()
    moe.zero_grad(set_to_none=True)
    (dense(x_all) * proj_all).sum().backward()
    (moe(x_all[lo:hi]) * proj_all[lo:hi]).sum().backward()
    local = torch.tensor(moe.local_experts)
    assert_close(moe.experts.gate_up.grad, dense.experts.gate_up.grad[local])
    assert_close(moe.experts.down.grad, dense.experts.down.grad[local])
    assert_close(moe.router.weight.grad, dense.router.weight.grad)


CASES = [
    outputs_and_gradients_match_dense_for_top_k_1_to_8,
    outputs_and_gradients_match_dense_with_node_preference,
    outputs_and_gradients_match_dense_when_a_rank_receives_nothing,
    outputs_and_gradients_match_dense_in_float64_with_two_layers,
    rows_reach_a_replica_of_their_expert,
    exchanges_give_bit_identical_outputs_and_gradients,
    replica_token_counts_follow_shares,
    all_ranks_without_tokens_give_empty_outputs_and_gradients,
    replicas_identical_after_optimizer_steps,
    construction_gives_identical_replicas_even_with_different_rank_seeds,
    bad_input_raises_a_clear_error_on_every_rank,
    outputs_and_gradients_match_dense_with_per_step_resplit,
    shares_are_met_for_uneven_batches_and_rank_preferences,
    a_malformed_input_on_one_rank_raises_on_every_rank,
    a_new_placement_object_every_step_is_routed_by_its_own_shares,
    manual_gradient_sync_without_replicated_experts_is_a_no_op_in_step,
    a_backward_stopped_by_an_exception_leaves_the_next_ones_sums_whole,
]


dist_results = shared_spawn(CASES, __name__, world_size=WORLD)


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_on_four_gloo_ranks(dist_results, case):
    dist_results.check(case)


# -- single process -----------------------------------------------------------------------------


@pytest.mark.parametrize("exchange", ["nccl", "alltoall", "", None, 1])
def test_unknown_exchange_is_rejected_naming_the_choices(exchange):
    with pytest.raises(ValueError,
                       match=r"exchange must be one of \['auto', 'all_to_all', 'p2p'\]"):
        Dispatcher(exchange=exchange)


def test_every_exchange_is_accepted_and_a_single_process_exchanges_nothing():
    placement = Placement(np.arange(4)[None], np.ones((1, 4)), np.zeros(4, dtype=np.int64), 4)
    x, ids, w = torch.randn(5, D), torch.randint(0, 4, (5, 2)), torch.rand(5, 2)
    for exchange in EXCHANGES:
        dispatcher = Dispatcher(exchange=exchange)
        assert dispatcher.exchange == exchange and dispatcher.exchange_for("cpu") == "local"
        recv, handle = dispatcher.dispatch(x, ids, w, placement, 0)
        assert handle.exchange_kind == "local" and handle.send_splits is None
        assert_close(dispatcher.combine(recv, handle), w.sum(1, keepdim=True) * x)


def test_auto_picks_p2p_on_gloo_and_all_to_all_on_other_backends():
    assert auto_exchange("gloo", "cpu") == "p2p"
    assert auto_exchange("nccl", "cuda") == "all_to_all"
    assert auto_exchange("mpi", "cpu") == "all_to_all"
    assert auto_exchange("cpu:gloo,cuda:nccl", "cpu") == "p2p"
    assert auto_exchange("cpu:gloo,cuda:nccl", "cuda") == "all_to_all"
    # init_process_group() without a backend name: one backend, for the machine's device type
    assert auto_exchange("cpu:gloo", "cpu") == "p2p"
    assert auto_exchange("cuda:nccl", "cuda") == "all_to_all"


def test_nodes_must_name_the_node_of_every_rank():
    with pytest.raises(ValueError, match="nodes must give the integer node of each of the 1 ranks"):
        Dispatcher(nodes=[0, 1])
    assert Dispatcher(nodes=[3]).nodes == (3,)
