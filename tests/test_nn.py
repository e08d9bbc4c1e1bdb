"""ExpertParallelMoE, DenseMoE, TopKRouter and the Dispatcher in one process (world size 1).

The multi-rank versions of these properties are in test_dispatcher_distributed.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.testing import assert_close

from moebalance.backends import using_backend
from moebalance.dispatch import Dispatcher, DispatchHandle
from moebalance.nn.moe import (
    DenseMoE,
    ExpertParallelMoE,
    TopKRouter,
    reduce_replica_gradients,
    swiglu,
)
from moebalance.placement import Placement

D, F = 16, 12


def one_device_placement(seed: int, num_experts: int, num_layers: int = 1) -> Placement:
    """All experts on device 0, in a random slot order (one device cannot hold replicas)."""
    rng = np.random.default_rng(seed)
    phy2log = np.stack([rng.permutation(num_experts) for _ in range(num_layers)])
    return Placement(phy2log, np.ones(phy2log.shape), np.zeros(num_experts, dtype=np.int64),
                     num_experts).validate()


def batch(seed: int, shape, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, D, generator=gen, dtype=torch.float64).to(dtype)


def token_loop_moe(dense: DenseMoE, x_TD: torch.Tensor) -> torch.Tensor:
    """The layer token by token, pair by pair: the most literal reading of the math."""
    _, w, ids = dense.router(x_TD)
    rows = []
    for t in range(x_TD.shape[0]):
        acc = torch.zeros(D, dtype=x_TD.dtype)
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gate_up, down = dense.experts.gate_up[e], dense.experts.down[e]
            h = gate_up @ x_TD[t]
            acc = acc + w[t, k] * (down @ (torch.nn.functional.silu(h[:F]) * h[F:]))
        rows.append(acc)
    return torch.stack(rows)


# -- router ------------------------------------------------------------------------------------


def test_router_returns_logits_topk_weights_and_ids():
    router = TopKRouter(D, 6, 3)
    x = batch(0, (2, 5))
    logits, w, ids = router(x)
    assert logits.shape == (10, 6) and w.shape == (10, 3) and ids.shape == (10, 3)
    assert ids.dtype == torch.int64 and w.dtype == x.dtype
    probs = torch.softmax(logits, dim=-1)
    top, top_ids = torch.topk(probs, 3, dim=-1)
    assert torch.equal(ids, top_ids)
    assert_close(w, top / top.sum(-1, keepdim=True))
    assert_close(w.sum(-1), torch.ones(10))
    raw = TopKRouter(D, 6, 3, norm_topk_prob=False)
    raw.load_state_dict(router.state_dict())
    assert_close(raw(x)[1], top)


def test_router_is_marked_for_attach_and_validates():
    assert TopKRouter.moebalance_router is True
    with pytest.raises(ValueError, match="top_k"):
        TopKRouter(D, 4, 5)
    with pytest.raises(ValueError, match="num_experts"):
        TopKRouter(D, 0, 1)


def test_attach_records_the_layer_router_choices():
    from moebalance import attach

    moe = ExpertParallelMoE(D, F, 6, 2, one_device_placement(0, 6), seed=1)
    x = batch(1, (9,))
    _, _, ids = moe.router(x)
    tracker = attach(moe)
    moe(x)
    assert_close(tracker.counts()[0].to(torch.int64), torch.bincount(ids.reshape(-1), minlength=6))
    tracker.detach()


# -- the dense reference -----------------------------------------------------------------------


def test_dense_moe_matches_token_by_token_loop():
    dense = DenseMoE(D, F, 5, 2, seed=3).double()
    x = batch(4, (13,), torch.float64)
    assert_close(dense(x), token_loop_moe(dense, x), rtol=1e-12, atol=1e-12)


# -- the expert-parallel layer in one process --------------------------------------------------


@pytest.mark.parametrize("backend", ["torch", "numba"])
@pytest.mark.parametrize("top_k", [1, 3, 8])
def test_layer_matches_dense_outputs_and_gradients(isolated_backends, backend, top_k):
    E = 8
    dense = DenseMoE(D, F, E, top_k, seed=top_k)
    x_all = batch(top_k, (3, 7))
    proj = batch(top_k + 1, (3, 7))
    xd = x_all.clone().requires_grad_()
    (dense(xd) * proj).sum().backward()
    with using_backend("dispatch", backend):
        moe = ExpertParallelMoE.from_dense(dense, one_device_placement(top_k, E))
        x = x_all.clone().requires_grad_()
        out = moe(x)
        (out * proj).sum().backward()
        reduce_replica_gradients(moe)      # nothing to reduce in one process
    assert out.shape == x.shape
    assert_close(out, dense(x_all), rtol=1e-5, atol=1e-6)
    assert_close(x.grad, xd.grad, rtol=1e-5, atol=1e-6)
    assert_close(moe.router.weight.grad, dense.router.weight.grad, rtol=1e-5, atol=1e-6)
    local = torch.tensor(moe.local_experts)
    assert_close(moe.experts.gate_up.grad, dense.experts.gate_up.grad[local], rtol=1e-5, atol=1e-6)
    assert_close(moe.experts.down.grad, dense.experts.down.grad[local], rtol=1e-5, atol=1e-6)


def test_from_dense_copies_each_slot_from_its_expert():
    dense = DenseMoE(D, F, 6, 2, seed=5).double()
    placement = one_device_placement(6, 6, num_layers=3)
    moe = ExpertParallelMoE.from_dense(dense, placement, layer=2)
    assert moe.experts.gate_up.dtype == torch.float64
    assert np.array_equal(moe.local_experts, placement.phy2log[2])
    for slot, e in enumerate(placement.phy2log[2]):
        assert torch.equal(moe.experts.gate_up[slot], dense.experts.gate_up[e])
        assert torch.equal(moe.experts.down[slot], dense.experts.down[e])
    assert torch.equal(moe.router.weight, dense.router.weight)
    with pytest.raises(TypeError, match="dense"):
        ExpertParallelMoE.from_dense(nn.Linear(D, D), placement)


def test_seeded_layer_equals_dense_layer_with_the_same_seed():
    placement = one_device_placement(7, 6)
    moe = ExpertParallelMoE(D, F, 6, 2, placement, seed=11)
    dense = DenseMoE(D, F, 6, 2, seed=11)
    x = batch(8, (10,))
    assert_close(moe(x), dense(x), rtol=1e-5, atol=1e-6)
    other = DenseMoE(D, F, 6, 2, seed=12)
    assert not torch.equal(other.experts.gate_up, dense.experts.gate_up)


def test_unseeded_layers_built_in_turn_differ():
    torch.manual_seed(0)
    a, b = DenseMoE(D, F, 4, 1), DenseMoE(D, F, 4, 1)
    assert not torch.equal(a.experts.gate_up, b.experts.gate_up)
    # Experts of one layer differ from each other too.
    assert not torch.equal(a.experts.gate_up[0], a.experts.gate_up[1])


def test_forward_keeps_leading_dims_and_handles_no_tokens():
    moe = ExpertParallelMoE(D, F, 4, 2, one_device_placement(9, 4), seed=2)
    x = batch(10, (2, 3, 5))
    assert moe(x).shape == (2, 3, 5, D)
    empty = torch.zeros(0, D, requires_grad=True)
    out = moe(empty)
    out.sum().backward()
    assert out.shape == (0, D) and empty.grad.shape == (0, D)
    assert moe.experts.gate_up.grad is not None     # parameters stay in the graph
    with pytest.raises(ValueError, match="hidden_states"):
        moe(torch.zeros(3, D + 1))


def test_bfloat16_layer_is_close_to_float32_dense():
    dense = DenseMoE(D, F, 4, 2, seed=13)
    moe = ExpertParallelMoE.from_dense(dense, one_device_placement(14, 4)).to(torch.bfloat16)
    x = batch(15, (12,))
    out = moe(x.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16
    assert_close(out.float(), dense(x), rtol=5e-2, atol=5e-2)


def test_custom_router_module_is_used():
    class FixedRouter(nn.Module):
        def forward(self, x):
            T = x.shape[0]
            ids = torch.tensor([[0, 2]]).expand(T, 2)
            w = torch.full((T, 2), 0.5, dtype=x.dtype)
            return torch.zeros(T, 3, dtype=x.dtype), w, ids

    moe = ExpertParallelMoE(D, F, 3, 2, one_device_placement(17, 3), router=FixedRouter(), seed=16)
    x = batch(18, (4,))
    slot_of = {int(e): s for s, e in enumerate(moe.local_experts)}
    ref = 0.5 * (swiglu(x, moe.experts.gate_up[slot_of[0]], moe.experts.down[slot_of[0]])
                 + swiglu(x, moe.experts.gate_up[slot_of[2]], moe.experts.down[slot_of[2]]))
    assert_close(moe(x), ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError, match="router"):
        ExpertParallelMoE(D, F, 3, 2, one_device_placement(17, 3), router=lambda x: x)


# -- the dispatcher in one process -------------------------------------------------------------


def dispatch_inputs(seed: int, T: int, K: int, E: int, dtype=torch.float64, hidden: int = D):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, hidden, generator=gen, dtype=dtype)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]) if T else \
        torch.zeros(0, K, dtype=torch.int64)
    w = torch.rand(T, K, generator=gen, dtype=dtype)
    return x, ids, w


def slot_scaled_roundtrip(dispatcher, placement, x, ids, w):
    """dispatch, scale the rows of local slot s by (s + 1)^2, combine."""
    recv, handle = dispatcher.dispatch(x, ids, w, placement, 0)
    counts = torch.tensor(handle.tokens_per_local_slot)
    scale = torch.repeat_interleave((torch.arange(len(counts), dtype=x.dtype) + 1) ** 2, counts)
    return dispatcher.combine(recv * scale[:, None] + recv ** 2, handle)


@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_dispatch_combine_gradients_pass_gradcheck(isolated_backends, backend):
    placement = one_device_placement(20, 5)
    dispatcher = Dispatcher()
    x, ids, w = dispatch_inputs(21, 5, 3, 5, hidden=3)
    x.requires_grad_()
    w.requires_grad_()
    with using_backend("dispatch", backend):
        assert torch.autograd.gradcheck(
            lambda x, w: slot_scaled_roundtrip(dispatcher, placement, x, ids, w), (x, w))


def test_dispatch_groups_rows_by_slot_and_combine_inverts_it():
    placement = one_device_placement(22, 5)
    dispatcher = Dispatcher()
    x, ids, w = dispatch_inputs(23, 9, 2, 5)
    recv, handle = dispatcher.dispatch(x, ids, w, placement, 0)
    assert isinstance(handle, DispatchHandle) and handle.num_tokens == 9
    start = 0
    for slot, n in enumerate(handle.tokens_per_local_slot):
        expert = placement.phy2log[0, slot]
        tokens = torch.where(ids == expert)[0]
        assert n == tokens.numel()
        assert torch.equal(recv[start:start + n], x[tokens])       # ascending token order
        start += n
    assert_close(dispatcher.combine(recv, handle), w.sum(1, keepdim=True) * x)


def test_dispatcher_rejects_bad_input_naming_the_argument():
    E = 5
    placement = one_device_placement(24, E)
    dispatcher = Dispatcher()
    x, ids, w = dispatch_inputs(25, 4, 2, E)
    for bad in (E, -1):
        bad_ids = ids.clone()
        bad_ids[1, 0] = bad
        with pytest.raises(ValueError, match=r"topk_ids_TK holds 1 expert ids outside \[0, 5\)"):
            dispatcher.dispatch(x, bad_ids, w, placement, 0)
    with pytest.raises(ValueError, match="topk_ids_TK"):
        dispatcher.dispatch(x, ids.float(), w, placement, 0)
    with pytest.raises(ValueError, match="topk_weights_TK"):
        dispatcher.dispatch(x, ids, w.T, placement, 0)
    with pytest.raises(ValueError, match="x_TD"):
        dispatcher.dispatch(x.unsqueeze(0), ids, w, placement, 0)
    with pytest.raises(TypeError, match="x_TD"):
        dispatcher.dispatch(x.numpy(), ids, w, placement, 0)
    with pytest.raises(ValueError, match=r"layer must be in \[0, 1\)"):
        dispatcher.dispatch(x, ids, w, placement, 1)
    with pytest.raises(TypeError, match="placement"):
        dispatcher.dispatch(x, ids, w, placement.phy2log, 0)
    two = Placement(np.array([[0, 1, 2, 3, 4, 0]]), np.array([[0.5, 1, 1, 1, 1, 0.5]]),
                    np.array([0, 0, 0, 1, 1, 1]), E)
    with pytest.raises(ValueError, match="placement spans 2 devices but the process group has 1"):
        dispatcher.dispatch(x, ids, w, two, 0)
    recv, handle = dispatcher.dispatch(x, ids, w, placement, 0)
    with pytest.raises(ValueError, match="y_MD"):
        dispatcher.combine(recv[:, None], handle)
    with pytest.raises(TypeError, match="handle"):
        dispatcher.combine(recv, None)
    with pytest.raises(ValueError, match="num_experts"):
        ExpertParallelMoE(D, F, E + 1, 2, placement)


def test_replica_tables_are_cached_per_placement_and_layer():
    placement = one_device_placement(26, 4, num_layers=2)
    dispatcher = Dispatcher()
    x, ids, w = dispatch_inputs(27, 3, 1, 4)
    dispatcher.dispatch(x, ids, w, placement, 1)
    state = dispatcher._states[id(placement)]
    table = state.layer(1, x.device).table
    dispatcher.dispatch(x, ids, w, placement, 1)
    assert state.layer(1, x.device).table is table
    other = Placement(placement.phy2log[::-1].copy(), placement.share, placement.slot_device, 4)
    dispatcher.dispatch(x, ids, w, other, 1)
    assert dispatcher._states[id(other)].placement is other


def test_debug_dispatcher_rejects_non_finite_values():
    placement = one_device_placement(28, 4)
    dispatcher = Dispatcher(debug=True)
    x, ids, w = dispatch_inputs(29, 3, 2, 4)
    bad_w = w.clone()
    bad_w[0, 1] = float("nan")
    with pytest.raises(ValueError, match="topk_weights_TK"):
        dispatcher.dispatch(x, ids, bad_w, placement, 0)
    bad_x = x.clone()
    bad_x[2, 0] = float("inf")
    with pytest.raises(ValueError, match="x_TD"):
        dispatcher.dispatch(bad_x, ids, w, placement, 0)


def test_dispatcher_with_a_group_needs_torch_distributed():
    with pytest.raises(ValueError, match="init_process_group"):
        Dispatcher(group=object())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_non_finite_gradients_match_the_elementwise_check(dtype):
    from moebalance.collective_errors import non_finite

    gen = torch.Generator().manual_seed(3)
    for trial in range(40):
        params = [nn.Parameter(torch.empty(shape, dtype=dtype))
                  for shape in [(3, 8, 16), (0, 4), (5,), (2, 16, 8)]]
        for p in params[trial % 2:]:
            p.grad = (torch.randn(p.shape, generator=gen) * 1e3).to(dtype)
        if trial % 4:
            victim = params[1 + int(torch.randint(3, (1,), generator=gen))]
            if victim.grad is not None and victim.grad.numel():
                where = int(torch.randint(victim.grad.numel(), (1,), generator=gen))
                victim.grad.view(-1)[where] = [float("nan"), float("inf"), -float("inf")][trial % 3]
        expected = not all(bool(p.grad.isfinite().all()) for p in params if p.grad is not None)
        assert bool(non_finite(params)) == expected, trial
    assert not bool(non_finite([nn.Parameter(torch.zeros(2))]))  # no gradient yet


def test_layer_builds_under_a_default_device():
    # Lightning's configure_model runs under `with torch.device(root_device)`: the layer's
    # CPU generators must draw on the CPU there (a CUDA default device refuses them as meta does).
    placement = Placement(np.arange(8)[None], np.ones((1, 8)), np.zeros(8, dtype=np.int64), 8)
    with torch.device("meta"):
        moe = ExpertParallelMoE(16, 32, 8, 2, placement, 0, seed=5)
    assert moe.experts.gate_up.device.type == "meta"
    with torch.device("meta"):
        unseeded = ExpertParallelMoE(16, 32, 8, 2, placement, 0)
    assert unseeded.experts.down.device.type == "meta"
