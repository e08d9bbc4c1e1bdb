"""Frameworks as partners, on 4 gloo ranks: DDP around a wrapped model, rank 0's weights, misuse.

A tiny transformers model built *without* a common seed is wrapped on every rank (rank 0's
weights win); one copy trains with moebalance's own dense averaging, another inside
``DistributedDataParallel``: the losses and every expert slot must agree, DDP must not touch
the slots, and the misuses (a DDP that holds the slots, an optimizer built before wrap, the
model's own ``save_pretrained``, per-rank clipping) end in one clear error or warning.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist
from _dist import case_id, shared_spawn
from test_dispatcher_distributed import random_placement
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import moebalance as mb
from moebalance.integrations.wrap import unwrap_state_dict
from moebalance.lab.models import tiny_hf_moe
from moebalance.nn import slots
from moebalance.nn.slots import moe_layers

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason="needs transformers")

WORLD = 4
SLOTS = [3, 4, 2, 3]
TOPOLOGY = mb.Topology.from_arrays(speed=[1.0, 1.0, 0.5, 0.5], slots=SLOTS, node=[0, 0, 1, 1])
BATCH, SEQ, STEPS = 2, 8, 4


def unseeded_model(family: str = "qwen3_moe"):
    """A tiny fp64 model whose weights differ per rank (no common seed)."""
    model = tiny_hf_moe(family, hidden=32, expert_hidden=32, vocab=64,
                        seed=1000 + dist.get_rank()).double()
    model.set_experts_implementation("eager")
    return model


def batch(step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, 64, (WORLD * BATCH, SEQ), generator=gen)
    rank = dist.get_rank()
    return ids[rank * BATCH:(rank + 1) * BATCH]


def train(model, runner, steps: int = STEPS) -> list[float]:
    """SGD with momentum; a live migration before step 2. Returns the mean loss per step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(steps):
        if step == 2:
            new = random_placement(23, 8, SLOTS, num_layers=len(moe_layers(model)))
            mb.apply_placement(model, new, optimizer, blocking=False)
        ids = batch(step)
        loss = runner(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        mb.clip_grad_norm_(model, 0.5)
        optimizer.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / WORLD)
    return losses


def gathered(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(WORLD)]
    dist.all_gather(out, t.contiguous())
    return out


def wrap_starts_every_rank_from_rank0_weights():
    model = mb.wrap(unseeded_model(), TOPOLOGY)
    for name, p in model.named_parameters():
        if any(p is q for layer in moe_layers(model) for q in layer.slot_parameters()):
            continue
        assert all(torch.equal(p.detach(), other) for other in gathered(p.detach())), name
    # Every rank reads the same experts back (copied from rank 0's).
    state = unwrap_state_dict(model)
    for name, value in state.items():
        assert all(torch.equal(value, other) for other in gathered(value)), name


def ddp_averages_dense_and_leaves_experts_alone_same_losses():
    base = unseeded_model()
    plain = mb.wrap(copy.deepcopy(base), TOPOLOGY)
    inside = mb.wrap(copy.deepcopy(base), TOPOLOGY)
    slots_before = [p.detach().clone() for layer in moe_layers(inside)
                    for p in layer.slot_parameters()]
    ddp = DDP(inside)
    ignored = set(ddp.parameters_to_ignore)
    assert {n for n, _ in inside.named_parameters() if "experts" in n} <= ignored
    # DDP's start-up broadcast left each rank's own slots in place.
    for before, p in zip(slots_before,
                         [p for layer in moe_layers(inside) for p in layer.slot_parameters()]):
        assert torch.equal(before, p.detach())
    expected = train(plain, plain)
    got = train(inside, ddp)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-9, atol=0)
    assert inside.moebalance_sync.group_enabled is False     # DDP averaged the dense part
    assert plain.moebalance_sync.group_enabled is True
    for p, q in zip(plain.parameters(), inside.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12)


class Outer(nn.Module):
    """A user's module around the wrapped model (what DDP is often given)."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def forward(self, **kwargs):
        return self.model(**kwargs)


def ddp_of_an_outer_module_needs_the_exclusion_or_raises():
    # Equal slot counts: DDP's shape check passes and its broadcast overwrites the slots.
    model = mb.wrap(unseeded_model(), mb.Topology.uniform(num_devices=WORLD, slots_per_device=3))
    ids = batch(0)
    bare = DDP(Outer(model))
    with pytest.raises(RuntimeError, match="exclude_experts_from_ddp"):
        bare(input_ids=ids, labels=ids)
    model = mb.wrap(unseeded_model(), TOPOLOGY)
    reference = mb.wrap(unseeded_model(), TOPOLOGY)
    outer = mb.exclude_experts_from_ddp(Outer(model))
    losses = train(model, DDP(outer), steps=2)
    assert losses == train(reference, reference, steps=2)


def expert_parallel_layer_in_ddp_averages_like_ddp():
    placement = random_placement(5, 8, SLOTS)

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 16), mb.ExpertParallelMoE(16, 32, 8, 2, placement,
                                                                     seed=3)).double()

    model, reference = mb.exclude_experts_from_ddp(build()), build()
    x = torch.randn(WORLD, 6, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    mine = x[dist.get_rank()]
    ddp = DDP(model)         # held: a DDP collected before backward reduces nothing
    ddp(mine).pow(2).mean().backward()
    # Without DDP the layer sums its router and expert gradients over the ranks; DDP's mean is
    # that sum / G, for the dense Linear too.
    reference(mine).pow(2).mean().backward()
    for p in reference[0].parameters():
        dist.all_reduce(p.grad)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad / WORLD, rtol=1e-10, atol=1e-12,
                                   msg=lambda m: f"{name}: {m}")


def ddp_over_more_ranks_than_the_expert_groups_is_refused():
    # Megatron's layout: expert-parallel groups of 2, a DDP over all 4 ranks around them. DDP
    # leaves the slots alone, so the groups' experts would train apart: refused at the first
    # forward on every rank, before any row moves.
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = pairs[rank // 2]
    message = "averages over 4 ranks but the expert-parallel layers span 2"
    slots._warned_subgroup = False
    with pytest.warns(UserWarning, match="span 2 of the job's 4 ranks"):
        layer = mb.ExpertParallelMoE(16, 32, 8, 2, random_placement(5, 8, [5, 5]), group=mine,
                                     seed=3).double()
    x = torch.randn(6, 16, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=message):
        DDP(mb.exclude_experts_from_ddp(nn.Sequential(nn.Linear(16, 16).double(), layer)))(x)
    model = mb.wrap(unseeded_model(), mb.Topology.uniform(num_devices=2, slots_per_device=5),
                    group=mine)
    ids = batch(0)
    with pytest.raises(RuntimeError, match=message):
        DDP(mb.exclude_experts_from_ddp(Outer(model)))(input_ids=ids, labels=ids)
    # Over the DDP's own ranks the same layer trains.
    layer = mb.ExpertParallelMoE(16, 32, 8, 2, random_placement(5, 8, SLOTS), seed=3).double()
    DDP(mb.exclude_experts_from_ddp(nn.Sequential(nn.Linear(16, 16).double(), layer)))(x) \
        .sum().backward()


def fully_shard_after_wrap_is_refused():
    # FSDP2 swaps every parameter for its shard, and for the gathered tensor during forward: the
    # ranks' slots would be gathered as if they were one tensor. Refused at the first forward on
    # every rank; before wrap, wrap itself refuses the sharded model.
    from torch.distributed.fsdp import fully_shard

    ids = batch(0)
    # A deepcopy (a reference model, an EMA) holds its own slots and runs.
    wrapped = mb.wrap(unseeded_model(), TOPOLOGY)
    with torch.no_grad():
        torch.testing.assert_close(copy.deepcopy(wrapped)(input_ids=ids).logits,
                                   wrapped(input_ids=ids).logits, rtol=0, atol=0)
    model = fully_shard(mb.wrap(unseeded_model(), TOPOLOGY))
    with pytest.raises(RuntimeError, match="as FSDP's fully_shard does"):
        model(input_ids=ids, labels=ids)
    with pytest.raises(ValueError, match="sharded wrappers"):
        mb.wrap(fully_shard(unseeded_model()), TOPOLOGY)


def optimizer_built_before_wrap_is_refused():
    model = unseeded_model()
    optimizer = torch.optim.AdamW(model.parameters())
    mb.wrap(model, TOPOLOGY)
    with pytest.raises(ValueError, match="create the optimizer after mb.wrap"):
        mb.Rebalancer(model, TOPOLOGY, optimizer, every=2)
    mb.Rebalancer(model, TOPOLOGY, torch.optim.AdamW(model.parameters()), every=2)
    # ZeroRedundancyOptimizer broadcasts each parameter from its owner: one rank's slots would
    # overwrite the others'. Refused; over the dense parameters alone it is the user's choice.
    from torch.distributed.optim import ZeroRedundancyOptimizer

    zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="ZeroRedundancyOptimizer over the expert slots"):
        mb.Rebalancer(model, TOPOLOGY, zero, every=2)


def model_save_pretrained_raises_before_writing():
    model = mb.wrap(unseeded_model(), TOPOLOGY)
    with tempfile.TemporaryDirectory() as tmp:
        target = os.path.join(tmp, "ckpt")
        with pytest.raises(RuntimeError, match="moebalance.save_pretrained"):
            model.save_pretrained(target)
        assert not os.path.exists(target)


def per_rank_clipping_warns_once():
    model = mb.wrap(unseeded_model(), TOPOLOGY)
    ids = batch(0)
    model(input_ids=ids, labels=ids).loss.backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-6)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-6)
    messages = [str(w.message) for w in caught if "clip_grad_norm_" in str(w.message)]
    assert len(messages) == 1 and "moebalance.clip_grad_norm_" in messages[0]


CASES = [wrap_starts_every_rank_from_rank0_weights,
         ddp_averages_dense_and_leaves_experts_alone_same_losses,
         ddp_of_an_outer_module_needs_the_exclusion_or_raises,
         expert_parallel_layer_in_ddp_averages_like_ddp,
         ddp_over_more_ranks_than_the_expert_groups_is_refused,
         fully_shard_after_wrap_is_refused,
         optimizer_built_before_wrap_is_refused,
         model_save_pretrained_raises_before_writing,
         per_rank_clipping_warns_once]


dist_results = shared_spawn(CASES, __name__, world_size=WORLD, timeout_s=400,
                            preload=("transformers.modeling_utils",))


@pytest.mark.distributed
@pytest.mark.timeout(500)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_frameworks_distributed(dist_results, case):
    dist_results.check(case)
