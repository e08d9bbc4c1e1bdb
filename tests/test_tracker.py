"""LoadTracker counts, views and snapshot; attach() on transformers 5.x and moebalance routers."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _dist import case_id, shared_spawn
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import moebalance as mb
from moebalance.integrations.routers import find_routers
from moebalance.tracker import LoadSnapshot

L, E, K = 3, 8, 2


def numpy_counts(ids_TK: np.ndarray, num_experts: int) -> np.ndarray:
    """Reference: tokens per expert, ids outside [0, num_experts) ignored."""
    ids = np.asarray(ids_TK).reshape(-1)
    ids = ids[(ids >= 0) & (ids < num_experts)]
    return np.bincount(ids, minlength=num_experts).astype(np.int64)


def random_steps(seed: int, steps: int, tokens: int = 50):
    """[steps][L] arrays of ids [tokens, K] with a skewed expert choice."""
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(E, 0.5))
    return [[rng.choice(E, size=(tokens, K), p=p) for _ in range(L)] for _ in range(steps)]


def record_steps(tracker, steps, close=True):
    closed = []
    for step in steps:
        for layer, ids in enumerate(step):
            tracker.record(layer, torch.from_numpy(ids))
        if close:
            closed.append(tracker.step().numpy().copy())
    return closed


def step_counts(step) -> np.ndarray:
    return np.stack([numpy_counts(ids, E) for ids in step])


# -- counting semantics ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8])
def test_counts_equal_numpy_bincount_for_every_int_dtype(dtype):
    tracker = mb.LoadTracker(L, E)
    rng = np.random.default_rng(1)
    expected = np.zeros((L, E), np.int64)
    for _ in range(4):
        for layer in range(L):
            ids = rng.integers(0, E, size=(37, K))
            tracker.record(layer, torch.from_numpy(ids).to(dtype))
            expected[layer] += numpy_counts(ids, E)
    got = tracker.counts()
    assert got.dtype == torch.int64 and got.shape == (L, E)
    np.testing.assert_array_equal(got.numpy(), expected)
    np.testing.assert_array_equal(tracker.snapshot(), expected)


def test_non_contiguous_ids_are_counted():
    tracker = mb.LoadTracker(1, E)
    # [40, K], strided
    ids = torch.randint(0, E, (K, 40), generator=torch.Generator().manual_seed(2)).t()
    tracker.record(0, ids)
    np.testing.assert_array_equal(tracker.counts()[0].numpy(), numpy_counts(ids.numpy(), E))


def test_minus_one_ids_are_ignored():
    tracker = mb.LoadTracker(1, E)
    ids = torch.tensor([[0, -1], [3, 3], [-1, -1], [7, 0]], dtype=torch.int32)
    tracker.record(0, ids)
    np.testing.assert_array_equal(tracker.counts()[0].numpy(), [2, 0, 0, 2, 0, 0, 0, 1])
    np.testing.assert_array_equal(tracker.snapshot()[0], [2, 0, 0, 2, 0, 0, 0, 1])


def test_cumulative_view_sums_closed_and_open_steps():
    steps = random_steps(3, 5)
    tracker = mb.LoadTracker(L, E)
    closed = record_steps(tracker, steps[:4])
    record_steps(tracker, steps[4:], close=False)
    for got, step in zip(closed, steps):
        np.testing.assert_array_equal(got, step_counts(step))
    np.testing.assert_array_equal(tracker.counts().numpy(), step_counts(steps[4]))
    np.testing.assert_array_equal(tracker.snapshot(), sum(step_counts(s) for s in steps))
    assert tracker.steps == 4


def test_window_sums_last_closed_steps_only():
    steps = random_steps(4, 7)
    tracker = mb.LoadTracker(L, E, window=3)
    for n in range(1, len(steps) + 1):
        record_steps(tracker, steps[n - 1:n])
        expected = sum(step_counts(s) for s in steps[max(0, n - 3):n])
        np.testing.assert_array_equal(tracker.snapshot(), expected)
        assert not tracker.counts().any()  # step() left the open step empty
    record_steps(tracker, random_steps(5, 1), close=False)  # open step: not in the window yet
    np.testing.assert_array_equal(tracker.snapshot(), sum(step_counts(s) for s in steps[-3:]))


def test_ema_follows_recurrence():
    steps = random_steps(6, 6)
    a = 0.75
    tracker = mb.LoadTracker(L, E, ema=a)
    expected = None
    for step in steps:
        record_steps(tracker, [step])
        c = step_counts(step).astype(np.float64)
        expected = c if expected is None else a * expected + (1 - a) * c
        np.testing.assert_allclose(tracker.snapshot(), expected, rtol=1e-12)


def test_reset_forgets_counts_and_steps():
    tracker = mb.LoadTracker(L, E, window=2)
    record_steps(tracker, random_steps(7, 3))
    tracker.record(0, torch.tensor([[1, 2]]))
    tracker.reset()
    assert tracker.steps == 0
    assert not tracker.counts().any()
    assert not tracker.snapshot().any()
    record_steps(tracker, random_steps(8, 1))
    np.testing.assert_array_equal(tracker.snapshot(), step_counts(random_steps(8, 1)[0]))


def test_snapshot_is_a_copy_not_a_live_view():
    tracker = mb.LoadTracker(1, E)
    tracker.record(0, torch.tensor([[1, 2]]))
    handle = tracker.snapshot(async_op=True)
    tracker.record(0, torch.tensor([[1, 1]]))
    assert isinstance(handle, LoadSnapshot)
    loads = handle.wait()
    assert handle.is_completed()
    assert loads.dtype == np.float64 and loads.shape == (1, E)
    np.testing.assert_array_equal(loads[0, :3], [0, 1, 1])


def test_state_dict_round_trip_restores_the_view():
    steps = random_steps(9, 4)
    tracker = mb.LoadTracker(L, E, window=2)
    record_steps(tracker, steps)
    tracker.record(1, torch.tensor([[0, 5]]))
    restored = mb.LoadTracker(L, E, window=2)
    restored.load_state_dict(tracker.state_dict())
    assert restored.steps == 4
    np.testing.assert_array_equal(restored.snapshot(), tracker.snapshot())
    np.testing.assert_array_equal(restored.counts().numpy(), tracker.counts().numpy())
    with pytest.raises(ValueError, match="window"):
        mb.LoadTracker(L, E, window=3).load_state_dict(tracker.state_dict())


def test_first_record_under_inference_mode_leaves_tracker_usable_in_training():
    tracker = mb.LoadTracker(1, E)
    with torch.inference_mode():
        tracker.record(0, torch.tensor([[1, 2]]))
    tracker.record(0, torch.tensor([[1, 3]]))
    tracker.step()
    np.testing.assert_array_equal(tracker.snapshot()[0, :4], [0, 2, 1, 1])


# -- no host synchronisation -----------------------------------------------------------------------


def test_record_and_step_read_no_tensor_data():
    """Under FakeTensorMode tensors carry no data: any op that reads values to the host
    (item, bool, nonzero, bincount's data-dependent size, ...) raises there."""
    with FakeTensorMode():
        for view in ({}, {"window": 2}, {"ema": 0.5}):
            tracker = mb.LoadTracker(L, E, device="cpu", **view)
            ids = torch.randint(-1, E, (64, K), dtype=torch.int32)
            for _ in range(3):
                for layer in range(L):
                    tracker.record(layer, ids)
                tracker.step()
            tracker.counts()
            tracker.loads()


def test_record_calls_no_host_reading_tensor_method(monkeypatch):
    tracker = mb.LoadTracker(L, E, window=2)
    ids = torch.randint(-1, E, (64, K))
    tracker.record(0, ids)  # allocation happens outside the watch

    def forbidden(name):
        def method(*args, **kwargs):
            raise AssertionError(f"record()/step() called Tensor.{name}, which reads data to the "
                                 "host")
        return method

    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, forbidden(name))
    for layer in range(L):
        tracker.record(layer, ids)
    tracker.step()
    tracker.counts()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_record_does_not_synchronise_cuda():
    tracker = mb.LoadTracker(L, E, ema=0.9, device="cuda")
    ids = torch.randint(-1, E, (4096, K), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            for layer in range(L):
                tracker.record(layer, ids)
            tracker.step()
        handle = tracker.snapshot(async_op=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    expected = (numpy_counts(ids.cpu().numpy(), E)).astype(np.float64)
    np.testing.assert_allclose(handle.wait(), np.tile(expected, (L, 1)))


# -- invalid ids -----------------------------------------------------------------------------------


def test_out_of_range_ids_do_not_corrupt_counts_and_raise_at_snapshot():
    tracker = mb.LoadTracker(2, E)
    tracker.record(1, torch.tensor([[0, E], [-5, 2]]))  # no error yet: that would need a sync
    np.testing.assert_array_equal(tracker.counts()[1].numpy(), numpy_counts(np.array([0, 2]), E))
    tracker.step()
    with pytest.raises(ValueError, match="layer 1.*2 expert ids outside"):
        tracker.snapshot()


def test_check_mode_raises_at_the_faulty_record():
    tracker = mb.LoadTracker(1, E, check=True)
    tracker.record(0, torch.tensor([[0, -1]]))
    with pytest.raises(ValueError, match="outside"):
        tracker.record(0, torch.tensor([[0, E]]))


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(num_layers=0, num_experts=4), ValueError, "num_layers"),
    (dict(num_layers=2, num_experts=-1), ValueError, "num_experts"),
    (dict(num_layers=2.5, num_experts=4), TypeError, "num_layers"),
    (dict(num_layers=2, num_experts=4, window=0), ValueError, "window"),
    (dict(num_layers=2, num_experts=4, ema=1.0), ValueError, "ema"),
    (dict(num_layers=2, num_experts=4, ema="0.9"), TypeError, "ema"),
    (dict(num_layers=2, num_experts=4, window=3, ema=0.5), ValueError, "window or ema"),
    (dict(num_layers=2, num_experts=4, device="nowhere"), ValueError, "device"),
])
def test_bad_constructor_arguments_raise(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        mb.LoadTracker(**kwargs)


@pytest.mark.parametrize("layer, ids, exc, match", [
    (3, torch.zeros(4, 2, dtype=torch.long), ValueError, "layer"),
    (-1, torch.zeros(4, 2, dtype=torch.long), ValueError, "layer"),
    (torch.tensor(0), torch.zeros(4, 2, dtype=torch.long), TypeError, "layer"),
    (0, torch.zeros(4, dtype=torch.long), ValueError,
     r"topk_ids must have shape \[num_tokens, top_k\]"),
    (0, torch.zeros(4, 2, 1, dtype=torch.long), ValueError, "topk_ids"),
    (0, torch.zeros(4, 2), TypeError, "integer expert ids"),
    (0, torch.zeros(4, 2, dtype=torch.bool), TypeError, "topk_ids"),
    (0, np.zeros((4, 2), np.int64), TypeError, "torch.Tensor"),
])
def test_bad_record_arguments_raise(layer, ids, exc, match):
    with pytest.raises(exc, match=match):
        mb.LoadTracker(3, E).record(layer, ids)


def test_ids_on_another_device_raise():
    tracker = mb.LoadTracker(1, E, device="meta")
    with pytest.raises(ValueError, match="tracker counts on meta"):
        tracker.record(0, torch.zeros(2, 2, dtype=torch.long))


def test_counts_before_any_record_raise():
    with pytest.raises(ValueError, match="record"):
        mb.LoadTracker(1, E).counts()
    assert not mb.LoadTracker(2, E).snapshot().any()  # snapshot: zeros, still a valid reduction


# -- snapshot over ranks ---------------------------------------------------------------------------


def snapshot_sums_loads_over_gloo_ranks() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    tracker = mb.LoadTracker(L, E, window=2)
    for step in random_steps(100 + rank, 3):
        record_steps(tracker, [step])
    expected = sum(step_counts(s) for r in range(world) for s in random_steps(100 + r, 3)[-2:])
    np.testing.assert_array_equal(tracker.snapshot(), expected)
    np.testing.assert_array_equal(tracker.snapshot(async_op=True).wait(), expected)
    if rank == 1:  # one rank's bad id must fail the snapshot on every rank
        tracker.record(0, torch.tensor([[E + 3, 0]]))
    with pytest.raises(ValueError, match="outside"):
        tracker.snapshot()


CASES = [snapshot_sums_loads_over_gloo_ranks]
dist_results = shared_spawn(CASES, __name__, world_size=4)


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_snapshot_over_gloo_ranks(dist_results, case):
    dist_results.check(case)


# -- attach() on real routers ----------------------------------------------------------------------


def tiny_moe_model(family: str, num_layers: int = 2, num_experts: int = 8):
    """A random-init transformers 5.x MoE causal LM with hidden 32 and vocabulary 128."""
    import transformers as tf

    common = dict(vocab_size=128, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=num_layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    moe = dict(num_experts_per_tok=K)
    if family == "mixtral":
        config = tf.MixtralConfig(**common, **moe, num_local_experts=num_experts)
    elif family == "qwen2_moe":
        config = tf.Qwen2MoeConfig(**common, **moe, num_experts=num_experts,
                                   moe_intermediate_size=32,
                                   shared_expert_intermediate_size=32)
    elif family == "qwen3_moe":
        config = tf.Qwen3MoeConfig(**common, **moe, num_experts=num_experts,
                                   moe_intermediate_size=32, head_dim=8)
    elif family == "olmoe":
        config = tf.OlmoeConfig(**common, **moe, num_experts=num_experts, eos_token_id=None,
                                pad_token_id=None)
    elif family == "deepseek_v3":
        # first_k_dense_replace=1: layer 0 is dense, so MoE layer 0 is decoder layer 1.
        config = tf.DeepseekV3Config(**{**common, "num_key_value_heads": 4}, **moe,
                                     n_routed_experts=num_experts,
                                     moe_intermediate_size=32, n_group=2, topk_group=1,
                                     first_k_dense_replace=1,
                                     n_shared_experts=1, q_lora_rank=None, kv_lora_rank=16,
                                     qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
    elif family == "gpt_oss":
        config = tf.GptOssConfig(**common, **moe, num_local_experts=num_experts, head_dim=8,
                                 layer_types=["full_attention"] * num_layers)
    elif family == "phimoe":       # its router subclasses nn.Linear
        config = tf.PhimoeConfig(**common, **moe, num_local_experts=num_experts,
                                 router_jitter_noise=0.0, input_jitter_noise=0.0)
    else:
        raise ValueError(family)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tf.AutoModelForCausalLM.from_config(config)
    # a non-zero correction bias makes the choice differ from the top-k of the logits
    if family == "deepseek_v3":
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.copy_(torch.linspace(-0.5, 0.5, num_experts))
    return model


FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss", "phimoe"]


def capture_router_ids(model):
    """Our own hooks on each decoder layer's router, independent of attach()'s discovery."""
    captured, handles = {}, []
    for i, layer in enumerate(model.model.layers):
        router = getattr(layer.mlp, "router", None) or getattr(layer.mlp, "gate", None)
        if router is None or type(router) is nn.Linear:
            continue  # dense layer
        handles.append(router.register_forward_hook(
            lambda mod, args, out, i=i: captured.setdefault(i, []).append(out[2].detach().clone())))
    return captured, handles


@pytest.mark.parametrize("family", FAMILIES)
def test_attach_counts_equal_the_routers_chosen_ids(family):
    num_layers = 3 if family == "deepseek_v3" else 2
    model = tiny_moe_model(family, num_layers=num_layers)
    tracker = mb.attach(model)
    captured, handles = capture_router_ids(model)
    expected_names = {
        "gpt_oss": [f"model.layers.{i}.mlp.router" for i in range(2)],
        "phimoe": [f"model.layers.{i}.mlp.router" for i in range(2)],
        "deepseek_v3": ["model.layers.1.mlp.gate", "model.layers.2.mlp.gate"],
    }.get(family, [f"model.layers.{i}.mlp.gate" for i in range(2)])
    assert tracker.layer_names == expected_names
    assert (tracker.num_layers, tracker.num_experts) == (2, 8)

    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        model(torch.randint(0, 128, (2, 7), generator=gen))
    moe_layers = sorted(captured)
    assert len(moe_layers) == 2
    expected = np.stack([sum(numpy_counts(ids.numpy(), 8) for ids in captured[i])
                         for i in moe_layers])
    assert expected.sum() == 2 * 2 * 7 * K * 2  # 2 forwards x 14 tokens x K, per layer x 2 layers
    np.testing.assert_array_equal(tracker.counts().numpy(), expected)

    tracker.detach()
    assert not tracker.attached
    model(torch.randint(0, 128, (2, 7), generator=gen))
    np.testing.assert_array_equal(tracker.counts().numpy(), expected)  # detached: nothing new
    for h in handles:
        h.remove()


def test_attach_records_deepseek_choice_not_topk_of_logits():
    model = tiny_moe_model("deepseek_v3", num_layers=2)
    tracker = mb.attach(model)
    logits, chosen = [], []
    router = model.model.layers[1].mlp.gate

    def keep(module, args, out):
        logits.append(out[0])
        chosen.append(out[2])

    router.register_forward_hook(keep)
    model(torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1)))
    naive = numpy_counts(torch.topk(logits[0], K, dim=-1).indices.numpy(), 8)
    actual = numpy_counts(chosen[0].numpy(), 8)
    assert not np.array_equal(naive, actual)  # the bias-corrected, group-limited choice differs
    np.testing.assert_array_equal(tracker.counts()[0].numpy(), actual)


def test_activation_checkpoint_recompute_is_not_counted_twice():
    model = tiny_moe_model("mixtral")
    enable = (getattr(model, "activation_checkpointing_enable", None)
              or model.gradient_checkpointing_enable)
    enable()
    model.train()
    tracker = mb.attach(model)
    captured, _ = capture_router_ids(model)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(3))
    model(ids, labels=ids).loss.backward()
    assert all(len(v) == 2 for v in captured.values())  # the router did run twice per layer ...
    np.testing.assert_array_equal(tracker.counts().numpy(), np.stack(
        [numpy_counts(captured[i][0].numpy(), 8) for i in sorted(captured)]))  # ... counted once
    assert tracker.counts().sum() == 2 * 18 * K


class MarkedRouter(nn.Module):
    """Stands for moebalance's own router: a class attribute is the whole contract."""

    moebalance_router = True

    def __init__(self, hidden: int, num_experts: int, top_k: int):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.proj = nn.Linear(hidden, num_experts, bias=False)

    def forward(self, x_TD):
        logits_TE = self.proj(x_TD)
        weights_TK, ids_TK = torch.topk(logits_TE.softmax(-1), self.top_k, dim=-1)
        return logits_TE, weights_TK, ids_TK


class ToyMoE(nn.Module):
    def __init__(self, hidden=16, num_experts=6):
        super().__init__()
        # no `experts` sibling: the mark suffices
        self.router = MarkedRouter(hidden, num_experts, 2)

    def forward(self, x_TD):
        return x_TD + self.router(x_TD)[1].sum(-1, keepdim=True)


def test_attach_hooks_routers_marked_moebalance_router():
    model = nn.Sequential(ToyMoE(), nn.Linear(16, 16), ToyMoE())
    tracker = mb.attach(model, mb.LoadTracker(2, 6, window=4))
    assert tracker.layer_names == ["0.router", "2.router"]
    captured, h = [], []
    for i in (0, 2):
        h.append(model[i].router.register_forward_hook(lambda m, a, o: captured.append(o[2])))
    model(torch.randn(20, 16, generator=torch.Generator().manual_seed(4)))
    tracker.step()
    expected = np.stack([numpy_counts(c.numpy(), 6) for c in captured])
    np.testing.assert_array_equal(tracker.snapshot(), expected)


def test_attach_without_router_raises():
    with pytest.raises(ValueError, match="no MoE router found"):
        mb.attach(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    with pytest.raises(TypeError, match="model"):
        mb.attach("model")


def test_attach_rejects_logits_only_gate():
    class OldStyleBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(8, 4)
            self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    with pytest.raises(ValueError, match="transformers 4.x"):
        mb.attach(nn.Sequential(OldStyleBlock()))


def test_attach_rejects_mismatched_or_attached_tracker():
    model = nn.Sequential(ToyMoE(), ToyMoE())
    with pytest.raises(ValueError, match=r"LoadTracker\(2, 6"):
        mb.attach(model, mb.LoadTracker(3, 6))
    with pytest.raises(ValueError, match="window/ema"):
        mb.attach(model, mb.LoadTracker(2, 6), window=3)
    tracker = mb.attach(model)
    with pytest.raises(ValueError, match="detach"):
        mb.attach(model, tracker)
    assert len(find_routers(model)) == 2


def test_a_second_tracker_on_the_same_model_is_refused_until_the_first_detaches():
    model = nn.Sequential(ToyMoE(), ToyMoE())
    first = mb.attach(model)
    with pytest.raises(ValueError, match=r"already records into a LoadTracker.*detach\(\)"):
        mb.attach(model)
    with pytest.raises(ValueError, match=r"already records"):
        mb.attach(model[1])  # one layer of it counts too
    first.detach()
    second = mb.attach(model)
    model(torch.randn(5, 16))
    second.step()
    assert second.snapshot().sum() == 5 * 2 * 2  # 5 tokens, top-2, two layers: counted once
    assert first.snapshot().sum() == 0


def test_attach_on_a_wrapped_model_names_model_moebalance_tracker():
    model = nn.Sequential(ToyMoE(), ToyMoE())
    model.moebalance_tracker = mb.attach(model)  # what mb.wrap(model, ..., track=True) does
    with pytest.raises(ValueError, match=r"as model\.moebalance_tracker: use that"):
        mb.attach(model)
    holder = nn.ModuleDict({"net": model})       # e.g. a LightningModule around it
    with pytest.raises(ValueError, match=r"as model\.net\.moebalance_tracker"):
        mb.attach(holder)


def test_integrations_package_reaches_unwrap_state_dict():
    import moebalance.integrations as integrations

    assert callable(integrations.wrap)  # the name is the function, not its module
    assert "unwrap_state_dict" in integrations.__all__
    assert integrations.unwrap_state_dict.__module__ == "moebalance.integrations.wrap"


def test_attached_tracker_is_found_from_any_module_holding_the_model():
    from moebalance.integrations.routers import attached_tracker

    model = nn.Sequential(ToyMoE(), ToyMoE())
    assert attached_tracker(model) is None
    tracker = mb.attach(model)
    holder = nn.ModuleDict({"model": model})          # e.g. a LightningModule around it
    assert attached_tracker(holder) is tracker
    assert [tracker.layer_of(m.router) for m in model] == [0, 1]
    tracker.detach()
    assert attached_tracker(holder) is None
    mb.attach(model[0])
    with pytest.raises(ValueError, match="different trackers"):
        attached_tracker(model)                       # one layer tracked, the other not


def test_router_returning_something_else_raises_at_forward():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.router = MarkedRouter(8, 4, 1)
            self.router.forward = lambda x: x  # returns a tensor, not the triple

        def forward(self, x):
            return self.router(x)

    model = Block()
    mb.attach(model)
    with pytest.raises(ValueError, match="not \\(router_logits, top_k_weights, top_k_index\\)"):
        model(torch.randn(3, 8))


def test_counts_restored_before_any_record_follow_the_ids_device():
    # A resumed run loads the tracker's state before the first forward (the HF Trainer's
    # on_train_begin): the counts wait on the CPU and move to the device of the first ids
    # recorded ("meta" stands in for a GPU here).
    saved = mb.LoadTracker(L, E, window=4)
    saved.record(0, torch.tensor([[0, 1], [1, 2]]))
    saved.step()
    resumed = mb.LoadTracker(L, E, window=4)
    resumed.load_state_dict(saved.state_dict())
    resumed.record(1, torch.zeros(3, K, dtype=torch.int64, device="meta"))
    assert resumed.device == torch.device("meta") and resumed.counts().device.type == "meta"
    on_cpu = mb.LoadTracker(L, E, window=4)
    on_cpu.load_state_dict(saved.state_dict())
    on_cpu.record(1, torch.tensor([[3, 3]]))
    np.testing.assert_array_equal(on_cpu.counts()[1].numpy(), numpy_counts(np.array([3, 3]), E))
    with pytest.raises(ValueError, match="tracker counts on"):
        on_cpu.record(1, torch.zeros(1, K, dtype=torch.int64, device="meta"))
