"""Which transformers MoE families ``mb.wrap`` serves, checked on this machine.

For every MoE causal LM configuration class of the installed transformers (the list below), a
tiny random-init model (hidden 32, 2 layers, 8 experts, top-2; fp64, eager experts) runs one
batch plain and then wrapped on one process (a topology of one device holding every expert):
the logits and the embedding's gradient of the summed logits must be equal, and the tracker
``mb.wrap`` attaches must count every routed expert the routers chose (LongCat-Flash's
identity experts take no slot and are not counted). The family's own
``save_pretrained`` checkpoint is then loaded with ``mb.from_pretrained`` and must give the same
logits. Each family is served exactly or refused with one line; a difference is a bug.

Usage::

    python scripts/check_families.py               # every family known here
    python scripts/check_families.py PhimoeConfig  # some of them

Prints one row per family: served exactly (with the largest difference), refused (wrap's
line), or not built (this transformers cannot build it from the tiny configuration).
"""

from __future__ import annotations

import argparse
import tempfile
import warnings

import torch

import moebalance as mb
from moebalance.integrations.routers import find_routers

EXPERTS = 8
# Fields the configuration classes name differently; each class ignores those it lacks.
COMMON = dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=64,
              num_local_experts=EXPERTS, num_experts=EXPERTS, n_routed_experts=EXPERTS,
              moe_num_experts=EXPERTS, num_experts_per_tok=2, moe_k=2, moe_topk=2, top_k=2,
              first_k_dense_replace=0, n_group=1, topk_group=1, q_lora_rank=None,
              kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
              eos_token_id=None, pad_token_id=0, bos_token_id=None, max_position_embeddings=64,
              decoder_sparse_step=1, mlp_only_layers=[], moe_layer_freq=1, num_shared_experts=1,
              n_shared_experts=1, tie_word_embeddings=False, router_jitter_noise=0.0,
              input_jitter_noise=0.0)
MLA = dict(num_key_value_heads=2)      # latent attention: heads from the rope/nope split
OVERRIDES = {
    "DeepseekV2Config": MLA, "Glm4MoeLiteConfig": MLA,
    "DeepseekV32Config": dict(MLA, q_lora_rank=16, index_topk=8, index_n_heads=2,
                              index_head_dim=16),
    "GlmMoeDsaConfig": dict(MLA, q_lora_rank=16, index_topk=8, index_n_heads=2, index_head_dim=16),
    "DeepseekV3Config": dict(num_attention_heads=4, num_key_value_heads=4, v_head_dim=8,
                             head_dim=8),
    "LongcatFlashConfig": dict(num_attention_heads=4, num_key_value_heads=4, v_head_dim=8,
                               head_dim=8, num_layers=2, q_lora_rank=16),
    "Qwen3NextConfig": dict(num_hidden_layers=4),
    "Qwen3_5MoeTextConfig": dict(num_hidden_layers=4),
    "JambaConfig": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=1,
                        expert_layer_offset=0, use_mamba_kernels=False),
}
FAMILIES = ("MixtralConfig", "Qwen2MoeConfig", "Qwen3MoeConfig", "OlmoeConfig", "DeepseekV3Config",
            "DeepseekV2Config", "LongcatFlashConfig",
            "DeepseekV32Config", "GptOssConfig", "PhimoeConfig", "Glm4MoeConfig",
            "Glm4MoeLiteConfig", "GlmMoeDsaConfig", "MiniMaxConfig", "MiniMaxM2Config",
            "Qwen3NextConfig", "Qwen3_5MoeTextConfig", "JambaConfig", "Ernie4_5_MoeConfig",
            "Dots1Config", "HunYuanMoEV1Config", "FlexOlmoConfig", "GraniteMoeConfig",
            "GraniteMoeSharedConfig", "Cohere2MoeConfig", "AfmoeConfig", "ExaoneMoeConfig",
            "MiniCPM5MoeConfig", "Param2MoeConfig", "SarvamMoEConfig", "SolarOpenConfig",
            "JetMoeConfig", "Llama4TextConfig")


def build(name: str):
    import transformers as tf

    config = getattr(tf, name)(**{**COMMON, **OVERRIDES.get(name, {})})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                    dtype=torch.float64)
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")    # grouped_mm refuses fp64
    return model.eval()


def run(model, ids):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits
    logits.sum().backward()
    return logits.detach(), model.get_input_embeddings().weight.grad.clone()


def check(name: str, ids) -> str:
    try:
        model = build(name)
        want_logits, want_grad = run(model, ids)
    except Exception as e:          # noqa: BLE001 -- a family this transformers cannot build
        return f"not built: {type(e).__name__}: {str(e).splitlines()[0][:90]}"
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)               # the family's own checkpoint layout
        try:
            mb.wrap(model, mb.Topology.uniform(1, EXPERTS))
        except ValueError as e:
            return f"refused: {str(e)[:150]}"
        chosen = []             # the routers' own choices of routed experts, by our hooks
        hooks = [router.register_forward_hook(
                     lambda m, a, out: chosen.append(int((out[2] < EXPERTS).sum())))
                 for _, router, _ in find_routers(model)]
        logits, grad = run(model, ids)
        for hook in hooks:
            hook.remove()
        tracked = int(model.moebalance_tracker.counts().sum()) == sum(chosen)
        gap = max(float((logits - want_logits).abs().max()),
                  float((grad - want_grad).abs().max()))
        try:
            loaded = mb.from_pretrained(folder, mb.Topology.uniform(1, EXPERTS), track=False,
                                        dtype=torch.float64, attn_implementation="eager")
            with torch.no_grad():
                loaded_gap = float((loaded(input_ids=ids).logits - want_logits).abs().max())
        except ValueError as e:
            loaded_gap, refused = None, str(e)[:100]
    if gap > 1e-10:
        return f"WRONG: wrap differs by {gap:.2e}"
    if not tracked:
        return "WRONG: the tracker's counts miss tokens"
    if loaded_gap is None:
        return f"served exactly (max difference {gap:.1e}); from_pretrained refused: {refused}"
    if loaded_gap > 1e-10:
        return f"WRONG: from_pretrained differs by {loaded_gap:.2e}"
    return f"served exactly (max difference {gap:.1e}), from_pretrained too ({loaded_gap:.1e})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*", help=f"configuration class names (default: "
                                                    f"{len(FAMILIES)} families)")
    args = parser.parse_args()
    import transformers

    warnings.filterwarnings("ignore")
    ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    wrong = 0
    for name in args.families or FAMILIES:
        verdict = check(name, ids)
        wrong += verdict.startswith("WRONG")
        print(f"{name:24s} {verdict}", flush=True)
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
