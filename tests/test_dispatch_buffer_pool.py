"""The Dispatcher's CPU buffer pool: buffers come back only when nothing references them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _dist import case_id, shared_spawn
from torch.testing import assert_close

from moebalance.dispatch import Dispatcher
from moebalance.dispatch.buffers import _BufferPool, release_buffers
from moebalance.placement import Placement

CPU = torch.device("cpu")
BIG = (1024, 512)   # 2 MiB of float32: above the pool's minimum size


def one_rank_placement(num_experts: int = 4) -> Placement:
    return Placement(np.arange(num_experts)[None], np.ones((1, num_experts)),
                     np.zeros(num_experts, dtype=np.int64), num_experts).validate()


def replicated_placement(num_ranks: int) -> Placement:
    """Three slots per rank: experts 2r, 2r+1 and a replica of expert (2r+2) mod 2G."""
    E = 2 * num_ranks
    phy2log = np.array([[e for r in range(num_ranks) for e in (2 * r, 2 * r + 1, (2 * r + 2) % E)]])
    share = 1.0 / np.bincount(phy2log[0], minlength=E)[phy2log]
    return Placement(phy2log, share, np.repeat(np.arange(num_ranks), 3), E).validate()


def routed_batch(seed: int, T: int = 1024, D: int = 256, K: int = 2, E: int = 4):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    return x, ids, torch.rand(T, K, generator=gen)


def test_pool_lends_a_released_buffer_again():
    pool = _BufferPool()
    first = pool.empty(BIG, torch.float32, CPU)
    ptr = first.data_ptr()
    del first
    assert pool.empty(BIG, torch.float32, CPU).data_ptr() == ptr


def test_pool_never_lends_a_buffer_that_is_still_referenced():
    pool = _BufferPool()
    held = pool.empty(BIG, torch.float32, CPU)
    view = held[:3]
    array = pool.empty(BIG, torch.float32, CPU).numpy()
    del held
    taken = {view.untyped_storage().data_ptr(), array.ctypes.data}
    for _ in range(3):
        assert pool.empty(BIG, torch.float32, CPU).data_ptr() not in taken


def test_pool_leaves_small_buffers_to_the_allocator():
    pool = _BufferPool()
    pool.empty((8, 8), torch.float32, CPU)
    assert pool._storages == []


def test_dispatch_outputs_kept_by_the_caller_survive_later_dispatches():
    release_buffers()
    placement, dispatcher = one_rank_placement(), Dispatcher()
    x, ids, w = routed_batch(0)
    recv, handle = dispatcher.dispatch(x, ids, w, placement, 0)
    out = dispatcher.combine(recv * 2, handle)
    recv_copy, out_copy = recv.clone(), out.clone()
    for seed in (1, 2):
        x2, ids2, w2 = routed_batch(seed)
        recv2, handle2 = dispatcher.dispatch(x2, ids2, w2, placement, 0)
        dispatcher.combine(recv2, handle2)
    assert torch.equal(recv, recv_copy) and torch.equal(out, out_copy)


def test_gradients_are_right_when_other_dispatches_run_before_backward():
    release_buffers()
    placement, dispatcher = one_rank_placement(), Dispatcher()
    x0, ids, w0 = routed_batch(3)
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    proj = torch.randn(x.shape, generator=torch.Generator().manual_seed(4))
    recv, handle = dispatcher.dispatch(x, ids, w, placement, 0)
    out = dispatcher.combine(recv * 2, handle)          # every expert doubles its rows
    for seed in (5, 6):                                  # reuse whatever the pool may lend
        x2, ids2, w2 = routed_batch(seed)
        recv2, handle2 = dispatcher.dispatch(x2, ids2, w2, placement, 0)
        dispatcher.combine(recv2, handle2)
    (out * proj).sum().backward()
    assert_close(x.grad, 2 * w0.sum(1, keepdim=True) * proj, rtol=1e-5, atol=1e-5)
    expected_w = (2 * (proj * x0).sum(1, keepdim=True)).expand_as(w0)
    assert_close(w.grad, expected_w, rtol=1e-5, atol=1e-4)


# -- on 4 gloo ranks: rows saved for backward live in pooled buffers --------------------------


def saved_rows_and_outputs_survive_later_dispatches_on_four_ranks():
    """Every buffer pooled (minimum size 0); two more dispatch + combine calls run between a
    forward and its backward; outputs and gradients must be untouched by them, with either row
    exchange (all_to_all also pools the rows before and after its reorder)."""
    rank, saved_min = dist.get_rank(), _BufferPool.MIN_BYTES
    _BufferPool.MIN_BYTES = 0
    try:
        for exchange in ("p2p", "all_to_all"):
            release_buffers()
            placement = replicated_placement(dist.get_world_size())
            dispatcher = Dispatcher(exchange=exchange)
            E = placement.num_experts
            x0, ids, w0 = routed_batch(10 + rank, T=40 + 7 * rank, D=8, K=3, E=E)
            x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
            proj = torch.randn(x.shape, generator=torch.Generator().manual_seed(20 + rank))
            recv, handle = dispatcher.dispatch(x, ids, w, placement, 0)
            out = dispatcher.combine(recv * 2, handle)
            out_copy = out.detach().clone()
            for seed in (30, 40):
                x2, ids2, w2 = routed_batch(seed + rank, T=40 + 7 * rank, D=8, K=3, E=E)
                recv2, handle2 = dispatcher.dispatch(x2, ids2, w2, placement, 0)
                dispatcher.combine(recv2 * 3, handle2)
            assert torch.equal(out.detach(), out_copy), f"{exchange}: output overwritten"
            (out * proj).sum().backward()
            tol = dict(rtol=1e-5, atol=1e-5, msg=lambda m, e=exchange: f"exchange={e}: {m}")
            assert_close(x.grad, 2 * w0.sum(1, keepdim=True) * proj, **tol)
            assert_close(w.grad, (2 * (proj * x0).sum(1, keepdim=True)).expand_as(w0), **tol)
    finally:
        _BufferPool.MIN_BYTES = saved_min
        release_buffers()


CASES = [saved_rows_and_outputs_survive_later_dispatches_on_four_ranks]


dist_results = shared_spawn(CASES, __name__, world_size=4)


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_on_four_gloo_ranks(dist_results, case):
    dist_results.check(case)
