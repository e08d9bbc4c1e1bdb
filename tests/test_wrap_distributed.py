"""mb.wrap on 4 gloo ranks: seven transformers families, expert-parallel, equal to one process.

Every rank builds the same tiny model (fixed seed), keeps a plain copy as the single-process
reference and wraps the other under a random placement with replicas on devices of unlike speed
and slot count; each rank feeds its slice of the global batch. Logits, the loss, the gradient of
every parameter, a few optimizer steps with a live migration between them, and the model that
``unwrap`` returns must all equal the reference.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
import torch.distributed as dist
from _dist import case_id, shared_spawn
from test_dispatcher_distributed import random_placement
from test_tracker import FAMILIES, tiny_moe_model
from torch.testing import assert_close

import moebalance as mb
from moebalance.nn.slots import moe_layers

WORLD = 4
SLOTS = [3, 4, 2, 3]
TOPOLOGY = mb.Topology.from_arrays(speed=[1.0, 1.0, 0.5, 0.5], slots=SLOTS, node=[0, 0, 1, 1])
BATCH, SEQ = 2, 8          # per rank


def global_ids(seed: int):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (WORLD * BATCH, SEQ), generator=gen)


def mine(t: torch.Tensor) -> torch.Tensor:
    rank = dist.get_rank()
    return t[rank * BATCH:(rank + 1) * BATCH]


def moe_block_count(model) -> int:
    return sum(1 for layer in model.model.layers
               if hasattr(getattr(layer.mlp, "experts", None), "gate_up_proj"))


def count_copies(model) -> list:
    """A list that each MoE layer's dispatch appends its step's transient copies to."""
    copies = []
    for layer in moe_layers(model):
        dispatch = layer.dispatcher.dispatch

        def recording(*args, dispatch=dispatch, **kwargs):
            recv, handle = dispatch(*args, **kwargs)
            copies.append(0 if handle.transient is None else handle.transient.num_copies)
            return recv, handle

        layer.dispatcher.dispatch = recording
    return copies


def check_family(family: str, transient: int = 0):
    layers = 3 if family == "deepseek_v3" else 2
    reference = tiny_moe_model(family, num_layers=layers)
    wrapped = copy.deepcopy(reference)
    placement = random_placement(17, 8, SLOTS, num_layers=moe_block_count(reference))
    # transient_cost 0: every copy that shortens the slowest rank is made
    mb.wrap(wrapped, TOPOLOGY, placement=placement, transient=transient, transient_cost=0.0)
    assert len(moe_layers(wrapped)) == placement.num_layers
    copies = count_copies(wrapped)

    # Logits and gradients of one step.
    ids = global_ids(0)
    ref_out = reference(input_ids=ids, labels=ids)
    ref_out.loss.backward()
    out = wrapped(input_ids=mine(ids), labels=mine(ids))
    assert_close(out.logits, mine(ref_out.logits), rtol=1e-5, atol=1e-6)
    out.loss.backward()
    ref_params = dict(reference.named_parameters())
    for name, p in wrapped.named_parameters():
        layer = next((m for m in moe_layers(wrapped) if any(q is p for q in m.slot_parameters())),
                     None)
        expected = ref_params[name].grad
        if layer is not None:
            expected = expected.index_select(0, torch.tensor(layer.local_experts))
        assert_close(p.grad, expected, rtol=1e-4, atol=1e-6, msg=lambda m: f"{family} {name}: {m}")

    # A few SGD steps, a live migration between them: the same losses as one process.
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.05, momentum=0.9)
    ref_opt.step()
    opt.step()
    for step in range(1, 4):
        if step == 2:
            new = random_placement(18, 8, SLOTS, num_layers=placement.num_layers)
            mb.apply_placement(wrapped, new, opt, blocking=False)
        ids = global_ids(step)
        ref_opt.zero_grad()
        opt.zero_grad()
        ref_loss = reference(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        ref_opt.step()
        loss = wrapped(input_ids=mine(ids), labels=mine(ids)).loss
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        assert float(mean) / WORLD == pytest.approx(float(ref_loss), rel=1e-5), (family, step)
    assert mb.current_placement(wrapped).moves_from(placement) > 0
    if transient:
        assert sum(copies) > 0, "no step lent an expert's weights"

    # unwrap: a plain model in transformers' layout with the same logits.
    plain = mb.unwrap(wrapped)
    assert type(plain) is type(reference)
    ids = global_ids(9)
    with torch.no_grad():
        assert_close(plain(input_ids=mine(ids)).logits, wrapped(input_ids=mine(ids)).logits,
                     rtol=1e-5, atol=1e-6)
        assert_close(plain(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=1e-4,
                     atol=1e-5)
    assert set(plain.state_dict()) == set(reference.state_dict())


def _case(family, transient=0):
    def case():
        check_family(family, transient)
    case.__name__ = (f"wrapped_{family}_lending_weights_equals_single_process" if transient
                     else f"wrapped_{family}_equals_single_process")
    case.__qualname__ = case.__name__
    globals()[case.__name__] = case
    return case


def save_pretrained_writes_a_checkpoint_from_pretrained_loads():
    import os
    import shutil
    import tempfile

    for family in ("mixtral", "gpt_oss"):
        reference = tiny_moe_model(family)
        wrapped = mb.wrap(copy.deepcopy(reference), TOPOLOGY,
                          placement=random_placement(5, 8, SLOTS, num_layers=2))
        box = [tempfile.mkdtemp(prefix="moebalance-hf-") if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, group_src=0)
        mb.save_pretrained(wrapped, box[0])
        loaded = type(reference).from_pretrained(box[0])
        assert os.path.isfile(os.path.join(box[0], "moebalance_placement.npz"))
        ids = global_ids(3)
        with torch.no_grad():
            assert_close(loaded(input_ids=ids).logits, reference(input_ids=ids).logits,
                         rtol=1e-5, atol=1e-6)
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(box[0])


def wrap_rejects_bad_input():
    import transformers as tf

    dense = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                               num_hidden_layers=1, num_attention_heads=2,
                                               num_key_value_heads=2))
    with pytest.raises(ValueError, match="no MoE layer"):
        mb.wrap(dense, TOPOLOGY)
    with pytest.raises(ValueError, match="fewer than the 8 experts"):
        mb.wrap(tiny_moe_model("mixtral"), mb.Topology.uniform(num_devices=4, slots_per_device=1))
    with pytest.raises(ValueError, match="one row per MoE block"):
        mb.wrap(tiny_moe_model("mixtral"), TOPOLOGY,
                placement=random_placement(1, 8, SLOTS, num_layers=3))
    with pytest.raises(ValueError, match="4 ranks"):
        mb.wrap(tiny_moe_model("mixtral"), mb.Topology.uniform(num_devices=2, slots_per_device=8))
    model = mb.wrap(tiny_moe_model("mixtral"), TOPOLOGY)
    with pytest.raises(ValueError, match="already wrapped"):
        mb.wrap(model, TOPOLOGY)
    # DistributedDataParallel built first holds the experts wrap() replaces: refused at once
    with pytest.raises(ValueError, match=r"inside a DistributedDataParallel, built before "
                                         r"wrap\(\).*then DistributedDataParallel\(model\)"):
        mb.wrap(torch.nn.parallel.DistributedDataParallel(tiny_moe_model("mixtral")), TOPOLOGY)

    # Experts whose arithmetic differs: refused on every rank (rank 0's probe decides), and
    # weights another rank never initialised (NaN) do not stop the wrap: rank 0's are trained.
    from test_wrap_families import with_scaled_experts

    with pytest.raises(ValueError, match="would train it wrong"):
        mb.wrap(with_scaled_experts(tiny_moe_model("mixtral")), TOPOLOGY)
    unset = tiny_moe_model("mixtral")
    if dist.get_rank() == 2:
        with torch.no_grad():
            for layer in unset.model.layers:
                layer.mlp.experts.gate_up_proj.fill_(float("nan"))
    wrapped = mb.wrap(unset, TOPOLOGY)
    with torch.no_grad():
        assert torch.isfinite(wrapped(input_ids=mine(global_ids(5))).logits).all()


def generate_keeps_every_rank_stepping_when_one_rank_ends_first():
    """model.generate on an expert-parallel model: rank 0's sequence ends after one token (its
    own eos), the others run on; every rank's output equals the plain model's."""
    reference = tiny_moe_model("qwen3_moe")
    wrapped = mb.wrap(copy.deepcopy(reference), TOPOLOGY,
                      placement=random_placement(9, 8, SLOTS, num_layers=2)).eval()
    ids = mine(global_ids(4))[:1]
    kwargs = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    first = reference.generate(ids, **kwargs)[0, ids.shape[1]]
    eos = int(first) if dist.get_rank() == 0 else 10_000
    out = wrapped.generate(ids, eos_token_id=eos, **kwargs)
    assert torch.equal(out, reference.generate(ids, eos_token_id=eos, **kwargs))
    assert out.shape[1] == ids.shape[1] + (1 if dist.get_rank() == 0 else 6)


CASES = []
if importlib.util.find_spec("transformers") is not None:
    CASES = [_case(f) for f in FAMILIES] + [
        _case(f, transient=1) for f in ("mixtral", "gpt_oss")] + [
        save_pretrained_writes_a_checkpoint_from_pretrained_loads, wrap_rejects_bad_input,
        generate_keeps_every_rank_stepping_when_one_rank_ends_first]


dist_results = shared_spawn(CASES, __name__, world_size=WORLD, timeout_s=500.0,
                            collective_timeout_s=60.0, preload=("transformers.modeling_utils",))


@pytest.mark.distributed
@pytest.mark.skipif(not CASES, reason="needs transformers")
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_wrap(dist_results, case):
    dist_results.check(case)
