"""mb.from_pretrained on 4 gloo ranks: each rank reads only its experts; the model is the plain one.

Every rank builds the same tiny fp64 model (fixed seed, transformers' eager experts) as the
single-process reference; rank 0 saves it with transformers' ``save_pretrained`` (per-expert
layout, fused layout, sharded) or with ``mb.save_pretrained`` from a model wrapped under one
placement, and every rank loads it with ``mb.from_pretrained`` under another. Logits and one
training step's loss must equal the reference's, each rank must hold exactly its slots' rows
(and every dense weight), and bad input must raise the same error on every rank.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import shutil
import tempfile

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _dist import case_id, shared_spawn
from test_dispatcher_distributed import random_placement
from test_tracker import tiny_moe_model
from torch.testing import assert_close

import moebalance as mb
from moebalance.nn.slots import moe_layers

WORLD = 4
SLOTS = [3, 4, 2, 3]
TOPOLOGY = mb.Topology.from_arrays(speed=[1.0, 1.0, 0.5, 0.5], slots=SLOTS, node=[0, 0, 1, 1])
BATCH, SEQ = 2, 8          # per rank
EXACT = dict(rtol=1e-9, atol=1e-12)   # fp64: only the order of sums differs


def reference_model(family: str):
    model = tiny_moe_model(family).to(torch.float64)
    model.set_experts_implementation("eager")   # transformers' grouped_mm refuses fp64
    return model.eval()


def fp64_loss(model, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy in fp64 (transformers' own loss casts the logits to fp32)."""
    logits = model(input_ids=ids).logits[:, :-1]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             ids[:, 1:].reshape(-1))


def global_ids(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (WORLD * BATCH, SEQ), generator=gen)


def mine(t: torch.Tensor) -> torch.Tensor:
    rank = dist.get_rank()
    return t[rank * BATCH:(rank + 1) * BATCH]


def shared_folder() -> str:
    box = [tempfile.mkdtemp(prefix="moebalance-pretrained-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, group_src=0)
    return box[0]


def remove(folder: str) -> None:
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(folder, ignore_errors=True)


def check_loaded(loaded, reference, placement) -> None:
    """Same class and layer kind as mb.wrap gives; this rank's rows only; the plain model's math."""
    assert type(loaded) is type(reference)
    layers = moe_layers(loaded)
    assert len(layers) == placement.num_layers
    assert np.array_equal(mb.current_placement(loaded).phy2log, placement.phy2log)
    rank = dist.get_rank()
    ref_state = reference.state_dict()
    slot_names = set()
    for name, module in loaded.named_modules():
        if module not in layers:
            continue
        local = torch.from_numpy(module.local_experts.copy())
        for param_name, param in module.named_slot_parameters():
            key = f"{name}.{param_name}"
            slot_names.add(key)
            assert param.shape[0] == SLOTS[rank]
            assert param.dtype == torch.float64
            assert torch.equal(param.detach(), ref_state[key].index_select(0, local)), key
    for key, value in loaded.state_dict().items():
        if key in slot_names or key.endswith("_extra_state"):
            continue
        assert torch.equal(value, ref_state[key]), key
    ids = global_ids(1)
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
        assert_close(loaded(input_ids=mine(ids)).logits, mine(expected), **EXACT)
    # It trains like a wrapped model: one step's loss and the next equal the reference's.
    ref = copy.deepcopy(reference).train()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(loaded.train().parameters(), lr=0.1)
    for step in (2, 3):
        ids = global_ids(step)
        ref_opt.zero_grad()
        opt.zero_grad()
        ref_loss = fp64_loss(ref, ids)
        ref_loss.backward()
        ref_opt.step()
        loss = fp64_loss(loaded, mine(ids))
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        assert float(mean) / WORLD == pytest.approx(float(ref_loss), rel=1e-10), step


def _transformers_case(family: str, layout: str):
    def case():
        reference = reference_model(family)
        folder = shared_folder()
        if dist.get_rank() == 0:
            options = {"per_expert": {}, "fused": {"save_original_format": False},
                       "sharded": {"max_shard_size": "40KB"}}[layout]
            reference.save_pretrained(folder, **options)
        dist.barrier()
        if layout == "sharded":
            assert os.path.isfile(os.path.join(folder, "model.safetensors.index.json"))
        placement = random_placement(31, 8, SLOTS, num_layers=2)
        check_loaded(mb.from_pretrained(folder, TOPOLOGY, placement), reference, placement)
        remove(folder)

    case.__name__ = f"transformers_{layout}_{family}_checkpoint_loads_equal_to_plain_model"
    case.__qualname__ = case.__name__
    globals()[case.__name__] = case
    return case


def _moebalance_case(family: str):
    def case():
        reference = reference_model(family)
        saved_under = random_placement(7, 8, SLOTS, num_layers=2)
        wrapped = mb.wrap(copy.deepcopy(reference), TOPOLOGY, placement=saved_under)
        folder = shared_folder()
        mb.save_pretrained(wrapped, folder)
        del wrapped
        other = random_placement(8, 8, SLOTS, num_layers=2)
        assert other.moves_from(saved_under) > 0
        check_loaded(mb.from_pretrained(folder, TOPOLOGY, other), reference, other)
        # No placement: one planned for uniform loads, as mb.wrap plans it.
        uniform = mb.plan(np.ones((2, 8)), TOPOLOGY)
        check_loaded(mb.from_pretrained(folder, TOPOLOGY), reference, uniform)
        remove(folder)

    case.__name__ = f"moebalance_saved_{family}_loads_under_another_placement"
    case.__qualname__ = case.__name__
    globals()[case.__name__] = case
    return case


def from_pretrained_rejects_bad_input_on_every_rank():
    reference = reference_model("qwen3_moe")
    folder = shared_folder()
    if dist.get_rank() == 0:
        reference.save_pretrained(folder)
        os.makedirs(os.path.join(folder, "no_config"))
        os.makedirs(os.path.join(folder, "no_weights"))
        shutil.copy(os.path.join(folder, "config.json"), os.path.join(folder, "no_weights"))
        # A config one layer deeper than the weights: the loader must say what is missing.
        deeper = os.path.join(folder, "deeper")
        os.makedirs(deeper)
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
        config["num_hidden_layers"] = 3
        with open(os.path.join(deeper, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f)
        shutil.copy(os.path.join(folder, "model.safetensors"), deeper)
    dist.barrier()
    with pytest.raises(ValueError, match="path .* is not a folder"):
        mb.from_pretrained(os.path.join(folder, "absent"), TOPOLOGY)
    with pytest.raises(ValueError, match="has no config.json"):
        mb.from_pretrained(os.path.join(folder, "no_config"), TOPOLOGY)
    with pytest.raises(ValueError, match="has no model.safetensors"):
        mb.from_pretrained(os.path.join(folder, "no_weights"), TOPOLOGY)
    with pytest.raises(ValueError, match="lacks model.layers.2"):
        mb.from_pretrained(os.path.join(folder, "deeper"), TOPOLOGY)
    with pytest.raises(TypeError, match="path must be a folder path"):
        mb.from_pretrained(3, TOPOLOGY)
    with pytest.raises(ValueError, match="4 ranks"):
        mb.from_pretrained(folder, mb.Topology.uniform(num_devices=2, slots_per_device=8))
    with pytest.raises(ValueError, match="one row per MoE block"):
        mb.from_pretrained(folder, TOPOLOGY, random_placement(1, 8, SLOTS, num_layers=3))
    with pytest.raises(ValueError, match="placement has 2 layers of 9 experts"):
        mb.from_pretrained(folder, TOPOLOGY, random_placement(1, 9, SLOTS, num_layers=2))
    with pytest.raises(TypeError, match="dtype must be a torch.dtype"):
        mb.from_pretrained(folder, TOPOLOGY, dtype="float64")
    # A folder only rank 0 can see: the other ranks fail, and every rank raises.
    only_rank0 = folder if dist.get_rank() == 0 else os.path.join(folder, "absent")
    with pytest.raises(ValueError, match="rank 1: path .* is not a folder"):
        mb.from_pretrained(only_rank0, TOPOLOGY)
    # Different placements on different ranks: refused on every rank.
    with pytest.raises(ValueError, match="different arguments"):
        mb.from_pretrained(folder, TOPOLOGY, random_placement(dist.get_rank(), 8, SLOTS, 2))
    # And after all that, a good call on the same group still works.
    placement = random_placement(3, 8, SLOTS, num_layers=2)
    check_loaded(mb.from_pretrained(folder, TOPOLOGY, placement), reference, placement)
    remove(folder)


CASES = []
if importlib.util.find_spec("transformers") is not None:
    CASES = [_transformers_case("qwen3_moe", "per_expert"),
             _transformers_case("mixtral", "per_expert"),
             _transformers_case("qwen3_moe", "fused"), _transformers_case("mixtral", "sharded"),
             _moebalance_case("qwen3_moe"), _moebalance_case("mixtral"),
             from_pretrained_rejects_bad_input_on_every_rank]


dist_results = shared_spawn(CASES, __name__, world_size=WORLD, timeout_s=400.0,
                            collective_timeout_s=60.0, preload=("transformers.modeling_utils",))


@pytest.mark.distributed
@pytest.mark.skipif(not CASES, reason="needs transformers")
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_from_pretrained(dist_results, case):
    dist_results.check(case)
