"""Live rebalancing on 4 gloo ranks: migrations keep the math, replicas agree, faults lose nothing.

All cases run in ONE spawn of 4 ranks (see ``_dist.py``). A small model of two ExpertParallelMoE
layers trains on a fixed global batch stream (each rank its slice); a run that migrates to new
placements (layers moving one by one, transfers in flight across steps) must reach the losses,
weights and optimizer state of a run that never moves.
"""

from __future__ import annotations

import copy
import hashlib
import os
import tempfile

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _dist import case_id, shared_spawn
from test_dispatcher_distributed import random_placement
from torch import nn
from torch.testing import assert_close

import moebalance as mb
from moebalance import checkpoint
from moebalance.migrate import Migration, MigrationError, plan_migration
from moebalance.nn import checkpoint as nn_checkpoint
from moebalance.nn.moe import (
    DenseMoE,
    ExpertParallelMoE,
    apply_placement,
    current_placement,
    moe_layers,
)
from moebalance.planner.steps import planning_window

WORLD = 4
D, F, E, K = 8, 6, 8, 2
SLOTS = [3, 3, 3, 3]
TOKENS = 24                      # per rank and step


# -- helpers (run inside the workers) ---------------------------------------------------------


class Net(nn.Module):
    """Two expert-parallel layers, each rank its own tokens; DenseMoE layers when ``dense``."""

    def __init__(self, placement, dtype, *, group=None, dense=False, grad_sync="backward"):
        super().__init__()
        if dense:
            self.l0 = DenseMoE(D, F, E, K, seed=11)
            self.l1 = DenseMoE(D, F, E, K, seed=12)
        else:
            self.l0 = ExpertParallelMoE(D, F, E, K, placement, 0, group, seed=11,
                                        grad_sync=grad_sync)
            self.l1 = ExpertParallelMoE(D, F, E, K, placement, 1, group, seed=12,
                                        grad_sync=grad_sync)
        self.to(dtype)

    def forward(self, x):
        return self.l1(torch.tanh(self.l0(x)))


def batch(step: int, dtype, world=WORLD, rank=None):
    """This rank's slice of step ``step``'s global batch (x, target)."""
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(world * TOKENS, D, generator=gen, dtype=torch.float64)
    target = torch.randn(world * TOKENS, D, generator=gen, dtype=torch.float64)
    rank = dist.get_rank() if rank is None else rank
    sl = slice(rank * TOKENS, (rank + 1) * TOKENS)
    return x[sl].to(dtype), target[sl].to(dtype)


def make_optimizer(model, kind: str):
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=0.01, amsgrad=True)
    # The multi-tensor forms GPU trainers get by default (foreach) or ask for (fused): their
    # state ("step" a tensor beside each parameter) must move with the experts like the loop's.
    form = {"adamw-foreach": dict(foreach=True), "adamw-fused": dict(fused=True)}[kind]
    return torch.optim.AdamW(model.parameters(), lr=0.01, **form)


def train_step(model, optimizer, step, dtype, world=WORLD, group=None) -> float:
    x, target = batch(step, dtype, world, rank=dist.get_rank(group))
    optimizer.zero_grad()
    loss = (model(x) - target).pow(2).sum() / (world * TOKENS)
    loss.backward()
    optimizer.step()
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    return float(total)


def slot_digests(model):
    """[(layer, local experts, digest of each local slot's rows)] for every MoE layer."""
    out = []
    for layer in moe_layers(model):
        digests = []
        for s in range(layer.experts.num_slots):
            h = hashlib.sha256()
            for p in (layer.experts.gate_up, layer.experts.down):
                h.update(p.detach()[s].contiguous().numpy().tobytes())
            digests.append(h.hexdigest())
        out.append((layer.layer, layer.local_experts.tolist(), digests))
    return out


def assert_replicas_identical(model):
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, slot_digests(model))
    for i, _ in enumerate(moe_layers(model)):
        seen = {}
        for rank_layers in everyone:
            layer, experts, digests = rank_layers[i]
            for e, d in zip(experts, digests):
                assert seen.setdefault(e, d) == d, f"layer {layer}: replicas of expert {e} differ"


def placements_for(seed: int):
    return random_placement(seed, E, SLOTS, num_layers=2)


_RUNS: dict = {}


def run(kind: str, dtype, schedule: dict, steps: int = 16, max_bytes=None):
    """Train ``steps`` steps; after step s in ``schedule`` apply schedule[s] without blocking.

    Returns (losses, logical state of model and optimizer at the end, migration reports).
    """
    key = (kind, dtype, tuple(sorted(schedule)), steps, max_bytes)
    if key in _RUNS:
        return _RUNS[key]
    model = Net(placements_for(0), dtype)
    optimizer = make_optimizer(model, kind)
    losses, migrations = [], []
    for step in range(steps):
        losses.append(train_step(model, optimizer, step, dtype))
        assert_replicas_identical(model)
        if step in schedule:
            row_bytes = 2 * (2 * F * D + D * F) * torch.finfo(dtype).bits // 8
            migrations.append(apply_placement(model, schedule[step], optimizer, blocking=False,
                                              max_bytes_in_flight=max_bytes and row_bytes))
    for migration in migrations:
        migration.wait()
    result = (losses, checkpoint.expert_state_dict(model, optimizer),
              [m.report() for m in migrations])
    _RUNS[key] = result
    return result


# Four placements, three steps apart: each migration (one layer per step when bytes in flight
# are bounded) lands before the next starts, and four steps train on the last one.
SCHEDULE = {2: placements_for(1), 5: placements_for(2), 8: placements_for(3),
            11: placements_for(4)}


def compare_states(a: dict, b: dict, rtol: float, atol: float):
    for key, value in a["model"].items():
        assert_close(b["model"][key], value, rtol=rtol, atol=atol, msg=lambda m: f"{key}: {m}")
    for fqn, entry in a["optimizer"]["state"].items():
        other = b["optimizer"]["state"][fqn]
        assert entry["logical"].keys() == other["logical"].keys()
        for name, value in entry["logical"].items():
            assert_close(other["logical"][name], value, rtol=rtol, atol=atol,
                         msg=lambda m: f"{fqn}.{name}: {m}")


# -- cases ----------------------------------------------------------------------------------------


def rebalanced_run_matches_fixed_run_sgd_momentum_fp64():
    fixed_losses, fixed_state, _ = run("sgd", torch.float64, {})
    losses, state, reports = run("sgd", torch.float64, SCHEDULE, max_bytes=1)
    assert sum(r["moves"] for r in reports) > 0 and all(r["error"] is None for r in reports)
    # Layers moved one at a time (bytes in flight bounded): some migrations spanned steps.
    assert max(r["optimizer_steps"] for r in reports) >= 1
    np.testing.assert_allclose(losses, fixed_losses, rtol=1e-10, atol=0)
    compare_states(fixed_state, state, rtol=1e-10, atol=1e-13)


def rebalanced_run_matches_fixed_run_adamw_fp32():
    fixed_losses, fixed_state, _ = run("adamw", torch.float32, {})
    losses, state, reports = run("adamw", torch.float32, SCHEDULE)
    assert sum(r["moves"] for r in reports) > 0
    np.testing.assert_allclose(losses, fixed_losses, rtol=1e-5, atol=0)
    compare_states(fixed_state, state, rtol=1e-4, atol=1e-6)


def rebalanced_run_matches_fixed_run_adamw_fp64():
    fixed_losses, fixed_state, _ = run("adamw", torch.float64, {})
    losses, state, reports = run("adamw", torch.float64, SCHEDULE, max_bytes=1)
    assert sum(r["moves"] for r in reports) > 0
    np.testing.assert_allclose(losses, fixed_losses, rtol=1e-10, atol=0)
    compare_states(fixed_state, state, rtol=1e-9, atol=1e-12)


def rebalanced_run_matches_fixed_run_sgd_momentum_fp32():
    fixed_losses, fixed_state, _ = run("sgd", torch.float32, {})
    losses, state, reports = run("sgd", torch.float32, SCHEDULE)
    assert sum(r["moves"] for r in reports) > 0
    np.testing.assert_allclose(losses, fixed_losses, rtol=1e-5, atol=0)
    compare_states(fixed_state, state, rtol=1e-4, atol=1e-6)


def rebalanced_run_matches_fixed_run_foreach_and_fused_adamw_fp32():
    for kind in ("adamw-foreach", "adamw-fused"):
        fixed_losses, fixed_state, _ = run(kind, torch.float32, {})
        losses, state, reports = run(kind, torch.float32, SCHEDULE, max_bytes=1)
        assert sum(r["moves"] for r in reports) > 0, kind
        np.testing.assert_allclose(losses, fixed_losses, rtol=1e-5, atol=0, err_msg=kind)
        compare_states(fixed_state, state, rtol=1e-4, atol=1e-6)


def fused_adamw_resumed_under_another_placement_steps_on_like_the_saved_one():
    """The Trainer's default optimizer, saved by logical expert and loaded under another
    placement: its ``step`` tensors go beside the parameters, as the fused kernel needs."""
    dtype = torch.float32
    model = Net(placements_for(0), dtype)
    optimizer = make_optimizer(model, "adamw-fused")
    for step in range(3):
        train_step(model, optimizer, step, dtype)
    saved = checkpoint.expert_state_dict(model, optimizer)
    resumed = Net(placements_for(6), dtype)
    resumed_optimizer = make_optimizer(resumed, "adamw-fused")
    checkpoint.load_expert_state_dict(resumed, saved, resumed_optimizer)
    for step in range(3, 6):
        expected = train_step(model, optimizer, step, dtype)
        assert train_step(resumed, resumed_optimizer, step, dtype) == pytest.approx(expected,
                                                                                   rel=1e-5)
    compare_states(checkpoint.expert_state_dict(model, optimizer),
                   checkpoint.expert_state_dict(resumed, resumed_optimizer), rtol=1e-4, atol=1e-6)


def ema_and_reference_copies_follow_the_live_migrations_fp64():
    """An EMA of the model (``AveragedModel``, a deepcopy) and a frozen deepcopy, made before
    four live re-plans: the EMA equals the EMA of each logical expert, the frozen copy keeps its
    experts and answers as before."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    dtype = torch.float64
    model = Net(placements_for(0), dtype)
    optimizer = make_optimizer(model, "sgd")
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.5))
    frozen = copy.deepcopy(model)
    x0, _ = batch(0, dtype)
    with torch.no_grad():
        frozen_out = frozen(x0)
    frozen_state = checkpoint.expert_state_dict(frozen)["model"]
    expected = None
    for step in range(12):
        train_step(model, optimizer, step, dtype)
        ema.update_parameters(model)
        now = checkpoint.expert_state_dict(model)["model"]
        expected = now if expected is None else {k: 0.5 * expected[k] + 0.5 * now[k] for k in now}
        if step in SCHEDULE:
            apply_placement(model, SCHEDULE[step], optimizer, blocking=False)
    for layer in moe_layers(model):
        if layer.pending_migration is not None:
            layer.pending_migration.wait()
    # both copies moved with the layers (the frozen one's rows keep their experts)
    for twin in (ema.module, frozen):
        assert (current_placement(twin).phy2log == current_placement(model).phy2log).all()
    assert not (current_placement(model).phy2log == placements_for(0).phy2log).all()
    got = checkpoint.expert_state_dict(ema.module)["model"]
    for key, value in expected.items():
        assert_close(got[key], value, rtol=1e-12, atol=1e-12, msg=lambda m: f"{key}: {m}")
    for key, value in checkpoint.expert_state_dict(frozen)["model"].items():
        assert_close(value, frozen_state[key], rtol=0, atol=0, msg=lambda m: f"{key}: {m}")
    with torch.no_grad():
        assert_close(frozen(x0), frozen_out, rtol=1e-12, atol=1e-12)


def a_copy_on_one_rank_only_is_refused_on_every_rank_at_the_commit():
    dtype = torch.float64
    model = Net(placements_for(0), dtype)
    optimizer = make_optimizer(model, "sgd")
    kept = copy.deepcopy(model) if dist.get_rank() == 0 else None
    train_step(model, optimizer, 0, dtype)
    apply_placement(model, SCHEDULE[2], optimizer, blocking=False)
    x, _ = batch(1, dtype)
    for _ in moe_layers(model):     # each layer refuses at its commit, the first forward after
        with pytest.raises(mb.GroupError, match="make them on every rank"):
            model(x)
    # the layers went on to the new placement (the copy stays behind) and train on
    train_step(model, optimizer, 1, dtype)
    assert not (current_placement(model).phy2log == placements_for(0).phy2log).all()
    assert_replicas_identical(model)
    del kept


def moved_expert_optimizer_state_equals_unmoved_state_fp64():
    _, fixed_state, _ = run("sgd", torch.float64, {})
    _, state, _ = run("sgd", torch.float64, SCHEDULE, max_bytes=1)
    for _fqn, entry in fixed_state["optimizer"]["state"].items():
        if entry["logical"]:
            assert "momentum_buffer" in entry["logical"]
    compare_states(fixed_state, state, rtol=1e-10, atol=1e-13)
    # Adam's moments (and amsgrad's max) too, in fp64.
    model_a, model_b = Net(placements_for(0), torch.float64), Net(placements_for(0), torch.float64)
    opt_a, opt_b = make_optimizer(model_a, "adamw"), make_optimizer(model_b, "adamw")
    for step in range(6):
        train_step(model_a, opt_a, step, torch.float64)
        train_step(model_b, opt_b, step, torch.float64)
        if step == 2:
            apply_placement(model_b, placements_for(7), opt_b)
    a = checkpoint.expert_state_dict(model_a, opt_a)
    b = checkpoint.expert_state_dict(model_b, opt_b)
    names = {n for entry in a["optimizer"]["state"].values() for n in entry["logical"]}
    assert {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"} <= names
    compare_states(a, b, rtol=1e-10, atol=1e-13)


def live_placement_attributes_are_read_only():
    model = Net(placements_for(0), torch.float32)
    for name in ("placement", "layer", "local_experts"):
        with pytest.raises(AttributeError, match="apply_placement"):
            setattr(model.l0, name, getattr(model.l0, name))
    with pytest.raises(ValueError, match="read-only"):
        model.l0.local_experts[0] = 3


def apply_placement_rejects_another_topology():
    model = Net(placements_for(0), torch.float32)
    other = random_placement(0, E, [4, 2, 3, 3], num_layers=2)
    with pytest.raises(ValueError, match="keeps each device's slots"):
        apply_placement(model, other)


def _trained(dtype=torch.float64):
    model = Net(placements_for(0), dtype)
    optimizer = make_optimizer(model, "adamw")
    for step in range(2):
        train_step(model, optimizer, step, dtype)
    return model, optimizer


def _snapshot(model, optimizer):
    rows = [p.detach().clone() for p in model.parameters()]
    state = {id(p): {k: v.clone() for k, v in optimizer.state[p].items()}
             for p in model.parameters()}
    return current_placement(model), rows, state


def _assert_unchanged(model, optimizer, snap):
    placement, rows, state = snap
    assert current_placement(model) == placement
    for p, before in zip(model.parameters(), rows):
        assert torch.equal(p.detach(), before)
        for k, v in state[id(p)].items():
            assert torch.equal(optimizer.state[p][k], v), k


def _failing_placement(source_rank: int):
    """A new placement whose migration needs rows sent by ``source_rank``."""
    base = placements_for(0)
    for seed in range(100, 200):
        new = placements_for(seed)
        plan = plan_migration(base, new)
        if np.any((plan.src_rank_M == source_rank) & (plan.dst_rank_M != source_rank)):
            return new
    raise AssertionError("no such placement")


def _expect_same_error_everywhere(model, optimizer, new, faulty_rank, fault):
    snap = _snapshot(model, optimizer)
    original = Migration._issue
    if dist.get_rank() == faulty_rank:
        Migration._issue = fault
    try:
        with pytest.raises(MigrationError) as info:
            apply_placement(model, new, optimizer, timeout_s=3.0)
    finally:
        Migration._issue = original
    message = str(info.value)
    everyone = [None] * WORLD
    dist.all_gather_object(everyone, message)
    assert len(set(everyone)) == 1, everyone
    assert (f"rank {faulty_rank}" in message or "Timed out" in message
            or "timed out" in message.lower())
    _assert_unchanged(model, optimizer, snap)
    assert all(layer.pending_migration is None for layer in moe_layers(model))
    # The next attempt goes through.
    migration = apply_placement(model, new, optimizer)
    assert current_placement(model) == migration.plan.target
    assert_replicas_identical(model)
    train_step(model, optimizer, 5, torch.float64)
    assert_replicas_identical(model)
    return message


def failed_transfer_on_one_rank_keeps_old_placement_everywhere():
    model, optimizer = _trained()

    def raising(self, ops):
        raise RuntimeError("injected transfer fault")

    message = _expect_same_error_everywhere(model, optimizer, _failing_placement(3), 3, raising)
    assert "injected transfer fault" in message


def rank_that_never_sends_fails_migration_without_hang():
    model, optimizer = _trained()

    def receive_only(self, ops):
        return original_issue(self, [op for op in ops if not op[0]])

    original_issue = Migration._issue
    _expect_same_error_everywhere(model, optimizer, _failing_placement(2), 2, receive_only)


def checkpoint_by_logical_expert_loads_into_other_placement_world_size_and_dense():
    dtype = torch.float64
    model, optimizer = _trained(dtype)
    apply_placement(model, placements_for(5), optimizer)
    box = [tempfile.mkdtemp(prefix="moebalance-ckpt-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, group_src=0)
    path = os.path.join(box[0], "experts.pt")
    checkpoint.save(path, model, optimizer)
    saved = checkpoint.expert_state_dict(model, optimizer)
    # Gathered one expert at a time, as a layer too large for a GPU is: the same bits.
    chunk_bytes = nn_checkpoint.GATHER_CHUNK_BYTES
    nn_checkpoint.GATHER_CHUNK_BYTES = 1
    try:
        compare_states(saved, checkpoint.expert_state_dict(model, optimizer), rtol=0, atol=0)
    finally:
        nn_checkpoint.GATHER_CHUNK_BYTES = chunk_bytes
    x_all = torch.cat([batch(99, dtype, rank=r)[0] for r in range(WORLD)])

    dense = Net(None, dtype, dense=True)
    dense.load_state_dict(saved["model"])
    reference = dense(x_all)
    rank = dist.get_rank()
    assert_close(model(x_all[rank * TOKENS:(rank + 1) * TOKENS]),
                 reference[rank * TOKENS:(rank + 1) * TOKENS], rtol=1e-10, atol=1e-12)

    pair = dist.new_group([0, 1])
    if rank < 2:
        two = random_placement(3, E, [5, 5], num_layers=2)
        small = Net(two, dtype, group=pair)
        small_opt = make_optimizer(small, "adamw")
        placement = checkpoint.load(path, small, small_opt)
        assert placement == current_placement(model)
        half = 2 * TOKENS
        assert_close(small(x_all[rank * half:(rank + 1) * half]),
                     reference[rank * half:(rank + 1) * half], rtol=1e-10, atol=1e-12)
        again = checkpoint.expert_state_dict(small, small_opt)
        compare_states(saved, again, rtol=0, atol=0)
        # The restored optimizer steps on as the saved one would.
        for fqn, entry in saved["optimizer"]["state"].items():
            assert again["optimizer"]["state"][fqn]["other"].keys() == entry["other"].keys()
    dist.barrier()
    if rank == 0:
        os.remove(path)
        os.rmdir(box[0])


def per_rank_state_dict_resumes_its_placement():
    dtype = torch.float64
    model, optimizer = _trained(dtype)
    apply_placement(model, placements_for(6), optimizer)
    state = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k,
             v in model.state_dict().items()}
    resumed = Net(placements_for(0), dtype)
    resumed.load_state_dict(state)
    assert current_placement(resumed) == current_placement(model)
    x, _ = batch(7, dtype)
    assert torch.equal(resumed(x), model(x))


def rank0s_state_dict_is_refused_on_the_other_ranks():
    # The data-parallel habit: rank 0 saves model.state_dict(), every rank loads it. Its slot
    # rows are rank 0's experts: the other ranks refuse it before any row changes.
    dtype = torch.float64
    model, _ = _trained(dtype)
    state = [{k: (v.clone() if isinstance(v, torch.Tensor) else v)
              for k, v in model.state_dict().items()}]
    dist.broadcast_object_list(state, src=0)
    resumed = Net(placements_for(0), dtype)
    rows = [p.detach().clone() for p in resumed.parameters()]
    if dist.get_rank() == 0:
        resumed.load_state_dict(state[0])               # its own: loads
        for p, q in zip(resumed.parameters(), model.parameters()):
            assert torch.equal(p, q)
    else:
        with pytest.raises(ValueError, match=r"holds the expert slots of rank 0.*rank "
                                             rf"{dist.get_rank()} must load its own"):
            resumed.load_state_dict(state[0])
        layer_rows = {id(p) for m in moe_layers(resumed) for p in m.slot_parameters()}
        for p, before in zip(resumed.parameters(), rows):
            if id(p) in layer_rows:
                assert torch.equal(p.detach(), before)
    # a per-rank state_dict of an earlier version (no rank in the extra state) still loads
    own = {k: (v[:-1] if k.endswith("_extra_state") else v) for k, v in
           model.state_dict().items()}
    older = Net(placements_for(0), dtype)
    older.load_state_dict(own)
    assert current_placement(older) == current_placement(model)


def replica_gradient_traffic_scales_with_replicas_held():
    # Rank 0 holds 3 replicated experts, rank 1 two, ranks 2 and 3 one each.
    row = np.array([0, 1, 2, 0, 1, 3, 4, 5, 2, 6, 7, 0])
    share = np.zeros(12)
    for e in range(E):
        share[row == e] = 1.0 / np.count_nonzero(row == e)
    placement = mb.Placement(np.stack([row, row]), np.stack([share, share]),
                             np.repeat(np.arange(4), 3), E)
    model = Net(placement, torch.float32)
    counts = np.bincount(row, minlength=E)
    rank = dist.get_rank()
    held = row[rank * 3:(rank + 1) * 3]
    rows = {"gate_up": 2 * F * D, "down": D * F}         # elements of one slot row
    # Two holders: one row each way. Expert 0's three holders (ranks 0, 1, 3) cut its rows into
    # thirds: a holder sends the two thirds it does not sum, then its summed third twice.
    position = {0: 0, 1: 1, 3: 2}.get(rank)
    expected = 0
    for e in held:
        for R in rows.values():
            if counts[e] == 2:
                expected += R
            elif counts[e] == 3:
                mine = (position + 1) * R // 3 - position * R // 3
                expected += R - mine + 2 * mine
    assert model.l0.replica_sync_bytes() == expected * 4
    row_bytes = sum(rows.values()) * 4
    dense_bytes = 2 * (WORLD - 1) / WORLD * int(np.count_nonzero(counts > 1)) * row_bytes
    sizes = [None] * WORLD
    dist.all_gather_object(sizes, model.l0.replica_sync_bytes())
    # Rank 0 holds experts 0, 1 and 2 replicated, rank 1 experts 0 and 1, rank 2 expert 2 and
    # rank 3 expert 0; a third-of-expert-0 holder sends 4/3 of a row.
    third = 4 * 4 * F * D
    assert sizes == [2 * row_bytes + third, row_bytes + third, row_bytes, third]
    assert max(sizes) < dense_bytes


def grad_scaler_skips_on_every_rank_when_one_ranks_experts_overflow():
    # Under fp16 autocast, torch.amp.GradScaler skips a step whose gradients hold inf or NaN.
    # Expert slots are no data-parallel all-reduce's: an overflow in one rank's experts reached
    # that rank's scaler alone, which skipped and halved its scale while the others stepped,
    # and the ranks' routers and scales drifted apart without a word. Now every rank skips.
    dtype = torch.float32
    topology = mb.Topology.from_arrays(speed=[1.0, 1.0, 0.5, 0.5], slots=SLOTS, node=[0, 0, 1, 1])
    placement = mb.plan(np.ones((2, E)), topology)
    for grad_sync in ("backward", "manual"):
        model = Net(placement, dtype, grad_sync=grad_sync)
        optimizer = make_optimizer(model, "sgd")
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
        overflow_at = {"step": -1}

        def overflow(grad):             # an fp16 overflow in rank 1's experts alone
            if dist.get_rank() == 1 and overflow_at["step"] == 1:
                grad = grad.clone()
                grad.view(-1)[0] = float("inf")
            return grad

        model.l0.slot_parameters()[0].register_hook(overflow)
        for step in range(3):
            overflow_at["step"] = step
            x, target = batch(step, dtype)
            before = [p.detach().clone() for p in model.parameters()]
            loss = (model(x) - target).pow(2).sum() / (WORLD * TOKENS)
            scaler.scale(loss).backward()
            if grad_sync == "manual":
                mb.reduce_replica_gradients(model)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            moved = any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
            assert moved == (step != 1), (grad_sync, step, dist.get_rank())
            scales = [None] * WORLD
            dist.all_gather_object(scales, scaler.get_scale())
            assert scales == [2.0 ** 8 if step == 0 else 2.0 ** 7] * WORLD, (grad_sync, scales)
            routers = [None] * WORLD
            dist.all_gather_object(routers, [p.detach().numpy().tobytes() for layer in
                                             moe_layers(model) for p in
                                             layer.router_module().parameters()])
            assert all(r == routers[0] for r in routers), (grad_sync, step)
            assert_replicas_identical(model)


def ranks_without_replicated_experts_end_the_backward_with_the_others():
    # One replicated expert on two ranks of four: the other two hold none. Under a DDP (which
    # reduces the routers itself) or with frozen routers, no hook of theirs ended the backward,
    # and the two holders waited for them in its agreement until the collective timeout.
    dtype = torch.float64
    topology = mb.Topology.from_arrays(speed=[1.0, 1.0, 1.0, 1.0], slots=[2, 2, 2, 3],
                                       node=[0, 0, 1, 1])
    loads = np.ones((2, E))
    loads[:, 0] = 8.0
    placement = mb.plan(loads, topology)
    holders = [sorted(set(placement.slot_device[placement.phy2log[layer] == 0].tolist()))
               for layer in range(2)]
    assert all(len(h) == 2 for h in holders), holders     # the other two ranks hold no replica
    for variant in ("ddp", "frozen routers"):
        model = Net(placement, dtype)
        if variant == "ddp":
            wrapped = nn.parallel.DistributedDataParallel(mb.exclude_experts_from_ddp(model))
        else:
            wrapped = model
            for layer in moe_layers(model):
                layer.router_module().requires_grad_(False)
        optimizer = make_optimizer(model, "sgd")
        for step in range(2):
            x, target = batch(step, dtype)
            optimizer.zero_grad()
            (wrapped(x) - target).pow(2).sum().backward()
            optimizer.step()
        routers = [None] * WORLD
        dist.all_gather_object(routers, [p.detach().numpy().tobytes() for layer in
                                         moe_layers(model) for p in
                                         layer.router_module().parameters()])
        assert all(r == routers[0] for r in routers), variant
        assert_replicas_identical(model)


def experts_on_every_rank_train_like_experts_held_once_fp64():
    """Holder counts 4 and 2: the reduce-scatter path sums replicas like a single holder."""
    dtype = torch.float64
    row = np.array([0, 1, 2, 0, 1, 3, 0, 4, 5, 0, 6, 7])         # expert 0 on all four ranks
    share = np.zeros(row.shape)
    for e in range(E):
        slots = np.flatnonzero(row == e)
        share[slots] = np.arange(1, slots.size + 1) / np.arange(1, slots.size + 1).sum()
    spread = mb.Placement(np.stack([row, row]), np.stack([share, share]),
                          np.repeat(np.arange(WORLD), 3), E).validate()
    runs = []
    for placement in (spread, placements_for(0)):
        model = Net(placement, dtype)
        optimizer = make_optimizer(model, "adamw")
        runs.append([train_step(model, optimizer, step, dtype) for step in range(6)])
        assert_replicas_identical(model)
    assert_close(torch.tensor(runs[0]), torch.tensor(runs[1]), rtol=1e-10, atol=1e-12)


def backward_sync_equals_manual_sync_also_under_accumulation():
    dtype = torch.float64
    auto = Net(placements_for(0), dtype)
    manual = Net(placements_for(0), dtype, grad_sync="manual")
    for model in (auto, manual):
        for micro in range(3):              # gradient accumulation: three backwards, one reduction
            x, target = batch(40 + micro, dtype)
            ((model(x) - target).pow(2).sum() / (WORLD * TOKENS)).backward()
    mb.reduce_replica_gradients(manual)
    for (name, a), b in zip(auto.named_parameters(), manual.parameters()):
        assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-14, msg=lambda m: f"{name}: {m}")
    for model in (auto, manual):
        optimizer = make_optimizer(model, "sgd")
        optimizer.step()
        assert_replicas_identical(model)


def rebalancer_plain_loop_drives_migrations_and_keeps_losses():
    dtype = torch.float64
    topology = mb.Topology.from_arrays(speed=[1.0, 1.0, 0.5, 0.5], slots=SLOTS, node=[0, 0, 1, 1])
    start = mb.plan(np.ones((2, E)), topology)
    fixed, moving = Net(start, dtype), Net(start, dtype)
    opt_fixed, opt_moving = make_optimizer(fixed, "sgd"), make_optimizer(moving, "sgd")
    rebalancer = mb.Rebalancer(moving, topology, opt_moving, every=3)
    for step in range(12):
        a = train_step(fixed, opt_fixed, step, dtype)
        b = train_step(moving, opt_moving, step, dtype)
        rebalancer.step()
        assert b == pytest.approx(a, rel=1e-10)
    rebalancer.finish()
    moved = [r for r in rebalancer.history if r["moves"] > 0]
    assert moved, rebalancer.history
    assert all(r["error"] is None and r["migration_s"] is not None for r in moved)
    assert moved[0]["imbalance_after"] <= moved[0]["imbalance_before"]
    assert_replicas_identical(moving)


def rebalancer_called_between_micro_batches_keeps_accumulated_gradients():
    # Gradient accumulation with step() where users put it: after every micro-batch, or once
    # before optimizer.step(). A migration started there would commit before the next
    # micro-batch and drop the gradients accumulated so far; its layers commit after the
    # optimizer's next step instead. Losses equal a run that never moves.
    dtype = torch.float64
    topology = mb.Topology.from_arrays(speed=[1.0, 1.0, 0.5, 0.5], slots=SLOTS, node=[0, 0, 1, 1])
    start = mb.plan(np.ones((2, E)), topology)
    for where in ("every micro-batch", "before optimizer.step"):
        fixed, moving = Net(start, dtype), Net(start, dtype)
        opt_fixed, opt_moving = make_optimizer(fixed, "sgd"), make_optimizer(moving, "sgd")
        rebalancer = mb.Rebalancer(moving, topology, opt_moving, every=2)
        for step in range(8):
            for model, optimizer in ((fixed, opt_fixed), (moving, opt_moving)):
                losses = []
                for micro in range(3):
                    x, target = batch(100 + 3 * step + micro, dtype)
                    loss = (model(x) - target).pow(2).sum() / (3 * WORLD * TOKENS)
                    loss.backward()
                    losses.append(float(loss))
                    if model is moving and (where == "every micro-batch" or micro == 2):
                        rebalancer.step()
                optimizer.step()
                optimizer.zero_grad()
                if model is fixed:
                    expected = losses
            assert losses == pytest.approx(expected, rel=1e-10), (where, step)
        rebalancer.finish()
        assert rebalancer.steps == 8, where                   # one per optimizer step
        assert any(r["moves"] > 0 for r in rebalancer.history), (where, rebalancer.history)
        assert_replicas_identical(moving)


def rebalancer_plans_for_the_steps_it_kept():
    # The Rebalancer's call is plan(counts_TLE, ...): each kept step's counts summed over the
    # ranks, oldest first, not their mean; its report gives both figures.
    dtype = torch.float64
    topology = mb.Topology.from_arrays(speed=[1.0, 1.0, 0.5, 0.5], slots=SLOTS, node=[0, 0, 1, 1])
    start = mb.plan(np.ones((2, E)), topology)
    model = Net(start, dtype)
    optimizer = make_optimizer(model, "sgd")
    rebalancer = mb.Rebalancer(model, topology, optimizer, every=5, blocking=True)
    steps = []
    for step in range(5):
        train_step(model, optimizer, step, dtype)
        current = current_placement(model)
        report = rebalancer.step()
        counts = rebalancer.last_counts.to(torch.float64)
        dist.all_reduce(counts)
        steps.append(counts.numpy())
    assert report is not None and rebalancer.steps_kept == 5
    counts_TLE = np.stack(steps)                 # tracker rows are the layers, in model order
    expected = mb.plan(counts_TLE, topology, previous=current)
    planned = current_placement(model)
    assert np.array_equal(planned.phy2log, expected.phy2log)
    assert np.allclose(planned.share, expected.share)
    # the report's figures are on what the plan is for: the kept steps' recent level, and the
    # kept steps moved to it (the same as the kept steps and their mean when loads held steady)
    level, window = planning_window(counts_TLE)
    assert report["imbalance_before"] == pytest.approx(
        mb.summary_imbalance(level, current, topology))
    assert report["step_imbalance_before"] == pytest.approx(
        mb.step_imbalance(window, current, topology).mean())
    assert report["step_imbalance_after"] == pytest.approx(
        mb.step_imbalance(window, expected, topology).mean())
    assert report["step_imbalance_after"] <= report["step_imbalance_before"] + 1e-9


def global_norm_clipping_equals_single_process_clipping():
    dtype = torch.float64
    model = Net(placements_for(5), dtype)
    dense = Net(None, dtype, dense=True)
    dense.load_state_dict(checkpoint.expert_state_dict(model)["model"])
    x_all = torch.cat([batch(3, dtype, rank=r)[0] for r in range(WORLD)])
    t_all = torch.cat([batch(3, dtype, rank=r)[1] for r in range(WORLD)])
    ((dense(x_all) - t_all).pow(2).sum() / (WORLD * TOKENS)).backward()
    expected = torch.nn.utils.clip_grad_norm_(dense.parameters(), 0.1)
    x, t = batch(3, dtype)
    ((model(x) - t).pow(2).sum() / (WORLD * TOKENS)).backward()
    norm = mb.clip_grad_norm_(model, 0.1)
    assert_close(norm, expected.to(norm.dtype), rtol=1e-10, atol=0)
    grads = {}
    for name, p in model.named_parameters():
        grads[name] = p.grad
    for name, p in dense.named_parameters():
        if "experts" in name:
            layer = getattr(model, name.split(".")[0])
            mine = p.grad.index_select(0, torch.tensor(layer.local_experts))
            assert_close(grads[name], mine, rtol=1e-9, atol=1e-13)
        else:
            assert_close(grads[name], p.grad, rtol=1e-9, atol=1e-13)
    with pytest.raises(ValueError, match="max_norm"):
        mb.clip_grad_norm_(model, 0)


def stale_staging_is_sent_again_after_an_optimizer_step():
    dtype = torch.float64
    fixed, moving = _trained(dtype), _trained(dtype)
    migration = apply_placement(moving[0], placements_for(8), moving[1], blocking=False)
    for _model, optimizer in (fixed, moving):
        optimizer.step()            # an update no forward preceded: the staged rows go stale
    assert migration.report()["resends"] == 2 and not migration.done
    for step in range(3, 6):
        a = train_step(*fixed, step, dtype)
        b = train_step(*moving, step, dtype)
        assert b == pytest.approx(a, rel=1e-10)
    assert migration.done and migration.error is None
    compare_states(checkpoint.expert_state_dict(*fixed), checkpoint.expert_state_dict(*moving),
                   rtol=1e-10, atol=1e-13)


def layer_input_of_the_wrong_width_on_one_rank_raises_everywhere():
    model = Net(placements_for(0), torch.float32)
    width = D + 1 if dist.get_rank() == 3 else D
    with pytest.raises(ValueError, match="hidden_states|rank"):
        model.l0(torch.randn(5, width))


def shrink_to_three_ranks_from_checkpoint_matches_a_run_started_there():
    from moebalance.planner.elastic import replan_onto

    dtype = torch.float64
    three = mb.Topology.from_arrays(speed=[1.0, 1.0, 0.5], slots=[4, 4, 4])
    model, optimizer = _trained(dtype)
    box = [tempfile.mkdtemp(prefix="moebalance-shrink-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, group_src=0)
    path = os.path.join(box[0], "experts.pt")
    checkpoint.save(path, model, optimizer)
    loads = np.arange(1, 2 * E + 1, dtype=np.float64).reshape(2, E)
    # Rank 3 is lost: the three others go on, its experts restored from the checkpoint.
    shrunk = replan_onto(loads, three, current_placement(model), device_map=[0, 1, 2, -1])
    held_by_lost = {(l, int(e)) for l in range(2) for e in current_placement(model).phy2log[l, 9:]}
    alive = {(l, int(e)) for l in range(2) for e in current_placement(model).phy2log[l, :9]}
    assert set(shrunk.restores) == held_by_lost - alive
    assert shrunk.kept == 18 and shrunk.moves >= len(shrunk.restores)
    shrunk.placement.validate(three)
    trio = dist.new_group([0, 1, 2])
    if dist.get_rank() < 3:
        losses = {}
        starts = (("shrunk", shrunk.placement), ("carried", shrunk.carried),
                  ("fresh", mb.plan(loads, three)))
        for name, placement in starts:
            small = Net(placement, dtype, group=trio)
            small_opt = make_optimizer(small, "adamw")
            checkpoint.load(path, small, small_opt)
            if name == "carried":
                # Resumed where the survivors were, then moved live to the re-plan by the
                # Migrator on the three ranks' group.
                report = apply_placement(small, shrunk.placement, small_opt).report()
                assert report["moves"] == shrunk.placement.moves_from(shrunk.carried)
                assert current_placement(small) == shrunk.placement
            losses[name] = [train_step(small, small_opt, step, dtype, world=3, group=trio)
                            for step in range(10, 16)]
        np.testing.assert_allclose(losses["shrunk"], losses["fresh"], rtol=1e-10, atol=0)
        np.testing.assert_allclose(losses["carried"], losses["fresh"], rtol=1e-10, atol=0)
    dist.barrier()
    if dist.get_rank() == 0:
        os.remove(path)
        os.rmdir(box[0])


CASES = [
    live_placement_attributes_are_read_only,
    stale_staging_is_sent_again_after_an_optimizer_step,
    layer_input_of_the_wrong_width_on_one_rank_raises_everywhere,
    global_norm_clipping_equals_single_process_clipping,
    apply_placement_rejects_another_topology,
    replica_gradient_traffic_scales_with_replicas_held,
    backward_sync_equals_manual_sync_also_under_accumulation,
    rank0s_state_dict_is_refused_on_the_other_ranks,
    rebalancer_called_between_micro_batches_keeps_accumulated_gradients,
    rebalanced_run_matches_fixed_run_sgd_momentum_fp64,
    rebalanced_run_matches_fixed_run_adamw_fp32,
    rebalanced_run_matches_fixed_run_adamw_fp64,
    rebalanced_run_matches_fixed_run_sgd_momentum_fp32,
    rebalanced_run_matches_fixed_run_foreach_and_fused_adamw_fp32,
    fused_adamw_resumed_under_another_placement_steps_on_like_the_saved_one,
    moved_expert_optimizer_state_equals_unmoved_state_fp64,
    ema_and_reference_copies_follow_the_live_migrations_fp64,
    a_copy_on_one_rank_only_is_refused_on_every_rank_at_the_commit,
    per_rank_state_dict_resumes_its_placement,
    checkpoint_by_logical_expert_loads_into_other_placement_world_size_and_dense,
    shrink_to_three_ranks_from_checkpoint_matches_a_run_started_there,
    rebalancer_plain_loop_drives_migrations_and_keeps_losses,
    rebalancer_plans_for_the_steps_it_kept,
    experts_on_every_rank_train_like_experts_held_once_fp64,
    grad_scaler_skips_on_every_rank_when_one_ranks_experts_overflow,
    ranks_without_replicated_experts_end_the_backward_with_the_others,
    failed_transfer_on_one_rank_keeps_old_placement_everywhere,
    rank_that_never_sends_fails_migration_without_hang,
]


dist_results = shared_spawn(CASES, __name__, world_size=WORLD, timeout_s=400.0,
                            collective_timeout_s=30.0)


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_live_rebalance(dist_results, case):
    dist_results.check(case)
