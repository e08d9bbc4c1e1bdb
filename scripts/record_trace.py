"""Record a real expert-load trace: train a tiny transformers MoE on Python source and count its
routing.

A byte-level transformers MoE model with no auxiliary balancing loss is trained with AdamW on
the ``.py`` files of the Python standard library (present on every machine, read in sorted
order). :func:`moebalance.attach` hooks its routers; after every optimizer step the step's
per-expert token counts are kept. Without a balancing loss the routers drift toward favourite
experts, which is the skew a load balancer has to absorb.

Model families (``--family``), each 16 experts in 4 layers by default:

* ``mixtral`` (default): Mixtral, top-2 of 16 experts of hidden size 128.
* ``qwen3_moe``: Qwen3-MoE, finer experts as in the Qwen3 models: top-4 of 16 experts of hidden
  size 64 (the same active expert width as the Mixtral default), top-k weights renormalised.
* ``olmoe``: OLMoE, top-4 of 16 experts of hidden size 64, top-k weights not renormalised.

Output (``--out``, default ``moebalance/lab/data/<family>_trace.npz``):

* ``counts``: int32 [steps, L, E] tokens routed to each expert in each MoE layer per step
  (each token counts once per chosen expert, so a step's row sums to tokens_per_step * top_k);
* ``meta``: JSON string: model configuration, batch, sequence length, seed, versions, the loss
  at the start and end, per-layer skew (max / mean load) at the start and end, the command.

Usage::

    python scripts/record_trace.py                  # 300 steps, writes the shipped Mixtral trace
    python scripts/record_trace.py --family qwen3_moe   # the shipped Qwen3-MoE trace
    python scripts/record_trace.py --quick          # 20 steps, prints the table, writes nothing
    python scripts/record_trace.py --steps 500 --seed 1 --out /tmp/trace.npz
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch

import moebalance as mb
from moebalance.lab.models import stdlib_corpus

DATA = pathlib.Path(__file__).resolve().parent.parent / "moebalance" / "lab" / "data"
VOCAB = 256  # bytes
# Statistics of "start" and "end" average this many steps.
EDGE_STEPS = 10


@dataclass(frozen=True)
class Family:
    """A transformers MoE family: its config class, the config fields for the expert count and
    the expert hidden size, its defaults, and settings of its own (top-k renormalisation)."""

    config_class: str
    experts_field: str
    expert_hidden_field: str
    top_k: int
    expert_hidden: int
    extra: dict = field(default_factory=dict)


FAMILIES = {
    "mixtral": Family("MixtralConfig", "num_local_experts", "intermediate_size", top_k=2,
                      expert_hidden=128, extra={"router_jitter_noise": 0.0}),
    # Every layer sparse (no dense MLP layers): intermediate_size, the dense MLP width, is unused.
    "qwen3_moe": Family("Qwen3MoeConfig", "num_experts", "moe_intermediate_size", top_k=4,
                        expert_hidden=64,
                        extra={"norm_topk_prob": True, "decoder_sparse_step": 1,
                               "mlp_only_layers": [], "use_sliding_window": False}),
    "olmoe": Family("OlmoeConfig", "num_experts", "intermediate_size", top_k=4, expert_hidden=64,
                    extra={"norm_topk_prob": False}),
}


def model_config(args) -> dict:
    """The config fields of the model ``args`` describe (JSON-ready, recorded in the trace)."""
    family = FAMILIES[args.family]
    return {
        "vocab_size": VOCAB, "hidden_size": args.hidden,
        family.expert_hidden_field: args.expert_hidden,
        "num_hidden_layers": args.layers, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": args.seq, family.experts_field: args.experts,
        "num_experts_per_tok": args.top_k, "router_aux_loss_coef": 0.0,
        "output_router_logits": False, **family.extra,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": True, "bos_token_id": None, "eos_token_id": None,
        "pad_token_id": None,
    }


def build_model(args):
    import transformers as tf

    config = getattr(tf, FAMILIES[args.family].config_class)(**model_config(args))
    return tf.AutoModelForCausalLM.from_config(config), config


def skew(counts_SLE: np.ndarray) -> np.ndarray:
    """max / mean expert load per layer of counts summed over the given steps: [L]."""
    total_LE = counts_SLE.sum(0).astype(np.float64)
    return total_LE.max(1) / total_LE.mean(1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=sorted(FAMILIES), default="mixtral",
                        help="transformers MoE family to train (default mixtral)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=pathlib.Path, default=None,
                        help="where to write the trace (default <family>_trace.npz in "
                             "moebalance/lab/data; --quick writes nothing unless --out is given)")
    parser.add_argument("--quick", action="store_true", help="20 steps, for a smoke test")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--expert-hidden", type=int, default=None,
                        help="hidden size of each expert (default: the family's, 128 or 64)")
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=None,
                        help="experts per token (default: the family's, 2 or 4)")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps = 20
    family = FAMILIES[args.family]
    args.top_k = family.top_k if args.top_k is None else args.top_k
    args.expert_hidden = family.expert_hidden if args.expert_hidden is None else args.expert_hidden
    out = args.out if args.out is not None else (None if args.quick
                                                 else DATA / f"{args.family}_trace.npz")
    for name in ("steps", "batch", "seq", "layers", "hidden", "expert_hidden", "experts", "top_k",
                 "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    corpus, num_files = stdlib_corpus()
    corpus_t = torch.from_numpy(corpus.copy())
    model, config = build_model(args)
    model.train()
    tracker = mb.attach(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                  weight_decay=0.1)
    warmup = max(1, args.steps // 20)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    gen = torch.Generator().manual_seed(args.seed)

    counts = np.zeros((args.steps, tracker.num_layers, tracker.num_experts), dtype=np.int32)
    losses = np.zeros(args.steps, dtype=np.float64)
    start = time.perf_counter()
    for step in range(args.steps):
        offsets = torch.randint(0, len(corpus) - args.seq - 1, (args.batch,), generator=gen)
        batch = torch.stack([corpus_t[o:o + args.seq] for o in offsets.tolist()]).long()
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        counts[step] = tracker.step().numpy()
        losses[step] = loss.item()
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {losses[step]:.3f}  {time.perf_counter() - start:6.1f} s",
                  flush=True)
    tracker.detach()
    wall = time.perf_counter() - start

    edge = min(EDGE_STEPS, args.steps)
    skew_start, skew_end = skew(counts[:edge]), skew(counts[-edge:])
    tokens = args.batch * args.seq
    expected_row = tokens * args.top_k
    if not np.all(counts.sum(2) == expected_row):
        raise RuntimeError("recorded counts do not add up to tokens * top_k per layer and step")

    print(f"\n{args.steps} steps, {tokens} tokens/step, {wall:.1f} s; "
          f"loss {losses[:edge].mean():.3f} -> {losses[-edge:].mean():.3f}")
    print(f"max/mean expert load per layer (first / last {edge} steps):")
    print("| layer | start | end |\n|---:|---:|---:|")
    for layer in range(tracker.num_layers):
        print(f"| {layer} | {skew_start[layer]:.2f} | {skew_end[layer]:.2f} |")

    if out is None:
        return 0
    meta = {
        "model": f"{type(model).__name__} (transformers), random init, byte-level vocabulary",
        "family": args.family,
        "config": model_config(args),
        "layer_names": tracker.layer_names,
        "optimizer": {"name": "AdamW", "lr": args.lr, "betas": [0.9, 0.95], "weight_decay": 0.1,
                      "warmup_steps": warmup, "grad_clip": 1.0},
        "data": {"source": "Python standard library .py files, sorted by path, concatenated",
                 "files": num_files, "bytes": int(len(corpus)),
                 "sampling": "uniform random windows"},
        "steps": args.steps, "batch": args.batch, "seq": args.seq, "tokens_per_step": tokens,
        "seed": args.seed,
        "loss_start": float(losses[:edge].mean()), "loss_end": float(losses[-edge:].mean()),
        "loss_every_10_steps": [round(float(x), 4) for x in losses[::10]],
        "skew_steps": edge,
        "max_over_mean_start": [round(float(x), 4) for x in skew_start],
        "max_over_mean_end": [round(float(x), 4) for x in skew_end],
        "python": platform.python_version(), "torch": torch.__version__,
        "transformers": __import__("transformers").__version__, "numpy": np.__version__,
        "moebalance": mb.__version__, "threads": args.threads, "wall_s": round(wall, 1),
        "command": ("python scripts/record_trace.py "
                    + " ".join(sys.argv[1:] if argv is None else argv)),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out, counts=counts, meta=np.array(json.dumps(meta)))
    print(f"\nwrote {out.name}: counts {counts.shape} int32, {out.stat().st_size / 1024:.0f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
