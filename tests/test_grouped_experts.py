"""Grouped-GEMM experts: SlotExperts through torch._grouped_mm equal the slot loop (the
reference), forward and backward, fp32 and bf16, with empty slots; the loop runs where the
grouped GEMM cannot."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from moebalance.nn.moe import SlotExperts, grouped_mm_runs, grouped_swiglu, looped_swiglu

needs_grouped_mm = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"),
                                      reason="this torch has no _grouped_mm")


def _experts(seed: int, slots: int, D: int, F: int, dtype) -> SlotExperts:
    experts = SlotExperts(slots, D, F)
    for s in range(slots):
        experts.init_slot(s, seed, s)
    return experts.to(dtype)


def _rows(seed: int, slots: int, D: int, dtype):
    gen = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 40, (slots,), generator=gen)
    counts[1] = 0                                 # a slot without rows
    x = torch.randn(int(counts.sum()), D, generator=gen).to(dtype)
    return x, counts.tolist()


def _forward_backward(fn, experts: SlotExperts, x, counts, seed: int):
    experts.zero_grad()
    x = x.clone().requires_grad_()
    y = fn(x, experts.gate_up, experts.down, counts)
    proj = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed)).to(y.dtype)
    (y * proj).sum().backward()
    return y.detach(), x.grad, experts.gate_up.grad.clone(), experts.down.grad.clone()


@needs_grouped_mm
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("slots", [8, 13])
def test_grouped_experts_equal_the_slot_loop_forward_and_backward(dtype, tol, slots):
    D, F = 32, 24
    experts = _experts(1, slots, D, F, dtype)
    x, counts = _rows(2, slots, D, dtype)
    assert grouped_mm_runs(x, F)
    grouped = _forward_backward(grouped_swiglu, experts, x, counts, seed=3)
    looped = _forward_backward(looped_swiglu, experts, x, counts, seed=3)
    for name, got, want in zip(("y", "x.grad", "gate_up.grad", "down.grad"), grouped, looped):
        assert got.dtype == want.dtype == dtype
        assert_close(got.float(), want.float(), rtol=tol, atol=tol, msg=name)


@needs_grouped_mm
def test_grouped_experts_take_counts_as_a_tensor_and_zero_rows():
    experts = _experts(4, 8, 16, 16, torch.float32)
    x, counts = _rows(5, 8, 16, torch.float32)
    assert_close(grouped_swiglu(x, experts.gate_up, experts.down, torch.tensor(counts)),
                 looped_swiglu(x, experts.gate_up, experts.down, counts), rtol=1e-5, atol=1e-6)
    x = x.clone().requires_grad_()
    experts(x, counts).sum().backward()               # a stride-0 gradient is handled
    assert experts.gate_up.grad is not None
    empty = torch.zeros(0, 16, requires_grad=True)
    assert not grouped_mm_runs(empty, 16)             # no rows: the loop runs
    y = experts(empty, [0] * 8)
    y.sum().backward()
    assert y.shape == (0, 16)


def test_slot_experts_fall_back_to_the_loop_where_the_grouped_gemm_cannot_run():
    # float64, and rows of 5 float32 (20 bytes, not a multiple of 16): the loop runs.
    for dtype, D, F in ((torch.float64, 16, 16), (torch.float32, 5, 7)):
        experts = _experts(6, 8, D, F, dtype)
        x, counts = _rows(7, 8, D, dtype)
        assert not grouped_mm_runs(x, F)
        assert torch.equal(experts(x, counts),
                           looped_swiglu(x, experts.gate_up, experts.down, counts))


@needs_grouped_mm
def test_use_grouped_mm_false_forces_the_loop():
    experts = _experts(8, 8, 16, 16, torch.float32)
    x, counts = _rows(9, 8, 16, torch.float32)
    experts.use_grouped_mm = False
    assert torch.equal(experts(x, counts), looped_swiglu(x, experts.gate_up, experts.down, counts))


@needs_grouped_mm
def test_slot_experts_under_autocast_run_the_loop_that_autocast_casts():
    # bf16 rows against fp32 weights (torch.autocast with fp32 master weights): _grouped_mm
    # takes one dtype and autocast does not cast it; the loop's matmuls are cast.
    experts = _experts(8, 8, 32, 24, torch.float32)
    x, counts = _rows(9, 8, 32, torch.bfloat16)
    assert grouped_mm_runs(x, 24)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = experts(x, counts)
        want = looped_swiglu(x, experts.gate_up, experts.down, counts)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
