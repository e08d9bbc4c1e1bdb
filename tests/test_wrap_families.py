"""``mb.wrap`` on transformers families beyond the six it was built on, in one process: a
family whose blocks route tokens the same way is served exactly; one whose experts take every
token (Llama 4) or compute something else is refused before the model changes."""

from __future__ import annotations

import warnings

import pytest
import torch

import moebalance as mb

tf = pytest.importorskip("transformers")

from moebalance.lab.models import tiny_hf_moe  # noqa: E402

EXPERTS = 8


def _fp64_eager(model):
    model = model.double().eval()
    model.set_experts_implementation("eager")   # grouped_mm refuses fp64
    return model


def tiny_llama4():
    """Llama 4: its experts run every token for every expert, scores folded into the rows."""
    config = tf.Llama4TextConfig(vocab_size=64, hidden_size=32, intermediate_size=32,
                                 intermediate_size_mlp=64, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                 num_local_experts=EXPERTS, num_experts_per_tok=1,
                                 max_position_embeddings=64, pad_token_id=0, eos_token_id=None,
                                 bos_token_id=None)
    return tf.AutoModelForCausalLM.from_config(config)


def with_scaled_experts(model):
    """``model`` (a transformers MoE) whose experts scale their output: a family whose experts
    compute something else than the slots do."""
    plain = type(model.model.layers[0].mlp.experts)

    class ScaledExperts(plain):
        def forward(self, hidden_states, top_k_index, top_k_weights):
            return 2.5 * super().forward(hidden_states, top_k_index, top_k_weights)

    for layer in model.model.layers:
        layer.mlp.experts.__class__ = ScaledExperts
    return model


def test_phimoe_router_subclassing_linear_is_served_exactly():
    # PhiMoE's router subclasses nn.Linear and returns (logits, weights, ids) like the others
    model = _fp64_eager(tiny_hf_moe("phimoe", experts=EXPERTS, hidden=32, expert_hidden=32,
                                    vocab=64))
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    wrapped = mb.wrap(model, mb.Topology.uniform(1, EXPERTS))
    with torch.no_grad():
        got = wrapped(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    counts = wrapped.moebalance_tracker.snapshot()
    assert counts.shape == (2, EXPERTS) and float(counts.sum()) == 2 * 2 * 10 * 2


def test_llama4_experts_on_every_token_are_refused_at_wrap():
    model = tiny_llama4()
    before = {n: p.clone() for n, p in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"feed_forward\.experts \(Llama4TextExperts\).*"
                                         r"Llama 4's layout.*mb\.attach\(model\)"):
        mb.wrap(model, mb.Topology.uniform(1, EXPERTS))
    assert all(torch.equal(before[n], p) for n, p in model.state_dict().items())


def test_experts_with_other_arithmetic_are_refused_before_any_change():
    model = with_scaled_experts(tiny_hf_moe("mixtral", experts=EXPERTS, hidden=32,
                                            expert_hidden=32, vocab=64))
    scaled = type(model.model.layers[0].mlp.experts)
    before = {n: p.clone() for n, p in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.experts \(ScaledExperts\).*"
                                         r"train it wrong"):
        mb.wrap(model, mb.Topology.uniform(1, EXPERTS))
    assert all(type(layer.mlp.experts) is scaled for layer in model.model.layers)
    assert all(torch.equal(before[n], p) for n, p in model.state_dict().items())


def test_the_probe_leaves_the_random_state_alone():
    model = tiny_hf_moe("qwen3_moe", experts=EXPERTS, hidden=32, expert_hidden=32, vocab=64)
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    mb.wrap(model, mb.Topology.uniform(1, EXPERTS), track=False)
    assert torch.equal(torch.random.get_rng_state(), state)


def test_phimoe_checkpoint_loads_expert_parallel_with_the_attention_asked_for(tmp_path):
    model = _fp64_eager(tiny_hf_moe("phimoe", experts=EXPERTS, hidden=32, expert_hidden=32,
                                    vocab=64))
    model.config._attn_implementation = "eager"
    model.save_pretrained(tmp_path)      # transformers' own layout: one tensor per expert
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    loaded = mb.from_pretrained(tmp_path, mb.Topology.uniform(1, EXPERTS), dtype=torch.float64,
                                attn_implementation="eager")
    assert loaded.config._attn_implementation == "eager"
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, want, rtol=0, atol=1e-12)
    with pytest.raises(TypeError, match="attn_implementation must be a str"):
        mb.from_pretrained(tmp_path, mb.Topology.uniform(1, EXPERTS), attn_implementation=True)
    # transformers' older name for dtype, as users' code still spells it
    older = mb.from_pretrained(tmp_path, mb.Topology.uniform(1, EXPERTS),
                               torch_dtype=torch.float64, attn_implementation="eager")
    assert next(older.parameters()).dtype == torch.float64
    with pytest.raises(ValueError, match="not both"):
        mb.from_pretrained(tmp_path, mb.Topology.uniform(1, EXPERTS), dtype=torch.float64,
                           torch_dtype=torch.float64)


def test_llama4_routers_are_tracked_by_their_own_top_k():
    model = tiny_llama4()
    chosen = []
    for layer in model.model.layers:      # our own hooks: the router's top-k of its logits
        router = layer.feed_forward.router
        router.register_forward_hook(lambda m, a, out: chosen.append(
            torch.topk(out[1], m.top_k, dim=-1).indices))
    tracker = mb.attach(model)
    assert tracker.layer_names == [f"model.layers.{i}.feed_forward.router" for i in range(2)]
    model(torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(4)))
    expected = torch.stack([torch.bincount(ids.reshape(-1), minlength=EXPERTS)
                            for ids in chosen])
    assert torch.equal(tracker.counts(), expected)
    assert int(expected.sum()) == 2 * 2 * 9 * 1        # layers x tokens x top-1


def test_longcat_identity_experts_are_not_counted_as_invalid_ids():
    # LongCat-Flash routes some tokens to zero-computation experts (ids past the routed ones)
    config = tf.LongcatFlashConfig(vocab_size=64, hidden_size=32, num_layers=1,
                                   num_attention_heads=4, num_key_value_heads=4, head_dim=8,
                                   v_head_dim=8, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                   kv_lora_rank=16, q_lora_rank=16, ffn_hidden_size=32,
                                   expert_ffn_hidden_size=16, n_routed_experts=EXPERTS,
                                   zero_expert_num=4, moe_topk=2, max_position_embeddings=64,
                                   pad_token_id=0, eos_token_id=None, bos_token_id=None)
    model = tf.AutoModelForCausalLM.from_config(config)
    chosen = []
    for name, module in model.named_modules():
        if name.endswith("mlp.router"):
            module.register_forward_hook(lambda m, a, out: chosen.append(out[2].clone()))
    topology = mb.Topology.uniform(1, EXPERTS)
    wrapped = mb.wrap(model, topology)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    rebalancer = mb.Rebalancer(wrapped, topology, optimizer, every=2)
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):
        ids = torch.randint(0, 64, (2, 16), generator=gen)
        wrapped(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        rebalancer.step()          # re-plans at step 2 from the counts: no invalid ids
    assert bool(torch.cat([c.reshape(-1) for c in chosen]).ge(EXPERTS).any()), \
        "no token went to an identity expert"
    chosen.clear()
    with torch.no_grad():
        wrapped(input_ids=ids)
    assert int(wrapped.moebalance_tracker.counts().sum()) == int((chosen[0] < EXPERTS).sum())


def test_an_optimizer_built_before_wrap_is_named_in_a_warning():
    model = tiny_hf_moe("qwen3_moe", experts=EXPERTS, hidden=32, expert_hidden=32, vocab=64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)     # the habit: before wrap
    with pytest.warns(UserWarning, match="optimizer built before mb.wrap"):
        mb.wrap(model, mb.Topology.uniform(1, EXPERTS))
    del optimizer
    fresh = tiny_hf_moe("qwen3_moe", experts=EXPERTS, hidden=32, expert_hidden=32, vocab=64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mb.wrap(fresh, mb.Topology.uniform(1, EXPERTS))
        torch.optim.AdamW(fresh.parameters(), lr=1e-3)               # after: no warning
