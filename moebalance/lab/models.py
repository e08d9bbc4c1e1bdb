"""A small MoE language model built from moebalance layers, and real text to train it on.

Used by the examples, ``moebalance bench train`` and the tests of the training-loop drivers: a
byte-level causal LM whose feed-forward blocks are :class:`~moebalance.nn.moe.ExpertParallelMoE`
layers (or :class:`~moebalance.nn.moe.DenseMoE` for the single-process reference), trained on the
Python standard library's source, which every machine has.

In a group of G ranks every rank holds the whole model except the expert slots. The
replicated parameters (embedding, attention, norms, routers) have their gradients summed over
the ranks during backward (:class:`~moebalance.nn.grad_sync.GradientSync`), the experts'
replicas among their holders, so with :func:`lm_loss` (a rank's summed token losses divided by
the *global* token count) the gradients equal those of one process on the global batch.

Legend: B sequences per rank, T sequence length, D hidden size, V vocabulary (256 bytes).
"""

from __future__ import annotations

import functools
import pathlib
import sysconfig

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..frameworks import check_ddp
from ..nn.grad_sync import GradientSync
from ..nn.moe import DenseMoE, ExpertParallelMoE
from ..placement import Placement

__all__ = ["MoELanguageModel", "lm_loss", "stdlib_corpus", "TextBatches", "tiny_hf_moe"]

VOCAB = 256


@functools.cache
def stdlib_corpus() -> tuple[np.ndarray, int]:
    """The standard library's .py files, concatenated in sorted path order, as uint8 bytes.

    Third-party packages installed inside the stdlib tree (site-packages) are left out.
    Returns (bytes [N], number of files); the array is read-only and read once per process
    (about 1,800 files, 30 MB: half a second, several seconds on a busy machine).
    """
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py")
                   if "site-packages" not in p.parts and "dist-packages" not in p.parts)
    if not files:
        raise RuntimeError(f"no .py files under the standard library directory {root}")
    data = b"\n".join(p.read_bytes() for p in files)
    return np.frombuffer(data, dtype=np.uint8), len(files)


@functools.cache
def _stdlib_tensor() -> torch.Tensor:
    """:func:`stdlib_corpus` as one tensor every :class:`TextBatches` of the process reads."""
    return torch.from_numpy(stdlib_corpus()[0].copy())


class TextBatches:
    """Seeded windows of the corpus: step s's global batch is the same on every rank.

    Args:
        seq_len: T (each window has T + 1 bytes: inputs and next-byte targets).
        batch_per_rank: B.
        world_size, rank: this rank takes rows ``[rank * B, (rank + 1) * B)`` of the global batch.
        seed: the stream's seed.
        corpus: bytes to draw from (default :func:`stdlib_corpus`).
    """

    def __init__(self, seq_len: int, batch_per_rank: int, world_size: int = 1, rank: int = 0,
                 seed: int = 0, corpus: np.ndarray | None = None) -> None:
        self.corpus = _stdlib_tensor() if corpus is None else torch.from_numpy(corpus.copy())
        self.seq_len, self.batch, self.world, self.rank, self.seed = (
            int(seq_len), int(batch_per_rank), int(world_size), int(rank), int(seed))

    def __call__(self, step: int) -> torch.Tensor:
        """[B, T + 1] int64 byte windows of step ``step`` for this rank."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, self.corpus.numel() - self.seq_len - 1,
                               (self.world * self.batch,), generator=gen)
        mine = starts[self.rank * self.batch:(self.rank + 1) * self.batch].tolist()
        return torch.stack([self.corpus[s:s + self.seq_len + 1] for s in mine]).long()


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int, moe: nn.Module) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.norm2 = nn.RMSNorm(dim)
        self.moe = moe

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        B, T, D = x_BTD.shape
        q, k, v = self.qkv(self.norm1(x_BTD)).view(B, T, 3, self.heads, D // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True)
        x_BTD = x_BTD + self.proj(att.transpose(1, 2).reshape(B, T, D))
        return x_BTD + self.moe(self.norm2(x_BTD))


class MoELanguageModel(nn.Module):
    """Byte-level causal LM: embedding, ``layers`` x (attention + MoE block), tied head.

    Args:
        placement: the experts' placement (None with ``dense=True``).
        hidden, ffn, experts, top_k, layers, heads: sizes.
        group: the expert-parallel group (None: default group / one process).
        dense: build DenseMoE blocks instead (the single-process reference).
        seed: every weight from this seed (the same on every rank, and in the dense model).
        moe_options: extra keywords for ExpertParallelMoE (exchange, nodes, ...).

    Forward: ``ids [B, T] -> logits [B, T, V]``.
    """

    def __init__(self, placement: Placement | None, *, hidden: int = 64, ffn: int = 128,
                 experts: int = 8, top_k: int = 2, layers: int = 2, heads: int = 4, group=None,
                 dense: bool = False, seed: int = 0, moe_options: dict | None = None) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.embed = nn.Embedding(VOCAB, hidden)
            nn.init.normal_(self.embed.weight, std=0.02)   # tied head: logits start near zero
            blocks = []
            for i in range(layers):
                if dense:
                    moe = DenseMoE(hidden, ffn, experts, top_k, seed=seed + 1 + i)
                else:
                    moe = ExpertParallelMoE(hidden, ffn, experts, top_k, placement, i, group,
                                            seed=seed + 1 + i, **(moe_options or {}))
                blocks.append(_Block(hidden, heads, moe))
            self.blocks = nn.ModuleList(blocks)
            self.norm = nn.RMSNorm(hidden)
        self._sync = None
        if not dense:
            world = self.blocks[0].moe.dispatcher.world_size
            if world > 1:
                replicated = [p for name, p in self.named_parameters() if ".moe." not in name]
                self._sync = GradientSync(self.blocks[0].moe.dispatcher.group, None, (), replicated)

    def forward(self, ids_BT: torch.Tensor) -> torch.Tensor:
        if self._sync is not None:
            # Under a DDP (which must leave the experts alone) DDP averages these instead.
            self._sync.group_enabled = check_ddp(self, self.blocks[0].moe.dispatcher.group) is None
        x = self.embed(ids_BT)
        for block in self.blocks:
            x = block(x)
        return F.linear(self.norm(x), self.embed.weight)


def lm_loss(logits_BTV: torch.Tensor, targets_BT: torch.Tensor, global_tokens: int) -> torch.Tensor:
    """Summed next-byte cross entropy over ``global_tokens`` (all ranks' tokens of the step)."""
    return F.cross_entropy(logits_BTV.flatten(0, 1).float(), targets_BT.flatten(),
                           reduction="sum") / global_tokens


def tiny_hf_moe(family: str = "qwen3_moe", *, layers: int = 2, experts: int = 8, top_k: int = 2,
                hidden: int = 64, expert_hidden: int = 64, vocab: int = VOCAB, seed: int = 0):
    """A small random-init transformers 5.x MoE causal LM (no download), the same on every rank.

    Args:
        family: "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss" or
            "phimoe".
        layers, experts, top_k, hidden, expert_hidden, vocab: sizes (bytes: vocab 256).
        seed: weights from this seed.
    """
    import transformers as tf

    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=expert_hidden,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, num_experts_per_tok=top_k,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    head_dim = hidden // 4
    configs = {
        "mixtral": lambda: tf.MixtralConfig(**common, num_local_experts=experts,
                                            router_jitter_noise=0.0),
        "qwen2_moe": lambda: tf.Qwen2MoeConfig(**common, num_experts=experts,
                                               moe_intermediate_size=expert_hidden,
                                               shared_expert_intermediate_size=expert_hidden),
        "qwen3_moe": lambda: tf.Qwen3MoeConfig(**common, num_experts=experts, head_dim=head_dim,
                                               moe_intermediate_size=expert_hidden,
                                               norm_topk_prob=True),
        "olmoe": lambda: tf.OlmoeConfig(**common, num_experts=experts, eos_token_id=None,
                                        pad_token_id=None),
        "deepseek_v3": lambda: tf.DeepseekV3Config(
            **{**common, "num_key_value_heads": 4}, n_routed_experts=experts,
            moe_intermediate_size=expert_hidden, n_group=2, topk_group=1, first_k_dense_replace=0,
            n_shared_experts=1, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=8),
        "gpt_oss": lambda: tf.GptOssConfig(**common, num_local_experts=experts, head_dim=head_dim,
                                           layer_types=["full_attention"] * layers),
        "phimoe": lambda: tf.PhimoeConfig(**common, num_local_experts=experts,
                                          router_jitter_noise=0.0, input_jitter_noise=0.0),
    }
    if family not in configs:
        raise ValueError(f"family must be one of {sorted(configs)}, got {family!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return tf.AutoModelForCausalLM.from_config(configs[family]())
